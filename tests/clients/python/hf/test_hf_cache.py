"""kvsidecar.hf.SidecarCache on tiny randomly initialised transformers models (Llama, Qwen2 and
Gemma 3 with its sliding-window layers, built from a config here: nothing is downloaded) against
a real kvsidecar server on loopback.

Full budget: the same greedy tokens as DynamicCache and logits within LOGIT_TOL (fp32 arena:
the K/V the model attends to are the same numbers, only gathered from the arena). Under a
budget: what the model's attention reads is, slot for slot, what GetLayout and the arena hold,
and the kept set is the one the sidecar's Score dry run picks."""

import inspect
import warnings

import numpy as np
import pytest
import torch
from transformers import (DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, T5Config, T5ForConditionalGeneration)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvsidecar as kvs
from kvsidecar.hf import SidecarCache, UnsupportedModelError, blocks_for, layout_for

torch.set_num_threads(1)
# transformers 5.2 takes the cache as past_key_values; later releases renamed it `cache` (the old
# name still works, with a FutureWarning).
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
    else "past_key_values"
# fp32 everywhere; the only difference from DynamicCache is where K/V are read from.
LOGIT_TOL = 1e-4
PROMPT = 40
# Gemma 3's sliding layers (two of three here) see a token and the SLIDING - 1 before it, fewer
# than the prompt: the sidecar holds SLIDING - 1 tokens of them whatever the policy.
SLIDING = 8
GEMMA_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


def _common(max_positions=256, **extra):
    return dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max_positions, initializer_range=0.2, **extra)


def make_model(family="llama", attn="sdpa", max_positions=256):
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_common(max_positions)))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_common()))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**_common(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING,
            layer_types=GEMMA_TYPES)))
    else:
        raise ValueError(family)
    model.set_attn_implementation(attn)
    return model.eval()


def held(family, tokens, budget=None):
    """Tokens each of the 3 layers holds after `tokens` were appended under `budget`."""
    full = tokens if budget is None else min(budget, tokens)
    if family != "gemma3":
        return [full] * 3
    return [min(tokens, SLIDING - 1) if t == "sliding_attention" else full for t in GEMMA_TYPES]


def prompts(batch, length=PROMPT, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 96, (batch, length), generator=g)


@pytest.fixture
def session(server):
    model = make_model()
    with kvs.Client(server.address, timeout=60, worker_name="pytest-hf") as client, \
            client.attach(layout_for(model, "fp32"),
                          num_blocks=blocks_for(model, 128, batch_size=8)) as s:
        yield s


def _generate(model, ids, cache, steps=12, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE: cache},
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0, **kw)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"),
                                         ("qwen2", "sdpa"), ("gemma3", "sdpa"),
                                         ("gemma3", "eager")])
def test_full_budget_generates_what_dynamic_cache_does(server, family, attn):
    model = make_model(family, attn)
    ids = prompts(2)
    ref = _generate(model, ids, DynamicCache(config=model.config))
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=blocks_for(model, 64, 2)) as s:
        cache = SidecarCache(s, model, policy="snapkv", budget=1.0)
        out = _generate(model, ids, cache)
        assert torch.equal(out.sequences, ref.sequences)
        diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
        assert diff <= LOGIT_TOL, diff
        # Every token but the last generated one went through the cache, nothing evicted.
        assert cache.get_seq_length() == PROMPT + 11
        assert cache.counts == [held(family, PROMPT + 11)] * 2
        cache.release()


