"""OmniKV through kvsidecar.hf.SidecarCache on tiny random Llama and Gemma 3 models against a real
kvsidecar server on loopback: nothing is evicted (but what falls out of a Gemma sliding layer's
window), and at every decode step the filter layers' queries go to the sidecar's Select, whose
staged tokens are what the sparse layers attend to.

Selecting everything (selected_fraction 1.0): the same greedy tokens as DynamicCache and logits
within LOGIT_TOL. Selecting a quarter of the prompt: each filter layer's selection is the top k of
its own query against its prompt keys (a numpy reference over what the model computed), and each
sparse layer's attention reads exactly the keys and values the model computed for the selected
prompt positions, then every generated token — nothing else, with no mask; a sliding layer reads
its window, wherever it sits among the segment's layers."""

import numpy as np
import pytest
import torch
from transformers import (DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvsidecar as kvs
from kvsidecar.hf import (SidecarCache, UnsupportedModelError, blocks_for, layer_windows,
                          layout_for)
from test_hf_cache import (CACHE, LOGIT_TOL, PROMPT, SLIDING, _common, _generate, _left_padded,
                           make_model, prompts, session)  # noqa: F401 (the session fixture)

torch.set_num_threads(1)
# Six layers, filters 0 and 3 (one wait layer each): layers 2 and 5 are sparse.
FILTERS = [0, 3]
ROLES = ["filter", "wait", "sparse", "filter", "wait", "sparse"]
FEEDING = {2: 0, 5: 3}
# Gemma 3 with sliding layers 1, 2 and 4 and filter 0: layer 1 waits (windowed), layer 2 keeps its
# window between the wait layer and the sparse layer 3, layer 5 is sparse too.
GEMMA_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "full_attention"]
GEMMA_FILTERS = [0]
GEMMA_ROLES = ["filter", "windowed", "windowed", "sparse", "windowed", "sparse"]
GEMMA_FEEDING = {3: 0, 5: 0}


def _six_layer_llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(_common(), num_hidden_layers=6)))
    model.set_attn_implementation("sdpa")
    return model.eval()


def _six_layer_gemma():
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**dict(
        _common(head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING,
                layer_types=GEMMA_TYPES), num_hidden_layers=6)))
    model.set_attn_implementation("sdpa")
    return model.eval()


def _six_layers(family):
    """The model, its filter layers, each layer's role and each sparse layer's filter."""
    if family == "llama":
        return _six_layer_llama(), FILTERS, ROLES, FEEDING
    return _six_layer_gemma(), GEMMA_FILTERS, GEMMA_ROLES, GEMMA_FEEDING


class _Recorder:
    """Wraps the registered sdpa: records what each layer's attention reads (queries, K/V, the
    mask) at the last call."""

    def __init__(self):
        self.queries, self.keys, self.values, self.masks = {}, {}, {}, {}
        self.original = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]

    def __call__(self, module, query, key, value, mask, **kw):
        layer = module.layer_idx
        self.queries[layer] = query.detach().clone()
        self.keys[layer] = key.detach().clone()
        self.values[layer] = value.detach().clone()
        self.masks[layer] = None if mask is None else mask.detach().clone()
        return self.original(module, query, key, value, mask, **kw)


def _top_k_reference(query, keys, k, scale):
    """OmniKV's 'last' selector (omnikv.md §4.2): max over the query heads of the scaled logits
    against the prompt keys (GQA: each query head reads its kv head), top k with ties to the
    lower position, ascending."""
    groups = query.shape[0] // keys.shape[0]
    logits = np.einsum("hd,htd->ht", query, np.repeat(keys, groups, axis=0)) * np.float32(scale)
    scores = logits.max(axis=0)
    return sorted(np.argsort(-scores, kind="stable")[:k].tolist())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("offload", [False, True])
