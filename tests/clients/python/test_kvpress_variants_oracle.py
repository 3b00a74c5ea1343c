"""kvpress's variants against kvpress's own presses on identical tensors (docs/policies/
kvpress_variants.md): the sidecar's H2O with normalize_by_queries keeps what ObservedAttentionPress
keeps, TOVA with all_heads + keep_last_token what TOVAPress keeps, SnapKV with kvpress's defaults
what SnapKVPress keeps, and the PyramidKV allocator with them PyramidKVPress's per-layer budgets
and sets. The attention both sides score is the same causal softmax of random logits (the worker's
own probabilities, attention_scores). Runs only where torch and kvpress are installed."""

import types

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout, random_kv

torch = pytest.importorskip(
    "torch", reason="torch is not installed in this venv: the kvpress variants oracle comparison "
                    "is skipped")
kvpress = pytest.importorskip(
    "kvpress",
    reason="kvpress is not installed in this venv: the oracle comparison of H2O/TOVA/SnapKV/"
           "PyramidKV's kvpress variants against kvpress's presses is skipped (pip install "
           "kvpress to run it)")

H, HQ, D = 2, 4, 16


def causal_probs(num_layers, t, seed):
    """[L][Hq][T][T] fp32: a causal softmax of random logits per (layer, query head)."""
    logits = np.random.default_rng(seed).standard_normal((num_layers, HQ, t, t)) * 2.0
    logits = np.where(np.tril(np.ones((t, t), dtype=bool)), logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    return (probs / probs.sum(axis=-1, keepdims=True)).astype(np.float32)


def fake_module(num_layers, layer):
    """What the presses read of an attention module: its config, layer index and head size."""
    config = types.SimpleNamespace(num_attention_heads=HQ, num_key_value_heads=H,
                                   num_hidden_layers=num_layers)
    return types.SimpleNamespace(config=config, layer_idx=layer, head_dim=D)


def compress_kept(client, policy, probs, rows, keep, num_layers, t):
    """Writes random K/V for `t` tokens, compresses to `keep` tokens per layer with the last `rows`
    query rows of `probs` as the attention; [layer][head] sorted kept positions."""
    K = random_kv("fp32", (num_layers, H, t, D), seed=21)
    V = random_kv("fp32", (num_layers, H, t, D), seed=22)
    scores = np.ascontiguousarray(probs[:, :, t - rows:, :])  # [L][Hq][rows][T]
    attention = kvs.common_pb2.AttentionInputs(num_queries=rows,
                                               attention_scores=scores.tobytes())
    with client.attach(layout("fp32", num_layers=num_layers, num_kv_heads=H, num_q_heads=HQ,
                              head_dim=D), num_blocks=256) as session:
        seq = session.create_sequence(policy).sequence_id
        r = session.reserve(seq, t)
        for layer in range(num_layers):
            r.write(layer, K[layer], V[layer])
        session.commit(r)
        response = session.compress(seq, budget_tokens=keep, attention=attention,
                                    return_positions=True)
        kept = []
        for layer in response.layers:
            got = np.asarray(layer.positions).reshape(H, layer.kept)
            kept.append([sorted(got[h].tolist()) for h in range(H)])
        return kept


def top_k(scores, keep):
    """kvpress's selection: the `keep` highest scores of each kv head, as sorted positions."""
    indices = scores.topk(keep, dim=-1).indices[0]
    return [sorted(indices[h].tolist()) for h in range(indices.shape[0])]


@pytest.mark.parametrize("compression_ratio", [0.25, 0.5, 0.75])
def test_h2o_normalized_keeps_what_observed_attention_keeps(client, admin, compression_ratio):
    L, T = 2, 64
    keep = T - int(T * compression_ratio)
    probs = causal_probs(L, T, seed=31)
    press = kvpress.ObservedAttentionPress(compression_ratio=compression_ratio)
    got = compress_kept(client, kvs.policy("h2o", normalize_by_queries=True), probs, T, keep,
                        L, T)
    keys = torch.zeros(1, H, T, D)
    for layer in range(L):
        scores = press.score(None, None, keys, keys, torch.from_numpy(probs[layer])[None], {})
        assert got[layer] == top_k(scores, keep), layer
    # The paper's plain sum keeps another set on the same tensors (the option changes something).
    plain = compress_kept(client, kvs.policy("h2o"), probs, T, keep, L, T)
    assert plain != got


@pytest.mark.parametrize("compression_ratio", [0.25, 0.5, 0.75])
def test_tova_all_heads_keep_last_keeps_what_tova_press_keeps(client, admin, compression_ratio):
    L, T = 2, 64
    keep = T - int(T * compression_ratio)
    probs = causal_probs(L, T, seed=41)
    press = kvpress.TOVAPress(compression_ratio=compression_ratio)
    got = compress_kept(client, kvs.policy("tova", all_heads=True, keep_last_token=True), probs,
                        1, keep, L, T)
    keys = torch.zeros(1, H, T, D)
    for layer in range(L):
        scores = press.score(None, None, keys, keys, torch.from_numpy(probs[layer])[None], {})
        want = top_k(scores, keep)
        assert got[layer] == want, layer
        assert all(T - 1 in head for head in want)


@pytest.mark.parametrize("compression_ratio", [0.5, 0.75])
def test_snapkv_kvpress_defaults_keep_what_snapkv_press_keeps(client, admin, compression_ratio):
    L, T = 2, 256
    keep = T - int(T * compression_ratio)
    probs = causal_probs(L, T, seed=51)
    press = kvpress.SnapKVPress(compression_ratio=compression_ratio)  # window 64, kernel 5
    spec = kvs.policy("snapkv", defaults=kvs.common_pb2.SnapKvParams.DEFAULTS_KVPRESS)
    got = compress_kept(client, spec, probs, press.window_size, keep, L, T)
    keys = torch.zeros(1, H, T, D)
    hidden = torch.zeros(1, T, 1)
    for layer in range(L):
        scores = press.score(fake_module(L, layer), hidden, keys, keys,
                             torch.from_numpy(probs[layer])[None], {})
        assert got[layer] == top_k(scores, keep), layer


@pytest.mark.parametrize("compression_ratio", [0.5, 0.75])
def test_pyramidkv_kvpress_defaults_match_pyramidkv_press(client, admin, compression_ratio):
    # 0.5: the pyramid with its top layer capped at T - window; 0.75: kvpress's uniform fallback
    # (budget / beta < window).
    L, T = 4, 256
    budget = int(T * (1 - compression_ratio))
    probs = causal_probs(L, T, seed=61)
    press = kvpress.PyramidKVPress(compression_ratio=compression_ratio)
    spec = kvs.policy("snapkv", defaults=kvs.common_pb2.SnapKvParams.DEFAULTS_KVPRESS,
                      allocator=kvs.common_pb2.LayerAllocator(
                          kind=kvs.common_pb2.LAYER_ALLOCATOR_PYRAMIDKV))
    got = compress_kept(client, spec, probs, press.window_size, budget, L, T)
    keys = torch.zeros(1, H, T, D)
    hidden = torch.zeros(1, T, 1)
    budgets = []
    for layer in range(L):
        module = fake_module(L, layer)
        n_kept = press.get_layer_budget(module, T)
        budgets.append(n_kept)
        scores = press.score(module, hidden, keys, keys, torch.from_numpy(probs[layer])[None], {})
        assert got[layer] == top_k(scores, n_kept), layer
    assert [len(layer[0]) for layer in got] == budgets
    if compression_ratio == 0.75:
        assert budgets == [budget] * L
    else:
        assert budgets[0] == T - press.window_size and budgets[0] > budgets[-1]