def test_decode_steps_read_the_layouts_the_previous_step_answered(session, monkeypatch):
    """Each DecodeStep answers with the rows' layouts (return_layout): the next step reads the
    held K/V by them, so only the first decode step (after the prefill's commit) asks GetLayout,
    and the tokens are still DynamicCache's."""
    model = make_model()
    ids = prompts(2)
    ref = _generate(model, ids, DynamicCache(config=model.config))
    asked = []
    real = session.get_layout_future

    def counting(*args, **kwargs):
        asked.append(args[0] if args else kwargs.get("sequence_id"))
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "get_layout_future", counting)
    cache = SidecarCache(session, model, policy="snapkv", budget=1.0)
    out = _generate(model, ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert sorted(asked) == sorted(cache.sequence_ids)  # one per row, before the first step
    cache.release()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_plain_forward_loop_with_chunked_prefill_matches_dynamic_cache(session, family):
    """Two prefill chunks (the second attends to the first from the arena, with the slot mask;
    Gemma's sliding layers mask the held slots that left the window by position) and decode
    steps in a hand-written loop."""
    model = make_model(family)
    ids = prompts(2, 48)
    cache = SidecarCache(session, model, policy="h2o", budget=None)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        for chunk in (ids[:, :30], ids[:, 30:]):
            a = model(chunk, **{CACHE: cache}, use_cache=True).logits
            b = model(chunk, **{CACHE: ref}, use_cache=True).logits
            assert float((a - b).abs().max()) <= LOGIT_TOL
        tok = a[:, -1:].argmax(-1)
        for _ in range(5):
            a = model(tok, **{CACHE: cache}, use_cache=True).logits
            b = model(tok, **{CACHE: ref}, use_cache=True).logits
            assert float((a - b).abs().max()) <= LOGIT_TOL
            tok = a[:, -1:].argmax(-1)
    assert cache.counts == [held(family, 53)] * 2
    cache.release()


class _Recorder:
    """Wraps the registered sdpa: records the queries and K/V each layer's attention reads."""

    def __init__(self):
        self.queries = {}
        self.keys = {}
        self.values = {}
        self.original = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]

    def __call__(self, module, query, key, value, mask, **kw):
        self.queries[module.layer_idx] = query.detach().clone()
        self.keys[module.layer_idx] = key.detach().clone()
        self.values[module.layer_idx] = value.detach().clone()
        return self.original(module, query, key, value, mask, **kw)


def _layer_state(session, seq, layer):
    layout = session.get_layout(seq)
    kv = session.read_layer(layout, layer)
    return kv.k, kv.v, kv.positions


def _score_kept(session, seq, layer, budget, policy, attn):
    resp = session.score(seq, budget_tokens=budget, policy=policy, attention=attn,
                         layers=[layer])
    entry = resp.layers[0]
    pos = np.asarray(entry.positions).reshape(2, -1)  # [H][count], slot order
    slots = np.asarray(entry.kept_slots).reshape(2, -1)  # [H][kept]
    return [sorted(pos[h][slots[h]].tolist()) for h in range(2)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("name,fraction", [("snapkv", 0.25), ("h2o", 0.5),
                                           ("streaming_llm", 0.25), ("keydiff", 0.5),
                                           ("tova", 0.25)])
def test_under_budget_attention_reads_the_layout_and_the_score_kept_set(
        session, monkeypatch, family, name, fraction):
    model = make_model(family)
    ids = prompts(2)
    budget = int(np.ceil(fraction * PROMPT))
    spec = kvs.policy(name)
    recorder = _Recorder()
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recorder)
    # The reference, independent of SidecarCache's query capture: every prompt query as the
    # library's own attention saw it with DynamicCache; the sidecar's Score takes from them what
    # the policy reads. `full` holds the same K/V with a policy that keeps no query state.
    full = SidecarCache(session, model, policy="streaming_llm", budget=None)
    small = SidecarCache(session, model, policy=spec, budget=fraction)
    with torch.no_grad():
        model(ids, **{CACHE: DynamicCache(config=model.config)}, use_cache=True)
        queries = [recorder.queries[layer] for layer in range(3)]
        model(ids, **{CACHE: full}, use_cache=True)
        logits = model(ids, **{CACHE: small}, use_cache=True).logits
    assert small.budget_tokens == budget
    assert small.counts == [held(family, PROMPT, budget)] * 2
    for row in range(2):
        attn = kvs.attention(torch.stack([q[row] for q in queries]).numpy(),
                             query_positions=list(range(PROMPT)))
        for layer in range(3):
            kept = _score_kept(session, full.sequence_ids[row], layer, budget, spec, attn)
            _, _, pos = _layer_state(session, small.sequence_ids[row], layer)
            assert [sorted(p) for p in pos.tolist()] == kept, (row, layer)
    # A decode step: each layer's attention reads exactly the arena's slots, in slot order,
    # then the new token; the sidecar then evicts back to the budget.
    for step in range(4):
        small.sync()
        before = [[_layer_state(session, seq, layer) for layer in range(3)]
                  for seq in small.sequence_ids]
        tok = logits[:, -1:].argmax(-1)
        with torch.no_grad():
            logits = model(tok, **{CACHE: small}, use_cache=True).logits
        for row in range(2):
            for layer in range(3):
                k, v, pos = before[row][layer]
                n = k.shape[1]
                assert n == held(family, PROMPT, budget)[layer]
                got_k = recorder.keys[layer][row]
                got_v = recorder.values[layer][row]
                assert got_k.shape[1] == n + 1
                assert np.array_equal(got_k[:, :n].numpy(), k), (step, row, layer)
                assert np.array_equal(got_v[:, :n].numpy(), v), (step, row, layer)
        after = small.counts
        assert after == [held(family, PROMPT, budget)] * 2
        assert small.get_seq_length() == PROMPT + step + 1
    # The new token was appended at its true position and the kept positions are real ones.
    _, _, pos = _layer_state(session, small.sequence_ids[0], 2)
    assert pos.max() <= PROMPT + 3 and len(set(pos[0].tolist())) == budget
    if family == "gemma3":
        # A sliding layer holds exactly the window's tokens, whatever the policy chose.
        for layer in (0, 1):
            _, _, pos = _layer_state(session, small.sequence_ids[0], layer)
            assert [sorted(p) for p in pos.tolist()] == \
                [list(range(PROMPT + 4 - (SLIDING - 1), PROMPT + 4))] * 2
    full.release()
    small.release()


