"""KNorm against kvpress's own KnormPress on identical tensors: the positions the sidecar keeps for
each (layer, kv head) are the top-k of kvpress's scores. Runs only where torch and kvpress are
installed in the test venv."""

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout, random_kv

torch = pytest.importorskip(
    "torch", reason="torch is not installed in this venv: the KNorm oracle comparison is skipped")
kvpress = pytest.importorskip(
    "kvpress",
    reason="kvpress is not installed in this venv: the KNorm oracle comparison against kvpress's "
           "KnormPress is skipped (bench/quality/install_kvpress.sh VENV_PYTHON installs it)")

L, H, D, T = 2, 2, 16, 64


@pytest.mark.parametrize("compression_ratio", [0.25, 0.5, 0.75])
def test_knorm_keeps_what_kvpress_keeps(client, admin, compression_ratio):
    K = random_kv("fp32", (L, H, T, D), seed=11)
    V = random_kv("fp32", (L, H, T, D), seed=12)
    keep = T - int(T * compression_ratio)  # kvpress's ScorerPress: n_kept = n * (1 - ratio)
    press = kvpress.KnormPress(compression_ratio=compression_ratio)
    with client.attach(layout("fp32", num_layers=L, num_kv_heads=H, num_q_heads=H, head_dim=D),
                       num_blocks=64) as session:
        seq = session.create_sequence(kvs.policy("knorm")).sequence_id
        r = session.reserve(seq, T)
        for layer in range(L):
            r.write(layer, K[layer], V[layer])
        session.commit(r)
        response = session.compress(seq, budget_tokens=keep, return_positions=True)
        for layer in range(L):
            got = np.asarray(response.layers[layer].positions).reshape(H, keep)
            keys = torch.from_numpy(K[layer]).unsqueeze(0)  # [1, H, T, D]
            values = torch.from_numpy(V[layer]).unsqueeze(0)
            scores = press.score(None, None, keys, values, None, {})
            want = scores.topk(keep, dim=-1).indices[0].numpy()
            for h in range(H):
                assert sorted(got[h].tolist()) == sorted(want[h].tolist()), (layer, h)
