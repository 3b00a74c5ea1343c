"""Queries in the query staging area, from Python: a worker writes a step's fp32 queries into
``session.arena.staging`` and names their byte offset (``kvs.staged_attention``); the decode steps
are those the same queries inline give, and the requests carry no query bytes."""

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout, random_kv


def _run(session, seq, queries_of, staged):
    lay = session.layout
    evicted = []
    for step in range(6):
        kv = random_kv("fp16", (lay.num_layers, 2, lay.num_kv_heads, 1, lay.head_dim), seed=step)
        q = queries_of(step)
        if staged:
            session.arena.staging[:q.size] = q.reshape(-1)
            att = kvs.staged_attention(0, 1, head_dim=lay.head_dim)
        else:
            att = kvs.attention(q)
        item = kvs.DecodeItem(seq, attention=att, inline_kv=kv)
        response = session.decode_step([item])
        evicted.append(list(response.items[0].evicted_positions))
    return evicted, session.export(seq)


def test_decode_steps_on_staged_queries_equal_the_inline_ones(client):
    lay = layout(num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=16, block_tokens=4)
    rng = np.random.default_rng(7)
    queries = [rng.standard_normal((2, 4, 1, 16), dtype=np.float32) for _ in range(6)]
    prompt = random_kv("fp16", (2, 2, 2, 10, 16), seed=99)
    results = []
    for staged in (False, True):
        with client.attach(lay, num_blocks=64, staging_bytes=4096 if staged else 0) as session:
            if staged:
                assert session.arena.staging.size == 1024
            seq = session.create_sequence("h2o", 8).sequence_id
            session.append(seq, prompt)
            results.append(_run(session, seq, lambda step: queries[step], staged))
    (inline_evicted, inline_export), (staged_evicted, staged_export) = results
    assert staged_evicted == inline_evicted
    assert staged_export.header.SerializeToString() == inline_export.header.SerializeToString()
    assert staged_export.payload == inline_export.payload


def test_staged_queries_outside_the_area_are_refused(client):
    lay = layout(num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=16, block_tokens=4)
    with client.attach(lay, num_blocks=64, staging_bytes=256) as session:
        seq = session.create_sequence("h2o", 8).sequence_id
        session.append(seq, random_kv("fp16", (2, 2, 2, 10, 16)))
        kv = random_kv("fp16", (2, 2, 2, 1, 16))
        # 2 layers x 4 heads x 16 dims x 4 bytes = 512 bytes: more than the area holds.
        with pytest.raises(kvs.errors.InvalidArgument, match="attention.staging_offset"):
            session.decode_step([kvs.DecodeItem(
                seq, attention=kvs.staged_attention(0, 1, head_dim=16), inline_kv=kv)])
