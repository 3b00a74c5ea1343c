"""The data plane through kvsidecar.Client/Session against the real server: zero-copy writes and
in-place reads, inline append/export, compress, decode_step, score, batch calls, tiers."""

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout, random_kv

L, H, HQ, D, B = 2, 2, 4, 16, 16


def write_all(session, seq, K, V, positions=None):
    """Reserve + write every layer through the mapped arena + commit; K, V [L][H][T][D]."""
    r = session.reserve(seq, K.shape[2], positions=positions)
    for layer in range(K.shape[0]):
        r.write(layer, K[layer], V[layer])
    return r, session.commit(r)


def assert_kept_match(layer_kv, K, V):
    """Every kept (head, slot) holds bit for bit the K/V written at its original position."""
    for h in range(layer_kv.k.shape[0]):
        pos = layer_kv.positions[h]
        assert np.array_equal(layer_kv.k[h].view(np.uint8), K[h, pos].view(np.uint8))
        assert np.array_equal(layer_kv.v[h].view(np.uint8), V[h, pos].view(np.uint8))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_zero_copy_write_commit_compress_read_in_place(client, admin, dtype):
    T, budget = 100, 32
    K = random_kv(dtype, (L, H, T, D), seed=1)
    V = random_kv(dtype, (L, H, T, D), seed=2)
    with client.attach(layout(dtype), num_blocks=64) as session:
        seq = session.create_sequence(kvs.policy("keydiff"), budget).sequence_id
        r, commit = write_all(session, seq, K, V)
        assert list(commit.counts) == [T] * L
        assert r.positions.tolist() == list(range(T))

        before = session.get_layout(seq)
        for layer in range(L):
            got = session.read_layer(before, layer)
            assert got.k.dtype == session.arena.storage_dtype
            assert got.positions.tolist() == [list(range(T))] * H
            assert np.array_equal(got.k, K[layer]) and np.array_equal(got.v, V[layer])

        response = session.compress(seq, return_positions=True)
        assert [l.kept for l in response.layers] == [budget] * L
        assert [l.evicted for l in response.layers] == [T - budget] * L
        assert response.blocks_freed == L * (7 - 2)  # 100 tokens = 7 blocks -> 32 tokens = 2

        after = session.get_layout(seq)
        used_blocks = set()
        for layer in range(L):
            got = session.read_layer(after, layer)
            assert got.count == budget
            assert got.positions.tolist() == np.asarray(
                response.layers[layer].positions).reshape(H, budget).tolist()
            # KeyDiff keeps a real subset, not simply the first or last tokens.
            assert got.positions.min() >= 0 and got.positions.max() < T
            assert not np.array_equal(got.positions[0], np.arange(budget))
            assert_kept_match(got, K[layer], V[layer])
            # The block views are the same memory read_layer gathered from.
            views = session.layer_blocks(after, layer)
            assert [n for _, n in views] == [B, budget - B]
            assert np.array_equal(views[1][0][0, :, :budget - B], got.k[:, B:])
            used_blocks.update(after.layers[layer].block_table)
        assert len(used_blocks) == L * 2

        # Export (inline) agrees with the in-place read.
        exported = session.export(seq)
        for layer in range(L):
            ex, got = exported.layer(layer), session.read_layer(after, layer)
            assert np.array_equal(ex.k, got.k) and np.array_equal(ex.v, got.v)
            assert np.array_equal(ex.positions, got.positions)


def test_float_input_is_converted_to_the_session_dtype(client, admin):
    T = 20
    values = np.random.default_rng(3).standard_normal((H, T, D), dtype=np.float32)
    with client.attach(layout("bf16"), num_blocks=16) as session:
        seq = session.create_sequence().sequence_id
        r = session.reserve(seq, T, layers=[1])
        r.write(1, values, -values)
        with pytest.raises(kvs.errors.InvalidArgument, match="layer 0 is not part"):
            r.write(0, values, values)
        session.commit(r)
        lay = session.get_layout(seq)
        assert [e.count for e in lay.layers] == [0, T]
        got = session.read_layer(lay, 1)
        assert np.array_equal(got.k, kvs.float32_to_bf16(values))
        np.testing.assert_allclose(kvs.bf16_to_float32(got.v), -values, rtol=2 ** -8)