def test_selecting_everything_generates_what_dynamic_cache_does(server, offload, family):
    """Llama: layer 0 filters, layer 1 waits, layer 2 attends to the selection. Gemma 3: the
    sliding layers keep their window (were one staged as a sparse layer it would attend to the
    whole prompt, and the logits would not be DynamicCache's); layers 3 and 5 are sparse."""
    if family == "llama":
        model, filters, sparse = make_model("llama"), [0], [2]
    else:
        model, filters, sparse = _six_layer_gemma(), GEMMA_FILTERS, [3, 5]
    ids = prompts(2)
    ref = _generate(model, ids, DynamicCache(config=model.config))
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=3 * blocks_for(model, 64, 2)) as s:
        policy = kvs.policy("omnikv", filter_layers=filters, offload=offload)
        cache = SidecarCache(s, model, policy=policy, budget=1.0)
        out = _generate(model, ids, cache)
        assert torch.equal(out.sequences, ref.sequences)
        diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
        assert diff <= LOGIT_TOL, diff
        # The last step's Select: every prompt token, for the sparse layers.
        for item in cache.last_selection[filters[0]]:
            assert list(item.filters[0].positions) == list(range(PROMPT))
            assert list(item.filters[0].sparse_layers) == sparse
            assert [v.layer for v in item.sparse_layers] == sparse
            assert item.budget_tokens == PROMPT and item.prompt_tokens == PROMPT
            assert (item.host_bytes > 0) == offload
        # Nothing evicted but what left a window; offloaded, the sparse layers' prompt lives in
        # the host tier.
        seen = PROMPT + 11
        assert cache.get_seq_length() == seen
        windows = layer_windows(model)
        assert cache.counts == [[(11 if offload else seen) if layer in sparse
                                 else SLIDING - 1 if windows[layer] else seen
                                 for layer in range(len(windows))]] * 2
        cache.release()


def test_gemma3_sliding_filter_layer_is_refused_naming_it(server, admin):
    model = _six_layer_gemma()
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=blocks_for(model, 64, 2)) as s:
        cache = SidecarCache(s, model, policy=kvs.policy("omnikv", filter_layers=[0, 2]))
        with pytest.raises(kvs.errors.InvalidArgument,
                           match=r"filter_layers\[1\] = 2 is a sliding-window layer"):
            with torch.no_grad():
                model(prompts(1), **{CACHE: cache}, use_cache=True)
        assert cache.sequence_ids == [] and admin.get_stats().sequences == 0


def _same_columns(got, want):
    """Whether `got` [H][n][D] holds exactly the columns of `want` [H][n][D], in any order (a
    sliding layer's held slots are in compaction order, not position order)."""
    if got.shape != want.shape:
        return False
    unmatched = list(range(want.shape[1]))
    for j in range(got.shape[1]):
        hit = next((i for i in unmatched if torch.equal(got[:, j], want[:, i])), None)
        if hit is None:
            return False
        unmatched.remove(hit)
    return True


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("offload", [False, True])
def test_sparse_layers_attend_to_what_select_reported(server, monkeypatch, offload, family):
    model, filters, roles, feeding = _six_layers(family)
    ids = prompts(2)
    fraction, steps = 0.25, 5
    k = int(fraction * PROMPT)
    recorder = _Recorder()
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recorder)
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=3 * blocks_for(model, 64, 2)) as s:
        cache = SidecarCache(s, model, policy=kvs.policy("omnikv", filter_layers=filters,
                                                         offload=offload), budget=fraction)
        with torch.no_grad():
            logits = model(ids, **{CACHE: cache}, use_cache=True).logits
        # Every key and value each layer computed, by position: the prompt's from the prefill,
        # then each generated token's (the last column its layer's attention read).
        keys = [recorder.keys[layer] for layer in range(6)]
        values = [recorder.values[layer] for layer in range(6)]
        scale = model.model.layers[0].self_attn.scaling
        for step in range(steps):
            tok = logits[:, -1:].argmax(-1)
            with torch.no_grad():
                logits = model(tok, **{CACHE: cache}, use_cache=True).logits
            keys = [torch.cat([keys[l], recorder.keys[l][:, :, -1:]], 2) for l in range(6)]
            values = [torch.cat([values[l], recorder.values[l][:, :, -1:]], 2) for l in range(6)]
            seen = PROMPT + step + 1                     # the new token included
            generated = list(range(PROMPT, seen))
            for row in range(2):
                selected = {}
                for f in filters:
                    item = cache.last_selection[f][row]
                    assert item.budget_tokens == k and item.prompt_tokens == PROMPT
                    selected[f] = list(item.filters[0].positions)
                    assert list(item.filters[0].sparse_layers) == sorted(
                        layer for layer, fed in feeding.items() if fed == f)
                    expect = _top_k_reference(recorder.queries[f][row, :, 0].numpy(),
                                              keys[f][row, :, :PROMPT].numpy(), k, scale)
                    assert selected[f] == expect, (step, row, f)
                for layer, role in enumerate(roles):
                    visible = (selected[feeding[layer]] + generated if role == "sparse"
                               else list(range(seen - SLIDING, seen)) if role == "windowed"
                               else list(range(seen)))
                    got_k, got_v = recorder.keys[layer][row], recorder.values[layer][row]
                    want_k, want_v = keys[layer][row][:, visible], values[layer][row][:, visible]
                    assert got_k.shape[1] == len(visible), (step, row, layer)
                    if role == "windowed":
                        got, want = torch.cat([got_k, got_v], 2), torch.cat([want_k, want_v], 2)
                        assert _same_columns(got, want), (step, row, layer)
                    else:
                        assert torch.equal(got_k, want_k), (step, row, layer)
                        assert torch.equal(got_v, want_v), (step, row, layer)
                    mask = recorder.masks[layer]
                    assert mask is None or bool(mask[row].all()), (step, row, layer)
        if family == "llama":
            # The two filter layers chose differently somewhere: their segments read their own.
            assert any(cache.last_selection[0][row].filters[0].positions !=
                       cache.last_selection[3][row].filters[0].positions for row in range(2))
        seen = PROMPT + steps
        held = {"sparse": steps if offload else seen, "windowed": SLIDING - 1}
        assert cache.counts == [[held.get(role, seen) for role in roles]] * 2
        cache.release()


