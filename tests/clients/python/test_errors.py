"""Errors: KvsError subclasses carrying the gRPC code and the server's message (naming the field);
a failed call changes nothing."""

import grpc
import numpy as np
import pytest

import kvsidecar as kvs
from kvsidecar import errors
from kvs_py_util import layout, random_kv


def test_error_mapping_keeps_code_and_message():
    class FakeRpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "arena full"

    error = errors.error_from_rpc(FakeRpcError())
    assert type(error) is errors.ResourceExhausted and isinstance(error, kvs.KvsError)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.message == "arena full"
    assert str(error) == "RESOURCE_EXHAUSTED: arena full"


@pytest.mark.parametrize("bad,field", [
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_dim=0), "head_dim"),
    (dict(num_q_heads=3), "num_q_heads"),
    (dict(block_tokens=-1), "block_tokens"),
])
def test_attach_with_a_bad_layout_names_the_field(client, admin, bad, field):
    with pytest.raises(errors.InvalidArgument) as error:
        client.attach(layout(**bad), num_blocks=8)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.message
    assert admin.get_stats().sessions == 0


def test_bad_calls_on_a_session(client, admin):
    with client.attach(layout("fp16"), num_blocks=16) as session:
        with pytest.raises(errors.InvalidArgument, match="tokens_per_layer"):
            session.create_sequence(budget=-1)
        with pytest.raises(errors.InvalidArgument, match="policy"):
            session.create_sequence(policy="no_such_policy")
        with pytest.raises(errors.NotFound):
            session.get_layout("missing")
        seq = session.create_sequence(budget=8).sequence_id
        with pytest.raises(errors.InvalidArgument, match="num_tokens"):
            session.reserve(seq, 0)
        with pytest.raises(errors.InvalidArgument, match="layers"):
            session.reserve(seq, 1, layers=[5])
        r = session.reserve(seq, 3)
        # Local shape check before anything is written.
        with pytest.raises(errors.InvalidArgument, match=r"\[H\]\[num_tokens\]\[D\]"):
            session.write_reserved(r, 0, np.zeros((2, 4, 16)), np.zeros((2, 4, 16)))
        session.commit(r)
        with pytest.raises(errors.FailedPrecondition):
            session.commit(r)  # twice
        with pytest.raises(errors.KvsError, match="payload_bytes"):
            session.append(seq, b"\0" * 10, num_tokens=1)  # wrong payload size
        with pytest.raises(errors.InvalidArgument, match="budget_tokens"):
            session.compress(seq, budget_tokens=-3)
        # Nothing above changed the sequence.
        lay = session.get_layout(seq)
        assert [e.count for e in lay.layers] == [3, 3]


def test_attention_policy_without_attention_names_it(client, admin):
    with client.attach(layout("fp16"), num_blocks=16) as session:
        seq = session.create_sequence("h2o", 4).sequence_id
        session.append(seq, random_kv("fp16", (2, 2, 2, 10, 16)))
        with pytest.raises(errors.InvalidArgument, match="attention") as error:
            session.compress(seq)
        assert "h2o" in error.value.message
        assert [e.count for e in session.get_layout(seq).layers] == [10, 10]


def test_unreachable_server_is_unavailable():
    with pytest.raises(errors.Unavailable):
        kvs.Client("127.0.0.1:1", connect_timeout=0.5)


def test_a_zero_budget_is_refused_in_every_call(client, admin):
    """0 keeps nothing: refused wherever a budget is given, naming what None means and kvpress's
    compression_ratio; None is the default (no budget, the sequence's budget)."""
    with client.attach(layout("fp16"), num_blocks=16) as session:
        with pytest.raises(errors.InvalidArgument, match="budget=0 keeps no token.*None"):
            session.create_sequence("keydiff", budget=0)
        with pytest.raises(errors.InvalidArgument, match="fraction of the prompt"):
            session.create_sequence("keydiff", budget=0.25)
        seq = session.create_sequence("keydiff", budget=4).sequence_id
        session.append(seq, random_kv("fp16", (2, 2, 2, 6, 16)))
        for call in (session.compress, session.score):
            with pytest.raises(errors.InvalidArgument,
                               match="budget_tokens=0 keeps no token.*compression_ratio"):
                call(seq, budget_tokens=0)
        with pytest.raises(errors.InvalidArgument, match="budget_tokens=0"):
            session.batch_compress([{"sequence_id": seq, "budget_tokens": 0}])
        assert [e.count for e in session.get_layout(seq).layers] == [6, 6]
        assert [e.kept for e in session.compress(seq).layers] == [4, 4]  # None: its budget