def test_layouts_asked_for_together_are_the_ones_asked_for_one_by_one(client, admin):
    with client.attach(layout("fp16"), num_blocks=16) as session:
        seqs = [session.create_sequence().sequence_id for _ in range(3)]
        for i, seq in enumerate(seqs):
            r = session.reserve(seq, 5 + i)
            session.commit(r)
        futures = [session.get_layout_future(seq) for seq in seqs]
        for seq, future in zip(seqs, futures):
            assert future.result() == session.get_layout(seq)
        assert [e.count for e in futures[2].result().layers] == [7, 7]
        missing = session.get_layout_future("no-such-sequence")
        with pytest.raises(kvs.errors.NotFound, match="no-such-sequence"):
            missing.result()


def test_reservation_views_are_the_arena(client, admin):
    T = 40  # first slot 0: views split at the block boundaries 16 and 32
    with client.attach(layout("fp32"), num_blocks=16) as session:
        seq = session.create_sequence().sequence_id
        r = session.reserve(seq, T)
        for layer in range(L):
            parts = r.views(layer)
            assert [(first, k.shape[1]) for first, k, _ in parts] == [(0, 16), (16, 16), (32, 8)]
            for first, k, v in parts:
                n = k.shape[1]
                k[...] = np.arange(first, first + n, dtype=np.float32)[None, :, None] + layer
                v[...] = -k
        session.commit(r)
        for layer in range(L):
            got = session.read_layer(session.get_layout(seq), layer)
            assert np.array_equal(got.k[:, :, 0], np.tile(np.arange(T) + layer, (H, 1)))
            assert np.array_equal(got.v, -got.k)


def test_inline_append_export_round_trip(client, admin):
    T1, T2 = 37, 5
    first = random_kv("fp16", (L, 2, H, T1, D), seed=4)
    second = random_kv("fp16", (1, 2, H, T2, D), seed=5)
    with client.attach(layout("fp16"), num_blocks=32) as session:
        seq = session.create_sequence(sequence_id="inline").sequence_id
        assert seq == "inline"
        response = session.append(seq, first, chunk_bytes=1000)  # many data messages
        assert response.bytes_received == first.nbytes
        assert list(response.items[0].counts) == [T1, T1]
        # Only layer 1, at explicit positions with a gap.
        positions = list(range(100, 100 + T2))
        session.append(seq, second, layers=[1], positions=positions)
        exported = session.export(seq, chunk_bytes=64 << 10)
        assert [e.count for e in exported.header.layers] == [T1, T1 + T2]
        l0, l1 = exported.layer(0), exported.layer(1)
        assert np.array_equal(l0.k, first[0, 0]) and np.array_equal(l0.v, first[0, 1])
        assert np.array_equal(l1.k, np.concatenate([first[1, 0], second[0, 0]], axis=1))
        assert np.array_equal(l1.v, np.concatenate([first[1, 1], second[0, 1]], axis=1))
        assert l1.positions[0].tolist() == list(range(T1)) + positions
        # The in-place read sees the same bytes.
        inplace = session.read_layer(session.get_layout(seq), 1)
        assert np.array_equal(inplace.k, l1.k) and np.array_equal(inplace.positions, l1.positions)
        only1 = session.export(seq, layers=[1])
        assert [e.layer for e in only1.header.layers] == [1]