def test_snapkv_with_kvpress_defaults_sends_the_window_the_sidecar_resolves(session, monkeypatch):
    # DEFAULTS_KVPRESS resolves SnapKV's unset window to kvpress's 64 queries, not the paper's
    # 32: SidecarCache must send that many, or the kept set is the one a 32-query window gives.
    model = make_model()
    length, fraction = 120, 0.75  # 90 kept: above the window, so the scores decide
    ids = prompts(1, length=length)
    spec = kvs.policy("snapkv", defaults=kvs.common_pb2.SnapKvParams.DEFAULTS_KVPRESS)
    recorder = _Recorder()
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recorder)
    full = SidecarCache(session, model, policy="streaming_llm", budget=None)
    small = SidecarCache(session, model, policy=spec, budget=fraction)
    with torch.no_grad():
        model(ids, **{CACHE: DynamicCache(config=model.config)}, use_cache=True)
        queries = [recorder.queries[layer] for layer in range(3)]
        model(ids, **{CACHE: full}, use_cache=True)
        model(ids, **{CACHE: small}, use_cache=True)
    small.sync()
    budget = small.budget_tokens
    assert budget == int(np.ceil(fraction * length))
    attn = kvs.attention(torch.stack([q[0] for q in queries]).numpy(),
                         query_positions=list(range(length)))
    for layer in range(3):
        kept = _score_kept(session, full.sequence_ids[0], layer, budget, spec, attn)
        _, _, pos = _layer_state(session, small.sequence_ids[0], layer)
        assert [sorted(p) for p in pos.tolist()] == kept, layer
    full.release()
    small.release()


def test_batch_of_four_generates_under_a_budget(session):
    model = make_model()
    ids = prompts(4, 32, seed=5)
    cache = SidecarCache(session, model, policy="snapkv", budget=16)
    out = _generate(model, ids, cache, steps=10)
    assert out.sequences.shape == (4, 42)
    assert cache.counts == [[16] * 3] * 4
    # Each row is its own sequence: the same prompt alone gives the same tokens.
    solo = SidecarCache(session, model, policy="snapkv", budget=16)
    one = _generate(model, ids[2:3], solo, steps=10)
    assert torch.equal(one.sequences[0], out.sequences[2])
    cache.release()
    solo.release()


def _left_padded(batch=3, length=30, seed=9):
    """Rows of `length` - 7 * row real tokens, padded on the left (as generate wants them)."""
    ids = prompts(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :7 * row] = 0
        ids[row, :7 * row] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_left_padded_batch_generates_what_dynamic_cache_does(session, family):
    """Padding never reaches the sidecar (each row holds its real tokens only), and the model
    reads the same numbers as with DynamicCache: same tokens, logits within LOGIT_TOL."""
    model = make_model(family)
    ids, mask = _left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **{CACHE: DynamicCache(config=model.config)}, **kw)
        cache = SidecarCache(session, model, policy="h2o", budget=None)
        out = model.generate(ids, **{CACHE: cache}, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
    assert diff <= LOGIT_TOL, diff
    assert cache.counts == [held(family, 30 - 7 * row + 9) for row in range(3)]
    cache.release()


def test_left_padded_rows_under_a_budget_generate_what_each_row_does_alone(session):
    """Under a budget a padded row's policy sees its real tokens and queries only: the row
    generates what the same prompt generates unpadded, alone."""
    model = make_model()
    ids, mask = _left_padded()
    for name in ("snapkv", "h2o"):
        cache = SidecarCache(session, model, policy=name, budget=12)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **{CACHE: cache}, max_new_tokens=8,
                                 min_new_tokens=8, do_sample=False, pad_token_id=0)
        assert cache.counts == [[12] * 3] * 3
        cache.release()
        for row in range(3):
            solo = SidecarCache(session, model, policy=name, budget=12)
            one = _generate(model, ids[row:row + 1, 7 * row:], solo, steps=8)
            assert torch.equal(one.sequences[0, -8:], out[row, -8:]), (name, row)
            solo.release()


