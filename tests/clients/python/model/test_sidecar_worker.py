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
from numpy_llama import LocalKVCache
from numpy_llama.sidecar_cache import SidecarKVCache, blocks_needed, layout_for, policy_spec

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
        [sys.executable, "-m", "numpy_llama.worker", "--prompt-file", str(story),
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


def _decode_forced(model, cache, ids, start, check=None):
    """Teacher-forced decode steps of `ids` from position `start`; returns their logits."""
    out = []
    for i, tok in enumerate(ids):
        out.append(model.forward([tok], [start + i], cache))
        if check is not None:
            check()
    return out


@pytest.mark.parametrize("policy,mode", [
    ("streaming_llm", "blockwise"), ("keydiff", "full"), ("h2o", "blockwise"),
    ("tova", "full"), ("snapkv", "full"), ("cake", "blockwise"), ("d2o", "blockwise"),
    ("caote", "full")])
def test_mirror_matches_the_arena_after_every_decode_step(session, model, tokenizer, policy,
                                                          mode):
    """The worker's float32 mirror, updated from DecodeStep's evicted positions by replaying the
    sidecar's hole-filling compaction, holds exactly what the arena holds, slot by slot."""
    ids = tokenizer.encode(_story())
    prompt, cont = ids[:80], ids[80:88]
    budget = 32
    cache = SidecarKVCache(session, model.cfg, policy_spec(policy, budget), budget, mode)
    cache.begin_prefill(len(prompt))
    model.prefill(prompt, cache, block_size=32, align_last=True)
    cache.finish_prefill()
    model.forward([cont[0]], [80], cache)  # the first step reads back the compressed prompt
    cache.verify_mirror()
    resyncs = cache.resyncs
    _decode_forced(model, cache, cont[1:], 81, cache.verify_mirror)
    # D2O and CAKE split the budget across layers with their own allocators.
    assert sum(cache.counts) <= budget * model.cfg.n_layers
    assert cache.evicted_total > 0
    if policy != "d2o":  # D2O merges evicted rows into kept ones: those layers are read back
        assert cache.resyncs == resyncs, "decode steps read the arena instead of the answer"
    cache.release()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_mirror_gives_the_read_through_logits_exactly(server, model, tokenizer, dtype):
    """Under eviction, attending over the mirror is bit-identical to re-reading every layer from
    the arena at every step (what a worker without a mirror does)."""
    ids = tokenizer.encode(_story())
    prompt, cont = ids[:72], ids[72:80]
    budget = 40
    with kvs.Client(server.address, timeout=120) as client, \
            client.attach(layout_for(model.cfg, dtype),
                          num_blocks=2 * blocks_needed(model.cfg, 128)) as s:
        logits = []
        for read_through in (False, True):
            # The mirror path overlaps each DecodeStep with the logits; read-through waits.
            cache = SidecarKVCache(s, model.cfg, policy_spec("h2o", budget), budget,
                                   "blockwise", read_through=read_through,
                                   overlap=not read_through)
            model.prefill(prompt, cache, block_size=24)
            cache.finish_prefill()
            logits.append(_decode_forced(model, cache, cont, len(prompt)))
            assert cache.counts == [budget] * model.cfg.n_layers
            cache.verify_mirror()
            cache.release()
    assert all(np.array_equal(a, b) for a, b in zip(*logits))


def test_batch_of_8_decodes_like_8_single_runs(server, model, tokenizer):
    """Llama.generate_batch: 8 sequences prefilled in lockstep (BatchReserve / BatchCommit) and
    decoded together (one DecodeStep per step for the batch) produce the greedy tokens of 8
    independent batch-1 runs, under eviction."""
    ids = tokenizer.encode(_story())
    prompts = [ids[7 * i: 7 * i + 40 + 6 * i] for i in range(8)]
    budget, n_new = 32, 8
    with kvs.Client(server.address, timeout=120) as client, \
            client.attach(layout_for(model.cfg, "fp32"),
                          num_blocks=16 * blocks_needed(model.cfg, 128)) as s:
        singles = []
        for p in prompts:
            cache = SidecarKVCache(s, model.cfg, policy_spec("h2o", budget), budget, "full")
            singles.append(model.generate(p, cache, n_new, block_size=32))
            cache.release()
        caches = [SidecarKVCache(s, model.cfg, policy_spec("h2o", budget), budget, "full")
                  for _ in prompts]
        calls, reserves = [], []
        real_step, real_reserve = s.decode_step_future, s.batch_reserve
        s.decode_step_future = lambda items: calls.append(len(items)) or real_step(items)
        s.batch_reserve = lambda items: reserves.append(len(items)) or real_reserve(items)
        batch = model.generate_batch(prompts, caches, n_new, block_size=32)
        del s.decode_step_future, s.batch_reserve
        for c in caches:
            c.verify_mirror()
            assert max(c.counts) <= budget
            c.release()
    assert calls == [8] * (n_new - 1)  # one DecodeStep per step for the whole batch
    # Prefill in lockstep: prompts of 40..82 tokens in blocks of 32 (the first block takes the
    # remainder), one BatchReserve per block step for every prompt that has a block left.
    assert reserves == [8, 8, 3]
    for one, many in zip(singles, batch):
        assert many.tokens == one.tokens
        assert np.allclose(np.stack(many.logits), np.stack(one.logits), atol=1e-3)