def test_decode_step_keeps_the_budget(client, admin):
    T, budget, steps = 40, 24, 3
    prompt = random_kv("fp32", (L, 2, H, T, D), seed=6)
    rng = np.random.default_rng(7)
    with client.attach(layout("fp32"), num_blocks=64) as session:
        a = session.create_sequence(kvs.policy("tova"), budget).sequence_id
        b = session.create_sequence(kvs.policy("streaming_llm", n_sink=4), budget).sequence_id
        for seq in (a, b):
            session.append(seq, prompt)
            session.compress(seq, attention=kvs.attention(
                rng.standard_normal((L, HQ, 1, D), dtype=np.float32), query_positions=[T - 1]))
        for step in range(steps):
            pos = T + step
            query = kvs.attention(rng.standard_normal((L, HQ, 1, D), dtype=np.float32),
                                  query_positions=[pos])
            r = session.reserve(b, 1)
            token = rng.standard_normal((L, 2, H, 1, D), dtype=np.float32)
            for layer in range(L):
                r.write(layer, token[layer, 0], token[layer, 1])
            response = session.decode_step([
                kvs.DecodeItem(a, attention=query, inline_kv=token),
                kvs.DecodeItem(b, attention=query, reservation=r),
            ])
            assert len(response.items) == 2
            item_a, item_b = response.items
            assert list(item_a.counts) == [budget] * L and list(item_b.counts) == [budget] * L
            assert item_a.position == pos and item_b.position == -1
            assert len(item_a.evicted_positions) == L * H
            # TOVA may evict any token, the new one included; exactly one per (layer, head).
            assert all(0 <= p <= pos for p in item_a.evicted_positions)
        # StreamingLLM: the 4 sinks and the most recent tokens, and the new token is held.
        lay = session.get_layout(b)
        kept = sorted(lay.layers[0].positions[:budget])
        last = T + steps
        assert kept == [0, 1, 2, 3] + list(range(last - (budget - 4), last))
        got = session.read_layer(lay, 1)
        slot = got.positions[0].tolist().index(last - 1)
        assert np.array_equal(got.k[:, slot], token[1, 0, :, 0])


def test_score_is_a_dry_run(client, admin):
    T, budget = 50, 20
    with client.attach(layout("fp16"), num_blocks=32) as session:
        seq = session.create_sequence("keydiff", budget).sequence_id
        session.append(seq, random_kv("fp16", (L, 2, H, T, D), seed=8))
        before = session.get_layout(seq)
        scores = session.score(seq, layers=[1])
        assert [s.layer for s in scores.layers] == [1]
        s = scores.layers[0]
        assert s.kept == budget
        assert len(s.scores) == H * T and len(s.positions) == H * T
        kept = np.asarray(s.kept_slots).reshape(H, budget)
        assert (np.diff(kept, axis=1) > 0).all()
        assert session.get_layout(seq) == before  # nothing changed
        # Compress keeps what Score said it would.
        session.compress(seq)
        after = session.read_layer(session.get_layout(seq), 1)
        for h in range(H):
            assert sorted(after.positions[h]) == sorted(
                np.asarray(s.positions).reshape(H, T)[h, kept[h]])
        smaller = session.score(seq, budget_tokens=8, policy="streaming_llm")
        assert all(l.kept == 8 for l in smaller.layers)


def test_batch_reserve_commit_compress(client, admin):
    T, budget = 30, 10
    with client.attach(layout("fp16"), num_blocks=64) as session:
        seqs = [session.create_sequence("streaming_llm", budget).sequence_id for _ in range(3)]
        data = [random_kv("fp16", (L, 2, H, T, D), seed=10 + i) for i in range(3)]
        reservations = session.batch_reserve(
            [(seqs[0], T), kvs.ReserveItem(seqs[1], T), kvs.ReserveItem(seqs[2], T)])
        assert [r.sequence_id for r in reservations] == seqs
        assert len({r.id for r in reservations}) == 3
        for r, kv in zip(reservations, data):
            for layer in range(L):
                r.write(layer, kv[layer, 0], kv[layer, 1])
        committed = session.batch_commit(reservations)
        assert [list(c.counts) for c in committed.responses] == [[T, T]] * 3
        compressed = session.batch_compress(
            [seqs[0], {"sequence_id": seqs[1], "budget_tokens": 5},
             kvs.sidecar_pb2.CompressRequest(sequence_id=seqs[2])])
        assert [[l.kept for l in r.layers] for r in compressed.responses] == \
            [[budget] * L, [5] * L, [budget] * L]
        for seq, kv in zip(seqs, data):
            lay = session.get_layout(seq)
            for layer in range(L):
                assert_kept_match(session.read_layer(lay, layer), kv[layer, 0], kv[layer, 1])

        # All or nothing: a bad item fails the batch with its index, nothing is reserved.
        with pytest.raises(kvs.errors.KvsError, match=r"requests\[1\]") as error:
            session.batch_reserve([(seqs[0], 2), ("no-such-sequence", 2)])
        assert error.value.code in (kvs.errors.NotFound.code, kvs.errors.InvalidArgument.code)
        r = session.reserve(seqs[0], 2)  # would be FAILED_PRECONDITION if item 0 were reserved
        session.cancel_reservation(r)
        session.release_sequence(seqs[0])
        assert admin.get_stats().sequences == 2


