"""Per-layer sliding windows (CreateSequenceRequest.layer_windows) against the real server: a
sliding layer holds exactly its last W tokens under every policy, after a prefill commit, after
each decode step and after Compress; Score and GetLayout report the same; the budget is split
over the global layers alone, so they keep what the policy keeps on a sequence made of them
alone; windows survive Spill/Restore. Bad windows are refused naming the field, creating nothing."""

import numpy as np
import pytest

import kvsidecar as kvs
from kvsidecar.client import common_pb2
from kvs_py_util import layout, random_kv

L, H, HQ, D = 4, 2, 4, 16
W = 5
WINDOWS = [0, W, 0, 0]
GLOBAL = [0, 2, 3]
PROMPT = 96
BUDGET = 48
PYRAMIDKV = kvs.policy("snapkv", allocator=common_pb2.LayerAllocator(
    kind=common_pb2.LAYER_ALLOCATOR_PYRAMIDKV, pyramid_beta=20))
# Every policy that evicts (omnikv never does), with the queries the hf cache sends it; the
# layer allocators (PyramidKV, CAKE, D2O) split the budget across layers.
POLICIES = {"streaming_llm": 0, "keydiff": 0, "tova": 1, "snapkv": 32, "pyramidkv": 32,
            "cake": 32, "h2o": PROMPT, "d2o": PROMPT, "caote": PROMPT}


def _held(session, seq, layer):
    """Sorted positions per kv head of `layer` (every head of a window holds the same)."""
    entry = session.get_layout(seq, layers=[layer]).layers[0]
    pos = np.asarray(entry.positions).reshape(H, -1)
    return [sorted(p) for p in pos.tolist()], entry


def _queries(rng, w, first):
    """Queries for every layer of the windowed sequence, and the same for the global layers."""
    q = rng.standard_normal((L, HQ, w, D), dtype=np.float32)
    positions = list(range(first, first + w))
    return (kvs.attention(q, query_positions=positions),
            kvs.attention(q[GLOBAL], query_positions=positions))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_sliding_layer_keeps_exactly_its_last_w_tokens_under_every_policy(client, admin,
                                                                            name):
    """The same inputs go to a sequence with windows and, for its global layers, to a sequence
    of those layers alone: the sliding layer keeps its window, the global layers keep what the
    policy keeps when the budget is theirs alone (a layer allocator does not hand them the
    sliding layer's share)."""
    rng = np.random.default_rng(7)
    spec = PYRAMIDKV if name == "pyramidkv" else name
    with client.attach(layout("fp32", num_layers=L), num_blocks=256) as s, \
            client.attach(layout("fp32", num_layers=len(GLOBAL)), num_blocks=256) as g:
        seq = s.create_sequence(policy=spec, budget=BUDGET, layer_windows=WINDOWS).sequence_id
        ref = g.create_sequence(policy=spec, budget=BUDGET).sequence_id
        w = POLICIES[name]
        attn, attn_g = _queries(rng, w, PROMPT - w) if w else (None, None)
        for session, target, layers, a in ((s, seq, range(L), attn), (g, ref, GLOBAL, attn_g)):
            res = session.reserve(target, PROMPT)
            for i, layer in enumerate(layers):
                session.write_reserved(res, i, random_kv("fp32", (H, PROMPT, D), seed=layer),
                                       random_kv("fp32", (H, PROMPT, D), seed=10 + layer))
            session.commit(res, compress_if_over_budget=True, attention=a)

        def check(last):
            held, entry = _held(s, seq, 1)
            assert held == [list(range(last + 1 - W, last + 1))] * H
            assert entry.count == W and entry.window == W
            for i, layer in enumerate(GLOBAL):
                got, other = _held(s, seq, layer)
                assert other.window == 0 and other.count < PROMPT
                assert got == _held(g, ref, i)[0], layer

        check(PROMPT - 1)
        # The dry run picks the same window, whatever the policy would score.
        score = s.score(seq, budget_tokens=3, attention=attn if name != "tova" else
                        _queries(rng, 1, PROMPT - 1)[0], layers=[1]).layers[0]
        pos = np.asarray(score.positions).reshape(H, -1)
        kept = np.asarray(score.kept_slots).reshape(H, -1)
        assert [sorted(pos[h][kept[h]].tolist()) for h in range(H)] == \
            [list(range(PROMPT - W, PROMPT))] * H
        # Decode steps: the window slides by one token each step.
        for step in range(4):
            position = PROMPT + step
            kv = random_kv("fp32", (L, 2, H, 1, D), seed=100 + step)
            q, q_g = _queries(rng, 1, position) if w else (None, None)
            out = s.decode_step([kvs.DecodeItem(seq, attention=q, inline_kv=kv)]).items[0]
            g.decode_step([kvs.DecodeItem(ref, attention=q_g, inline_kv=kv[GLOBAL])])
            assert out.position == position and out.counts[1] == W
            check(position)
        # Compress to a smaller budget: the global layers shrink, the window does not.
        s.compress(seq, budget_tokens=4, attention=_queries(rng, 1, PROMPT + 3)[0] if w else None)
        counts = [e.count for e in s.get_layout(seq).layers]
        assert counts[1] == W and all(counts[l] < PROMPT for l in GLOBAL)
        s.release_sequence(seq)
        g.release_sequence(ref)


