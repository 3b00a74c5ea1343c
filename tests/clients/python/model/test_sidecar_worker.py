"""SmolLM2 with its KV cache in a real kvsidecar server (loopback, $KVSIDECAR_BIN): the
sidecar-backed cache is exact when nothing is evicted, keeps a budget when compressing, and the
worker command answers a question about a long text with a fraction of the memory."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvsidecar as kvs
from kvsidecar.model import LocalKVCache
from kvsidecar.model.sidecar_cache import SidecarKVCache, blocks_needed, layout_for, policy_spec

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
ALICE = os.path.join(REPO, "bench", "quality", "data", "alice_ch1.txt")
# The end of the chapter: Alice talks about Dinah, "(Dinah was the cat.)" (about 250 tokens).
STORY_START = "Down, down, down. There was nothing else"


def _story():
    with open(ALICE, encoding="utf-8") as f:
        text = f.read()
    return text[text.index(STORY_START):]


@pytest.fixture
def session(server, model):
    with kvs.Client(server.address, timeout=120, worker_name="pytest-model") as client, \
            client.attach(layout_for(model.cfg, "fp32"),
                          num_blocks=2 * blocks_needed(model.cfg, 512)) as s:
        yield s


def test_unbounded_sidecar_cache_gives_the_local_logits_exactly(session, model, tokenizer):
    ids = tokenizer.encode(_story())[:96]
    local = model.prefill(ids, LocalKVCache(model.cfg), block_size=32, all_logits=True)
    cache = SidecarKVCache(session, model.cfg, policy_spec("snapkv"), budget_tokens=0)
    remote = model.prefill(ids, cache, block_size=32, all_logits=True)
    # fp32 K/V written into the arena and gathered back by block table: bit-identical.
    assert np.array_equal(remote, local)
    assert cache.counts == [96] * model.cfg.n_layers
    assert cache.kv_bytes() == cache.full_kv_bytes() == 96 * 30 * 2 * 3 * 64 * 4
    # Decode steps through DecodeStep keep matching the local cache.
    cache.finish_prefill()
    ref_cache = LocalKVCache(model.cfg)
    model.prefill(ids, ref_cache, block_size=32)
    for i, tok in enumerate(tokenizer.encode(" Alice was")):
        a = model.forward([tok], [96 + i], cache)
        b = model.forward([tok], [96 + i], ref_cache)
        assert np.array_equal(a, b)
    assert cache.counts == [98] * model.cfg.n_layers
    cache.release()


@pytest.mark.parametrize("dtype,tol", [("fp16", 0.1), ("bf16", 0.5)])
def test_half_precision_sidecar_cache_stays_close(server, model, tokenizer, dtype, tol):
    ids = tokenizer.encode(_story())[:64]
    local = model.prefill(ids, LocalKVCache(model.cfg), block_size=32, all_logits=True)
    with kvs.Client(server.address, timeout=120) as client, \
            client.attach(layout_for(model.cfg, dtype),
                          num_blocks=blocks_needed(model.cfg, 128)) as s:
        cache = SidecarKVCache(s, model.cfg, policy_spec("keydiff"), budget_tokens=0)
        remote = model.prefill(ids, cache, block_size=32, all_logits=True)
        assert cache.kv_bytes() == 64 * 30 * 2 * 3 * 64 * 2
        cache.release()
    diff = np.abs(remote - local).max()
    assert 0 < diff < tol  # rounded K/V (not bit-equal), but the same model
    assert (remote.argmax(-1) == local.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("policy,mode", [("h2o", "blockwise"), ("snapkv", "full")])
def test_budget_is_kept_and_heads_keep_different_tokens(session, model, tokenizer, policy, mode):
    prompt = tokenizer.encode(tokenizer.chat_prompt(
        _story() + "\n\nQuestion: What was the name of Alice's cat?"))
    budget = 128
    cache = SidecarKVCache(session, model.cfg, policy_spec(policy, budget), budget, mode)
    gen = model.generate(prompt, cache, 20, block_size=64,
                         stop_ids=[tokenizer.im_end_id, tokenizer.eos_id])
    assert cache.tokens_seen == len(prompt) + len(gen.logits) - 1
    assert max(cache.counts) <= budget < len(prompt)
    if mode == "blockwise":  # never more than the budget after a commit
        assert cache.peak_tokens <= budget * model.cfg.n_layers
    layout = session.get_layout(cache.sequence_id)
    assert all(e.count <= budget for e in layout.layers)
    pos = np.asarray(layout.layers[10].positions).reshape(3, -1)
    assert len({tuple(sorted(p)) for p in pos}) > 1, "every head kept the same tokens"
    assert "Dinah" in tokenizer.decode(gen.tokens), (len(prompt), tokenizer.decode(gen.tokens))
    cache.release()


def test_worker_command_answers_with_less_memory(server, model, tmp_path):
    story = tmp_path / "story.txt"
    story.write_text(_story())
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar.model.worker", "--prompt-file", str(story),
         "--question", "What was the name of Alice's cat?", "--budget", "50%",
         "--policy", "snapkv", "--max-new-tokens", "12", "--dtype", "fp16",
         "--server", server.address, "--json"],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Dinah" in r["text"] and "Dinah" in r["reference_text"]
    assert 0 < r["kv_bytes_kept"] < 0.6 * r["kv_bytes_full"]
    assert r["kv_tokens_per_layer"] <= r["budget_tokens"] == round(0.5 * r["prompt_tokens"])
    assert r["greedy_common_prefix"] >= 1  # the first token comes from the same full prefill
    assert r["forced_top1_agreement"] >= 0.7 and r["forced_mean_kl"] < 0.5