def test_spill_restore_and_select(client, admin):
    """Spill/Restore: data comes back bit for bit into a new block table (or, in a build without
    tiers, a clean UNIMPLEMENTED). Select on a sequence that is not omnikv: FAILED_PRECONDITION
    (test_omnikv.py covers Select itself)."""
    T = 20
    kv = random_kv("fp16", (L, 2, H, T, D), seed=20)
    with client.attach(layout("fp16"), num_blocks=32) as session:
        seq = session.create_sequence().sequence_id
        session.append(seq, kv)
        try:
            spilled = session.spill(seq, kvs.Tier.TIER_HOST)
        except kvs.errors.Unimplemented as error:
            assert "Spill" in error.message
        else:
            assert spilled.tier == kvs.Tier.TIER_HOST and spilled.bytes > 0
            assert admin.get_stats().arena_bytes_used == 0  # its blocks were freed
            restored = session.restore(seq)
            assert restored.tier == kvs.Tier.TIER_HOST  # where it came from
            lay = session.get_layout(seq)
            assert lay.tier == kvs.Tier.TIER_ARENA
            for layer in range(L):
                got = session.read_layer(lay, layer)
                assert np.array_equal(got.k, kv[layer, 0]) and np.array_equal(got.v, kv[layer, 1])
            assert session.restore(seq).tier == kvs.Tier.TIER_ARENA  # not spilled: OK
            with pytest.raises(kvs.errors.NotFound):
                session.spill("missing", kvs.Tier.TIER_HOST)
        exported = session.export(seq)
        assert np.array_equal(exported.layer(0).k, kv[0, 0])
        with pytest.raises(kvs.errors.FailedPrecondition, match="needs a sequence created with"):
            session.select(seq, step_id=1, attention=kvs.attention(
                np.zeros((1, HQ, 1, D), np.float32), layers=[0]))


def test_commit_with_attention_compresses_an_attention_policy(client, admin):
    T, budget = 48, 16
    K = random_kv("fp32", (L, H, T, D), seed=30)
    V = random_kv("fp32", (L, H, T, D), seed=31)
    rng = np.random.default_rng(32)
    with client.attach(layout("fp32"), num_blocks=64) as session:
        seq = session.create_sequence(kvs.policy("snapkv", window=4, kernel_size=3),
                                      budget).sequence_id
        r = session.reserve(seq, T)
        for layer in range(L):
            r.write(layer, K[layer], V[layer])
        window = kvs.attention(rng.standard_normal((L, HQ, 4, D), dtype=np.float32),
                               query_positions=list(range(T - 4, T)))
        committed = session.commit(r, compress_if_over_budget=True, attention=window)
        assert list(committed.counts) == [budget] * L and committed.evicted == T - budget
        lay = session.get_layout(seq)
        for layer in range(L):
            got = session.read_layer(lay, layer)
            # SnapKV always keeps its observation window.
            for h in range(H):
                assert set(range(T - 4, T)) <= set(got.positions[h].tolist())
            assert_kept_match(got, K[layer], V[layer])