@pytest.mark.parametrize("selector", ["SELECTOR_LAST", "SELECTOR_UNIFORM"])
def test_left_padded_rows_generate_what_each_row_does_alone(session, selector):
    """Padding never reaches the sidecar: a padded row's Select chooses k of its real prompt
    tokens (the window selector starting from its real prompt queries), so with a fixed k each
    row generates what its prompt generates unpadded, alone."""
    model = make_model("llama")
    ids, mask = _left_padded()
    # A window of 20: the last row's 16 real prompt queries, not the padding's, start it.
    policy = kvs.policy("omnikv", filter_layers=[0], selected_tokens=8, window=20,
                        selector=kvs.common_pb2.OmniKvParams.Selector.Value(selector))
    cache = SidecarCache(session, model, policy=policy)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **{CACHE: cache}, max_new_tokens=8,
                             min_new_tokens=8, do_sample=False, pad_token_id=0)
    for row, item in enumerate(cache.last_selection[0]):
        positions = list(item.filters[0].positions)
        assert min(positions) >= 7 * row, row  # never a padding column
        if selector == "SELECTOR_LAST":
            assert len(positions) == 8
    cache.release()
    for row in range(3):
        solo = SidecarCache(session, model, policy=policy)
        one = _generate(model, ids[row:row + 1, 7 * row:], solo, steps=8)
        assert torch.equal(one.sequences[0, -8:], out[row, -8:]), row
        solo.release()


@pytest.mark.parametrize("window", [4, 16])
def test_window_selector_forces_the_prompt_queries_tokens_in(server, window):
    """The uniform selector keeps the last W filter queries: the prompt's last W - 1 (sent with
    their positions at the first Select; from both blocks of a chunked prefill when W is 16) and
    the decode ones. While prompt queries are in the window their tokens are always selected
    (omnikv.md §4.5), and the selection keeps k tokens: at both filter layers."""
    model = _six_layer_llama()
    ids = prompts(2)
    k = 20
    policy = kvs.policy("omnikv", filter_layers=FILTERS, selected_tokens=k, window=window,
                        selector=kvs.common_pb2.OmniKvParams.SELECTOR_UNIFORM)
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=3 * blocks_for(model, 64, 2)) as s:
        cache = SidecarCache(s, model, policy=policy)
        with torch.no_grad():
            model(ids[:, :30], **{CACHE: cache}, use_cache=True)
            logits = model(ids[:, 30:], **{CACHE: cache}, use_cache=True).logits
            for step in range(1, window + 2):
                logits = model(logits[:, -1:].argmax(-1), **{CACHE: cache},
                               use_cache=True).logits
                forced = max(0, window - step)  # prompt queries still in the window
                for f in FILTERS:
                    for item in cache.last_selection[f]:
                        positions = list(item.filters[0].positions)
                        assert len(positions) == k, (step, f)
                        assert set(range(PROMPT - forced, PROMPT)) <= set(positions), (step, f)
        cache.release()


def test_omnikv_refusals_are_named(session):
    model = make_model("llama")
    with pytest.raises(ValueError, match="selected_tokens"):
        SidecarCache(session, model, policy=kvs.policy("omnikv", filter_layers=[0],
                                                       selected_tokens=4), budget=0.5)
    # A block of several tokens after decoding began: the prompt (Select's candidates) is fixed.
    cache = SidecarCache(session, model, policy=kvs.policy("omnikv", filter_layers=[0]),
                         budget=0.5)
    ids = prompts(2, 16)
    with torch.no_grad():
        logits = model(ids, **{CACHE: cache}, use_cache=True).logits
        model(logits[:, -1:].argmax(-1), **{CACHE: cache}, use_cache=True)
        with pytest.raises(UnsupportedModelError, match="omnikv.*several tokens"):
            model(ids[:, :3], **{CACHE: cache}, use_cache=True)
    assert cache.counts == [[17, 17, 17]] * 2
    cache.release()