def test_sampling_with_a_fixed_seed(session):
    model = make_model("qwen2")
    ids = prompts(2, 24)
    runs = []
    for budget in (None, None, 8):
        cache = SidecarCache(session, model, policy="tova", budget=budget)
        torch.manual_seed(123)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE: cache},
                                 max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=20,
                                 temperature=1.5, pad_token_id=0)
        runs.append(out)
        cache.release()
    torch.manual_seed(123)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids),
                             **{CACHE: DynamicCache(config=model.config)},
                             max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=20,
                             temperature=1.5, pad_token_id=0)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], ref)
    assert runs[2].shape == (2, 32)


def test_unsupported_models_and_calls_are_named(session):
    torch.manual_seed(0)
    chunked = LlamaForCausalLM(LlamaConfig(**_common()))
    chunked.config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="layer 1 is a 'chunked_attention' layer"):
        SidecarCache(session, chunked)
    # Sliding windows are served: every layer (Mistral) or some (Qwen2's max_window_layers).
    mistral = MistralForCausalLM(MistralConfig(**_common(sliding_window=16)))
    assert SidecarCache(session, mistral).sidecar_windows == [15, 15, 15]
    qwen_sliding = Qwen2ForCausalLM(Qwen2Config(**_common(
        use_sliding_window=True, sliding_window=16, max_window_layers=1)))
    assert SidecarCache(session, qwen_sliding).windows == [0, 16, 16]
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1,
                                             num_heads=2, d_kv=8))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        SidecarCache(session, t5)
    cross = make_model()
    cross.config.add_cross_attention = True
    with pytest.raises(UnsupportedModelError, match="cross-attention"):
        SidecarCache(session, cross)
    quantized = make_model()
    quantized.config.quantization_config = {"kv_cache_scheme": {"num_bits": 8}}
    with pytest.raises(UnsupportedModelError, match="quantized KV caches"):
        SidecarCache(session, quantized)
    bidirectional = make_model("gemma3")
    bidirectional.config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        SidecarCache(session, bidirectional)
    bigger = LlamaForCausalLM(LlamaConfig(**dict(_common(), num_hidden_layers=4)))
    with pytest.raises(UnsupportedModelError, match="does not match"):
        SidecarCache(session, bigger)
    model = make_model()
    # Right padding is refused before anything is committed (left padding is served).
    ids = prompts(2, 16)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    cache = SidecarCache(session, model, policy="snapkv", budget=8)
    with pytest.raises(UnsupportedModelError, match="pad the prompts on the left"):
        with torch.no_grad():
            model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True)
    assert cache.counts == [[0] * 3] * 2
    cache.release()
    # Beam search reorders the cache: refused by name.
    cache = SidecarCache(session, model, policy="snapkv", budget=8)
    with pytest.raises(UnsupportedModelError, match="beam search|num_beams"):
        with torch.no_grad():
            model.generate(ids[:1], **{CACHE: cache}, max_new_tokens=4, num_beams=2,
                           pad_token_id=0)
    cache.release()
    # The model still runs with other caches after all of that.
    with torch.no_grad():
        model(ids, **{CACHE: DynamicCache(config=model.config)}, use_cache=True)


