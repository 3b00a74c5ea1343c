"""Session lifecycle against the real server: attach/detach, Watch, heartbeats, reclaim."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout, wait_for


def session_ids(admin):
    return {s.session_id for s in admin.list_sessions().sessions}


def test_attach_context_manager_detaches_and_unmaps(client, admin, server):
    with client.attach(layout(), num_blocks=64, worker_name="ctx") as session:
        assert session.backend == "cpu"
        assert session.layout.block_tokens == 16
        assert session.watching(timeout=10), "the Watch stream was never bound"
        assert session.session_id in session_ids(admin)
        info = next(s for s in admin.list_sessions().sessions if s.session_id == session.session_id)
        assert info.worker_name == "ctx" and info.num_blocks == 64
        # The arena is an anonymous memfd handed to this process alone: no file for anyone else.
        assert session.attach_response.arena.kind == kvs.common_pb2.ArenaHandle.KIND_MEMFD
        assert session.arena.path == ""
        assert os.listdir(server.shm_dir) == []
        seq = session.create_sequence("streaming_llm", 8).sequence_id
        session.append(seq, np.ones((2, 2, 2, 5, 16), np.float32))
    assert session.detached
    assert session.session_id not in session_ids(admin)
    assert os.listdir(server.shm_dir) == []
    stats = admin.get_stats()
    assert stats.sessions == 0 and stats.sequences == 0 and stats.arena_bytes_used == 0
    with pytest.raises(kvs.errors.InvalidArgument):
        session.arena  # unmapped
    with pytest.raises(kvs.errors.FailedPrecondition):
        session.detach()
    with pytest.raises(kvs.errors.NotFound):
        session.create_sequence()


def test_detach_reports_what_it_released(client, admin):
    session = client.attach(layout(), num_blocks=64)
    for _ in range(3):
        seq = session.create_sequence(budget=16).sequence_id
        r = session.reserve(seq, 20)
        session.commit(r)
    response = session.detach()
    assert response.sequences_released == 3
    assert response.blocks_released == 3 * 2 * 2  # 20 tokens = 2 blocks, in each of 2 layers


def test_heartbeat_keeps_a_short_lease_alive(client, admin):
    with client.attach(layout(), num_blocks=16, lease_ms=1500, watch=False) as session:
        before = session.heartbeat().lease_expires_unix_ms
        time.sleep(5.0)  # > 3 leases: only the heartbeat thread (every 0.5 s) keeps it alive
        assert session.session_id in session_ids(admin)
        assert session.health is None
        assert session.heartbeat().lease_expires_unix_ms > before


def test_session_without_heartbeat_or_watch_is_reclaimed_after_its_lease(client, admin):
    session = client.attach(layout(), num_blocks=16, lease_ms=300, watch=False, heartbeat=False)
    assert wait_for(lambda: session.session_id not in session_ids(admin))
    with pytest.raises(kvs.errors.NotFound):
        session.heartbeat()
    with pytest.raises(kvs.errors.NotFound):
        session.detach()  # the server no longer knows it; local resources are freed anyway
    assert session.detached


def test_session_of_a_killed_process_is_reclaimed_through_watch(server, admin):
    # A worker process that attaches and dies without detaching (long lease: only the Watch stream
    # can tell the server).
    code = textwrap.dedent(f"""
        import os, sys, kvsidecar as kvs
        c = kvs.Client({server.address!r})
        s = c.attach(kvs.model_layout(2, 2, 16), num_blocks=16, lease_ms=600000)
        assert s.watching(10)
        print(s.session_id, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    session_id = out.stdout.strip()
    assert len(session_id) > 0
    assert wait_for(lambda: session_id not in session_ids(admin)), \
        "the session of a dead worker was not reclaimed"
    assert admin.get_stats().sessions_reclaimed >= 1