def test_a_window_applies_without_a_budget(client, admin):
    with client.attach(layout("fp32", num_layers=L), num_blocks=64) as s:
        seq = s.create_sequence(policy="snapkv", layer_windows=WINDOWS).sequence_id
        kv = random_kv("fp32", (L, 2, H, PROMPT, D))
        s.append(seq, kv)
        assert [e.count for e in s.get_layout(seq).layers] == [PROMPT, W, PROMPT, PROMPT]
        held, _ = _held(s, seq, 1)
        assert held == [list(range(PROMPT - W, PROMPT))] * H
        # The kept rows are the newest tokens' own K/V.
        got = s.read_layer(s.get_layout(seq), 1)
        order = np.argsort(got.positions[0])
        assert np.array_equal(got.k[:, order], kv[1, 0][:, PROMPT - W:])
        s.release_sequence(seq)


def test_windows_survive_spill_and_restore(client, admin):
    """A restored sequence keeps its windows: the next tokens still slide the window."""
    with client.attach(layout("fp32", num_layers=L), num_blocks=64) as s:
        seq = s.create_sequence(policy="h2o", layer_windows=WINDOWS).sequence_id
        s.append(seq, random_kv("fp32", (L, 2, H, PROMPT, D)))
        assert s.spill(seq, kvs.Tier.TIER_HOST).tier == kvs.Tier.TIER_HOST
        s.restore(seq)
        assert [e.window for e in s.get_layout(seq).layers] == WINDOWS
        s.append(seq, random_kv("fp32", (L, 2, H, 3, D), seed=3))
        assert [e.count for e in s.get_layout(seq).layers] == \
            [PROMPT + 3, W, PROMPT + 3, PROMPT + 3]
        held, _ = _held(s, seq, 1)
        assert held == [list(range(PROMPT + 3 - W, PROMPT + 3))] * H
        s.release_sequence(seq)


def test_bad_windows_are_refused_naming_the_field(client, admin):
    with client.attach(layout("fp32", num_layers=L), num_blocks=64) as s:
        with pytest.raises(kvs.errors.InvalidArgument, match="layer_windows has 2 entries"):
            s.create_sequence(policy="h2o", layer_windows=[4, 0])
        with pytest.raises(kvs.errors.InvalidArgument, match=r"layer_windows\[1\]"):
            s.create_sequence(policy="h2o", layer_windows=[0, -3, 0, 0])
        # OmniKV serves windows (a windowed layer stays dense), but never on a filter layer.
        with pytest.raises(kvs.errors.InvalidArgument,
                           match=r"filter_layers\[0\] = 1 is a sliding-window layer"):
            s.create_sequence(policy=kvs.policy("omnikv", filter_layers=[1]),
                              layer_windows=WINDOWS)
        # Nothing was created by the refused calls.
        assert admin.list_sessions().sessions[0].sequences == 0