@pytest.mark.parametrize("dtype,tol", [("fp16", 0.05), ("bf16", 0.5)])
def test_half_precision_arena_reads_back_what_it_stored(server, monkeypatch, dtype, tol):
    """fp16 / bf16 sessions: the model attends to its K/V rounded as stored (new tokens too),
    read back from the arena bit for bit; logits stay close to the fp32 DynamicCache."""
    model = make_model()
    ids = prompts(1, 24)
    recorder = _Recorder()
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recorder)
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model, dtype), num_blocks=blocks_for(model, 64)) as s:
        cache = SidecarCache(s, model, policy="keydiff", budget=None)
        ref = DynamicCache(config=model.config)
        with torch.no_grad():
            a = model(ids, **{CACHE: cache}, use_cache=True).logits
            b = model(ids, **{CACHE: ref}, use_cache=True).logits
            assert float((a - b).abs().max()) <= tol
            for step in range(3):
                tok = a[:, -1:].argmax(-1)
                cache.sync()
                layout = s.get_layout(cache.sequence_ids[0])
                stored = [s.read_layer(layout, layer) for layer in range(3)]
                a = model(tok, **{CACHE: cache}, use_cache=True).logits
                for layer in range(3):
                    k = recorder.keys[layer][0]
                    n = stored[layer].k.shape[1]
                    want = torch.from_numpy(stored[layer].k.copy())
                    want = want.view(torch.bfloat16) if dtype == "bf16" else want
                    assert n == 24 + step and torch.equal(k[:, :n], want.float())
                    # The new token is read as it will be stored.
                    assert torch.equal(k[:, n:], k[:, n:].to(want.dtype).float())
                b = model(tok, **{CACHE: ref}, use_cache=True).logits
                assert float((a - b).abs().max()) <= tol
        cache.release()


def test_attention_functions_wrapped_by_another_library(session, monkeypatch):
    """kvpress wraps every registered attention function with one that passes dropout
    positionally; SidecarCache keeps working (same tokens as DynamicCache) under such a wrapper."""
    model = make_model()
    ids = prompts(2)
    ref = _generate(model, ids, DynamicCache(config=model.config))
    cache = SidecarCache(session, model, policy="snapkv", budget=1.0)  # registers its wrapper

    def positional(func):
        def wrapper(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
            return func(module, query, key, value, attention_mask, dropout, **kwargs)
        return wrapper

    for name, func in list(ALL_ATTENTION_FUNCTIONS._global_mapping.items()):
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, positional(func))
    out = _generate(model, ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    cache.release()


# -- long prompts: the queries of a policy that reads every one of them -----------------------------

LONG = 4096


def _kept_positions(session, cache):
    """Per row and layer, the sorted positions of kv head 0 (every head holds as many)."""
    out = []
    for seq in cache.sequence_ids:
        layout = session.get_layout(seq)
        out.append([sorted(list(e.positions[:e.count])) for e in
                    sorted(layout.layers, key=lambda e: e.layer)])
    return out


@pytest.mark.parametrize("name", ["h2o", "d2o"])
def test_long_prompt_queries_go_in_messages_under_the_limit(server, monkeypatch, name):
    """H2O and D2O read every prompt query; at a 4K prompt a batch's queries in one BatchCommit
    grow past any message limit (here lowered to one layer's worth, 1 MiB per row, so that a tiny
    model shows what SmolLM2 does at 2K: 70 MB against gRPC's 64 MiB). The cache then commits
    the K/V alone, sends the queries a layer at a time, and compresses from the accumulated
    state: every message stays under the limit, and the kept set, the counts and the decoded
    logits are those of the one-message path."""
    model = make_model(max_positions=LONG + 16)
    ids = prompts(2, LONG, seed=3)
    budget = LONG // 4
    with kvs.Client(server.address, timeout=120) as client, \
            client.attach(layout_for(model), num_blocks=2 * blocks_for(model, LONG + 16, 2)) as s:
        whole = SidecarCache(s, model, policy=name, budget=budget)
        whole.max_message_bytes = 1 << 30  # one BatchCommit (this tiny model's fits 64 MiB)
        split = SidecarCache(s, model, policy=name, budget=budget)
        split.max_message_bytes = 4 * LONG * 16 * 4  # Hq x T x D fp32: one layer of one row
        sizes = []
        original = s._call

        def recording(method, request):
            sizes.append(request.ByteSize())
            return original(method, request)

        logits = {}
        with torch.no_grad():
            for key, cache in (("whole", whole), ("split", split)):
                if key == "split":
                    monkeypatch.setattr(s, "_call", recording)
                out = model(ids, **{CACHE: cache}, use_cache=True).logits
                seq = [out]
                for _ in range(3):
                    seq.append(model(seq[-1][:, -1:].argmax(-1), **{CACHE: cache},
                                     use_cache=True).logits)
                logits[key] = seq
                monkeypatch.setattr(s, "_call", original)
        # The queries went in several messages, none over the limit (positions add a few KB).
        assert len(sizes) >= 2 * 3, sizes
        assert max(sizes) <= split.max_message_bytes + (64 << 10), max(sizes)
        # (D2O's allocator splits the budget across layers by their attention density.)
        assert split.counts == whole.counts
        if name == "h2o":
            assert split.counts == [[budget] * 3] * 2
        assert _kept_positions(s, split) == _kept_positions(s, whole)
        for a, b in zip(logits["split"], logits["whole"]):
            assert float((a - b).abs().max()) <= LOGIT_TOL
        whole.release()
        split.release()


@pytest.mark.parametrize("context", [2048, LONG])
def test_every_policy_serves_a_long_prompt(server, context):
    """Contexts of 2K and 4K under every policy SidecarCache drives, with messages held under a
    limit lowered to 1 MiB (the all-query policies then go a layer at a time): each row ends its
    prefill at the budget and keeps it while decoding."""
    model = make_model(max_positions=LONG + 16)
    ids = prompts(1, context, seed=4)
    budget = context // 4
    names = ["streaming_llm", "keydiff", "knorm", "h2o", "tova", "snapkv", "cake", "d2o",
             "caote"]
    with kvs.Client(server.address, timeout=120) as client, \
            client.attach(layout_for(model), num_blocks=blocks_for(model, context + 16, 1)) as s:
        for name in names:
            cache = SidecarCache(s, model, policy=name, budget=budget)
            cache.max_message_bytes = 1 << 20
            out = _generate(model, ids, cache, steps=3)
            assert out.sequences.shape == (1, context + 3), name
            if name not in ("cake", "d2o"):  # their allocators split the budget unevenly
                assert cache.counts == [[budget] * 3], (name, cache.counts)
            assert sum(cache.counts[0]) <= 3 * budget, (name, cache.counts)
            cache.release()


# -- the budget: what is kept, a fraction in (0, 1] or tokens per layer ----------------------------

@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.25, 1.5, 2.5, float("nan")])
def test_a_budget_that_keeps_nothing_or_more_than_all_is_refused(session, bad):
    """budget=2.5 once kept everything silently and budget=0 meant 'no budget': both are
    refused, naming kvpress's equivalent (compression_ratio = 1 - budget)."""
    model = make_model()
    with pytest.raises(ValueError, match="compression_ratio"):
        SidecarCache(session, model, policy="snapkv", budget=bad)