def test_batch_append_several_sequences_in_one_stream(client, admin):
    with client.attach(layout("bf16"), num_blocks=32) as session:
        a = session.create_sequence().sequence_id
        b = session.create_sequence().sequence_id
        ka = random_kv("bf16", (L, 2, H, 7, D), seed=40)
        kb = random_kv("bf16", (L, 2, H, 19, D), seed=41)
        response = session.batch_append([kvs.AppendSegment(a, ka), kvs.AppendSegment(b, kb)],
                                        chunk_bytes=4096)
        assert [(i.sequence_id, list(i.counts)) for i in response.items] == \
            [(a, [7, 7]), (b, [19, 19])]
        assert response.bytes_received == ka.nbytes + kb.nbytes
        assert np.array_equal(session.export(b).layer(1).v, kb[1, 1])
        # A bad second segment: the first stays committed, the error names the problem.
        with pytest.raises(kvs.errors.NotFound):
            session.batch_append([kvs.AppendSegment(a, ka), kvs.AppendSegment("missing", kb)])
        assert [e.count for e in session.get_layout(a).layers] == [14, 14]


def test_prefix_key_and_publish_create_from_prefix(client):
    """prefix_key is a stable sha256 that changes with every input; a published prefix starts a
    sequence in another session bit for bit; a query-aware policy needs a query window."""
    lay = layout("fp16")
    tokens = list(range(100, 180))
    key = kvs.prefix_key(tokens, lay, "keydiff", 32)
    assert len(key) == 64 and key == kvs.prefix_key(np.array(tokens), lay, "keydiff", 32)
    others = {kvs.prefix_key(tokens[:-1], lay, "keydiff", 32),
              kvs.prefix_key(tokens, layout("bf16"), "keydiff", 32),
              kvs.prefix_key(tokens, lay, "streaming_llm", 32),
              kvs.prefix_key(tokens, lay, "keydiff", 33),
              kvs.prefix_key(tokens, lay, "keydiff", 32, query_window=8)}
    assert key not in others and len(others) == 5

    T = len(tokens)
    kv = random_kv("fp16", (L, 2, H, T, D), seed=30)
    with client.attach(lay, tenant="py-prefix", num_blocks=64) as a, \
            client.attach(lay, tenant="py-prefix", num_blocks=64) as b:
        seq = a.create_sequence("keydiff", 32).sequence_id
        a.append(seq, kv, compress_if_over_budget=True)
        try:
            published = a.publish(seq, key)
        except kvs.errors.Unimplemented:
            return  # a build without tiers
        assert published.tier == kvs.Tier.TIER_DISK and published.bytes > 0
        new = b.create_sequence(from_prefix=key).sequence_id
        for layer in range(L):
            want = a.read_layer(a.get_layout(seq), layer)
            got = b.read_layer(b.get_layout(new), layer)
            assert np.array_equal(got.positions, want.positions)
            assert np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v)

        snap = a.create_sequence("snapkv", 32).sequence_id
        a.append(snap, kv)
        with pytest.raises(kvs.errors.FailedPrecondition, match="query_window"):
            a.publish(snap, kvs.prefix_key(tokens, lay, "snapkv", 32))
        a.publish(snap, kvs.prefix_key(tokens, lay, "snapkv", 32, query_window=16),
                  query_window=16)
        b.unpublish(key)
        with pytest.raises(kvs.errors.NotFound):
            b.create_sequence(from_prefix=key)


# kvpress's variants (docs/policies/kvpress_variants.md) go through the same helper.
def test_policy_helper_accepts_the_variants():
    assert kvs.policy("h2o", normalize_by_queries=True).h2o.normalize_by_queries
    spec = kvs.policy("tova", all_heads=True, keep_last_token=True)
    assert spec.tova.all_heads and spec.tova.keep_last_token
    spec = kvs.policy("snapkv", defaults=kvs.common_pb2.SnapKvParams.DEFAULTS_KVPRESS)
    assert spec.snapkv.defaults == kvs.common_pb2.SnapKvParams.DEFAULTS_KVPRESS
