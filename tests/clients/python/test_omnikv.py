"""OmniKV Select and retain_evicted through kvsidecar.Session against the real server: the
selection equals a numpy reference (max over query heads of the scaled logits, top k, ties to
the lower position), every staged row read in place is the row written for its position, and
GetRetained returns what a compression evicted, bit for bit."""

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout, random_kv

L, H, HQ, D = 4, 2, 4, 16


@pytest.mark.parametrize("offload", [False, True])
def test_select_stages_the_top_k_for_the_sparse_layers(client, offload):
    T, N, k = 40, 32, 6
    K = random_kv("fp32", (L, H, T, D), seed=7)
    V = random_kv("fp32", (L, H, T, D), seed=8)
    q = np.random.default_rng(9).standard_normal((1, HQ, 1, D), dtype=np.float32)
    scale = 1.0 / np.sqrt(D)
    with client.attach(layout("fp32", num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                              block_tokens=8), num_blocks=128) as session:
        # Filter layer 0, wait layer 1, sparse layers 2 and 3.
        policy = kvs.policy("omnikv", filter_layers=[0], selected_tokens=k, offload=offload)
        seq = session.create_sequence(policy, sequence_id="omni").sequence_id
        r = session.reserve(seq, T)
        for layer in range(L):
            r.write(layer, K[layer], V[layer])
        session.commit(r)

        response = session.select(seq, step_id=1, prompt_tokens=N,
                                  attention=kvs.attention(q, layers=[0], softmax_scale=scale))
        item = response.items[0]
        logits = np.einsum("hd,htd->ht", q[0, :, 0], np.repeat(K[0, :, :N], HQ // H, axis=0))
        scores = (logits * np.float32(scale)).max(axis=0)
        expected = sorted(np.argsort(-scores, kind="stable")[:k].tolist())
        assert list(item.filters[0].positions) == expected
        assert list(item.filters[0].sparse_layers) == [2, 3]
        assert item.budget_tokens == k and item.prompt_tokens == N
        assert (item.host_bytes > 0) == offload
        visible = expected + list(range(N, T))
        for staged in item.sparse_layers:
            got = session.read_layer(staged)
            assert got.count == len(visible)
            assert np.array_equal(got.k, K[staged.layer][:, visible])
            assert np.array_equal(got.v, V[staged.layer][:, visible])

        with pytest.raises(kvs.errors.InvalidArgument, match="not a filter layer"):
            session.select(seq, step_id=2, attention=kvs.attention(q, layers=[1]))
        with pytest.raises(kvs.errors.FailedPrecondition, match="never evicts"):
            session.compress(seq, budget_tokens=4)


def test_retained_tokens_come_back(client):
    T, budget = 24, 8
    K = random_kv("fp16", (2, 2, T, 16), seed=11)
    V = random_kv("fp16", (2, 2, T, 16), seed=12)
    with client.attach(layout("fp16"), num_blocks=32) as session:
        seq = session.create_sequence(kvs.policy("streaming_llm", n_sink=2), budget,
                                      retain_evicted=True).sequence_id
        r = session.reserve(seq, T)
        for layer in range(2):
            r.write(layer, K[layer], V[layer])
        session.commit(r, compress_if_over_budget=True)
        retained = session.get_retained(seq)
        assert len(retained.heads) == 2 * 2
        for head in retained.heads:
            positions = list(head.positions)
            assert positions == list(range(2, T - (budget - 2)))
            keys = np.frombuffer(head.keys, np.float16).reshape(len(positions), 16)
            values = np.frombuffer(head.values, np.float16).reshape(len(positions), 16)
            assert np.array_equal(keys, K[head.layer, head.head, positions])
            assert np.array_equal(values, V[head.layer, head.head, positions])
        with pytest.raises(kvs.errors.FailedPrecondition, match="retain_evicted"):
            session.get_retained(session.create_sequence().sequence_id)