@pytest.mark.parametrize("bad", [True, "0.25", [16]])
def test_a_budget_of_another_type_is_refused(session, bad):
    with pytest.raises(TypeError, match="fraction kept"):
        SidecarCache(session, make_model(), policy="snapkv", budget=bad)


def test_a_token_budget_above_the_prompt_is_refused_at_the_prompt(session):
    model = make_model()
    cache = SidecarCache(session, model, policy="snapkv", budget=PROMPT + 1)
    with pytest.raises(ValueError, match=rf"more than the {PROMPT}-token prompt.*compression_ratio"):
        with torch.no_grad():
            model(prompts(1), **{CACHE: cache}, use_cache=True)
    assert cache.sequence_ids == []  # nothing was created
    cache.release()


@pytest.mark.parametrize("budget,kept", [(0.75, 30), (0.1, 4), (1.0, PROMPT), (None, PROMPT),
                                         (PROMPT, PROMPT), (1, 1)])
def test_the_budget_is_the_fraction_kept(session, budget, kept):
    """kvpress's compression_ratio=0.25 is budget=0.75: 75 % kept (ceil), not evicted."""
    model = make_model()
    cache = SidecarCache(session, model, policy="snapkv", budget=budget)
    with torch.no_grad():
        model(prompts(1), **{CACHE: cache}, use_cache=True)
    assert cache.counts == [[kept] * 3]
    cache.release()


def test_cache_and_past_key_values_name_the_same_cache(session):
    """transformers 5.24 renamed the argument `cache=`; 5.25 deprecates `past_key_values=` (6.0
    removes it). SidecarCache works under both names, with the same tokens."""
    model = make_model()
    ids = prompts(2)
    out = {}
    for name in ("cache", "past_key_values"):
        cache = SidecarCache(session, model, policy="snapkv", budget=0.5)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = model.generate(ids, attention_mask=torch.ones_like(ids), **{name: cache},
                                       max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                       pad_token_id=0)
        assert cache.get_seq_length() == PROMPT + 5, name  # the cache given was the one used
        cache.release()
        deprecated = [w for w in caught if "past_key_values" in str(w.message)]
        if name == "cache":
            assert not deprecated, [str(w.message) for w in deprecated]
    assert torch.equal(out["cache"], out["past_key_values"])
