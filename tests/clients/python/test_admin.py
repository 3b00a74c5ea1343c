"""kvsidecar.Admin against the real server: config, sessions, sequences, stats, force release."""

import pytest

import kvsidecar as kvs
from kvs_py_util import layout, random_kv, wait_for


def test_get_config(admin):
    config = admin.get_config()
    assert config.backend == "cpu"
    assert config.backend_reason
    assert "lease_ms" in config.effective_config_yaml


def test_sessions_sequences_and_stats(client, admin):
    base = admin.get_stats()
    with client.attach(layout("fp16"), num_blocks=32, tenant="t1", worker_name="adm") as session:
        seq = session.create_sequence("keydiff", 8).sequence_id
        session.append(seq, random_kv("fp16", (2, 2, 2, 20, 16)))
        sessions = admin.list_sessions(tenant="t1").sessions
        assert [s.session_id for s in sessions] == [session.session_id]
        assert sessions[0].worker_name == "adm" and sessions[0].sequences == 1
        assert sessions[0].layout.num_layers == 2
        assert admin.list_sessions(tenant="other").sessions == []
        seqs = admin.list_sequences(session_id=session.session_id).sequences
        assert [s.sequence_id for s in seqs] == [seq]
        assert list(seqs[0].tokens_per_layer) == [20, 20] and seqs[0].arena_bytes > 0
        session.compress(seq)
        stats = admin.get_stats()
        assert stats.sessions == base.sessions + 1 and stats.sequences == base.sequences + 1
        assert stats.tokens_appended - base.tokens_appended == 40
        assert stats.tokens_evicted - base.tokens_evicted == 24
        assert stats.arena_bytes_used > 0 and stats.backend == "cpu"
    assert admin.get_stats().arena_bytes_used == 0


def test_force_release_aborts_the_session(client, admin):
    session = client.attach(layout("fp16"), num_blocks=16)
    session.create_sequence()
    released = admin.force_release(session.session_id)
    assert released.sequences_released == 1
    assert wait_for(lambda: isinstance(session.health, kvs.errors.Aborted))
    with pytest.raises(kvs.errors.NotFound):
        session.heartbeat()
    with pytest.raises(kvs.errors.NotFound):
        admin.force_release("no-such-session")
    with pytest.raises(kvs.errors.NotFound):
        session.detach()


def test_drain_is_announced_on_watch_and_refuses_attaches():
    # Its own server: a drained server accepts no attaches.
    from kvsidecar.server import LocalServer
    with LocalServer() as srv, kvs.Client(srv.address) as client, \
            kvs.Admin(srv.admin_address) as admin:
        with client.attach(layout("fp16"), num_blocks=8) as session:
            assert session.watching(timeout=10)
            drained = admin.drain()
            assert drained.sessions_remaining == 1 and not drained.empty
            assert wait_for(lambda: session.draining), "KIND_DRAINING never arrived on Watch"
            assert admin.get_stats().draining
            with pytest.raises(kvs.KvsError) as error:
                client.attach(layout("fp16"), num_blocks=8)
            assert error.value.code in (kvs.errors.Unavailable.code,
                                        kvs.errors.FailedPrecondition.code)
        assert admin.drain().empty


def test_set_defaults_applies_to_new_sequences_or_is_unimplemented():
    # Its own server: the new defaults would leak into other tests.
    from kvsidecar.server import LocalServer
    with LocalServer() as srv, kvs.Client(srv.address) as client, \
            kvs.Admin(srv.admin_address) as admin:
        try:
            admin.set_defaults(default_policy=kvs.policy("streaming_llm", n_sink=2),
                               default_budget=kvs.budget(8))
        except kvs.errors.Unimplemented as error:
            assert "SetDefaults" in error.message
            return
        config = admin.get_config()
        assert config.default_policy.name == "streaming_llm"
        assert config.default_budget.tokens_per_layer == 8
        with client.attach(layout("fp16"), num_blocks=16) as session:
            created = session.create_sequence()
            assert created.policy.name == "streaming_llm"
            assert created.budget.tokens_per_layer == 8


def test_bearer_tokens_for_tenants_and_admin(tmp_path):
    (tmp_path / "tokens.yaml").write_text("team-a: token-aaaa\nteam-b: token-bbbb\n")
    (tmp_path / "admin.token").write_text("admin-secret-1\n")
    from kvsidecar.server import LocalServer
    with LocalServer(extra_args=[f"--tenant_tokens_file={tmp_path}/tokens.yaml",
                                 f"--admin_token_file={tmp_path}/admin.token"]) as srv:
        with kvs.Client(srv.address) as anonymous:
            with pytest.raises(kvs.errors.Unauthenticated, match="authorization"):
                anonymous.attach(layout("fp16"), num_blocks=8, tenant="team-a")
        with kvs.Admin(srv.admin_address, token="wrong") as bad_admin:
            with pytest.raises(kvs.errors.Unauthenticated):
                bad_admin.get_stats()
        with kvs.Client(srv.address, token="token-aaaa") as client, \
                kvs.Admin(srv.admin_address, token="admin-secret-1") as admin:
            with client.attach(layout("fp16"), num_blocks=8, tenant="team-a") as session:
                assert session.watching(timeout=10)  # the streaming call carries the token too
                seq = session.create_sequence().sequence_id
                session.append(seq, random_kv("fp16", (2, 2, 2, 3, 16)))
                assert session.export(seq).layer(0).count == 3
                assert [s.tenant for s in admin.list_sessions().sessions] == ["team-a"]
            assert admin.get_stats().sessions == 0


def test_drain_to_disk_reports_moves_and_a_new_session_adopts_the_copy():
    # Its own server: a drained server accepts no attaches.
    from kvsidecar.server import LocalServer
    from kvsidecar.v1 import common_pb2
    with LocalServer() as srv, kvs.Client(srv.address) as client, \
            kvs.Admin(srv.admin_address) as admin:
        old = client.attach(layout("fp16"), num_blocks=16, tenant="dr")
        new = client.attach(layout("fp16"), num_blocks=16, tenant="dr")
        seq = old.create_sequence("keydiff", 64, sequence_id="conv-1").sequence_id
        old.append(seq, random_kv("fp16", (2, 2, 2, 20, 16), seed=3))
        before = old.export(seq)
        with pytest.raises(kvs.errors.InvalidArgument):
            admin.drain(to=common_pb2.TIER_HOST)
        assert not admin.get_stats().draining
        drained = admin.drain(to=common_pb2.TIER_DISK, grace_ms=20000)
        assert drained.sequences_moved == 1 and drained.sequences_not_moved == 0
        [moved] = drained.sequences
        assert (moved.sequence_id, moved.moved, moved.tier) == (seq, True, common_pb2.TIER_DISK)
        old.detach()  # its disk copy stays, adoptable by the tenant
        restored = new.restore(seq, adopt_any_session=True)
        assert restored.adopted_from_session_id == old.session_id
        after = new.export(seq)
        assert after.payload == before.payload
        assert [list(l.positions) for l in after.header.layers] == \
            [list(l.positions) for l in before.header.layers]
        new.detach()
