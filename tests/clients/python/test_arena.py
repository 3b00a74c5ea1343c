"""kvsidecar.arena: dtype conversions and the mapped arena's geometry against the real server."""

import os

import numpy as np
import pytest

import kvsidecar as kvs
from kvs_py_util import layout


def test_bf16_round_trip_is_exact_for_bf16_values():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    floats = kvs.bf16_to_float32(bits)
    finite = ~np.isnan(floats)
    assert np.array_equal(kvs.float32_to_bf16(floats)[finite], bits[finite])
    assert np.isnan(kvs.bf16_to_float32(kvs.float32_to_bf16(floats[~finite]))).all()


def test_float32_to_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa.
    values = np.array([1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -2.5, 65504.0], np.float32)
    out = kvs.bf16_to_float32(kvs.float32_to_bf16(values))
    assert out.tolist() == [1.0, 1.0, 1.015625, -2.5, 65536.0]


def test_to_storage_checks_types():
    assert kvs.to_storage(np.ones(3, np.float32), kvs.common_pb2.DTYPE_FLOAT16).dtype == np.float16
    bits = np.array([0x3F80], np.uint16)
    assert kvs.to_storage(bits, kvs.common_pb2.DTYPE_BFLOAT16) is bits  # passed through
    with pytest.raises(kvs.errors.InvalidArgument):
        kvs.to_storage(np.ones(3, np.int32), kvs.common_pb2.DTYPE_FLOAT32)
    assert kvs.dtype_bytes(kvs.common_pb2.DTYPE_BFLOAT16) == 2
    assert kvs.dtype_bytes(kvs.common_pb2.DTYPE_UNSPECIFIED) == 0


@pytest.mark.parametrize("dtype,itemsize", [("fp16", 2), ("bf16", 2), ("fp32", 4)])
def test_arena_geometry_matches_the_handle(client, admin, dtype, itemsize):
    with client.attach(layout(dtype, num_kv_heads=3, num_q_heads=6, head_dim=8, block_tokens=4),
                       num_blocks=20) as session:
        arena = session.arena
        handle = session.attach_response.arena
        assert arena.blocks.shape == (handle.num_blocks, 2, 3, 4, 8)
        assert arena.blocks.dtype.itemsize == itemsize
        assert arena.block_bytes == handle.block_bytes == 2 * 3 * 4 * 8 * itemsize
        # The default arena is an anonymous memfd fetched over the arena socket: no path.
        assert handle.kind == kvs.common_pb2.ArenaHandle.KIND_MEMFD
        assert arena.path == "" and handle.shm_path == ""
        assert os.path.isabs(handle.fd_socket_path) and len(handle.fd_nonce) == 64
        with pytest.raises(kvs.errors.OutOfRange):
            arena.block(handle.num_blocks)


def test_memfd_nonce_fetches_the_arena_once(client):
    # attach spent the nonce fetching the arena; nobody (this process included) can use it again.
    with client.attach(layout("fp16"), num_blocks=4) as session:
        handle = session.attach_response.arena
        with pytest.raises(kvs.errors.PermissionDenied, match="unknown or already used nonce"):
            kvs.fetch_arena_fd(handle.fd_socket_path, session.session_id, handle.fd_nonce)
        with pytest.raises(kvs.errors.PermissionDenied):
            kvs.fetch_arena_fd(handle.fd_socket_path, session.session_id, "0" * 64)


def test_host_arena_refuses_a_cuda_ipc_handle():
    # Device memory is mapped by CudaArena (tests/clients/python/test_cuda_arena.py).
    handle = kvs.common_pb2.ArenaHandle(kind=kvs.common_pb2.ArenaHandle.KIND_CUDA_IPC,
                                        cuda_ipc_handle=b"\0" * 64, size_bytes=1 << 20)
    with pytest.raises(kvs.errors.InvalidArgument, match="CudaArena"):
        kvs.Arena(handle, layout("fp16"))


def test_attention_inputs_carry_queries_bit_for_bit():
    q = np.random.default_rng(0).standard_normal((2, 4, 3, 16), dtype=np.float32)
    a = kvs.attention(q, query_positions=[5, 6, 7], layers=[0, 1])
    assert a.queries_dtype == kvs.common_pb2.DTYPE_FLOAT32 and a.num_queries == 3
    assert a.softmax_scale == pytest.approx(0.25)
    assert np.array_equal(np.frombuffer(a.inline_queries, np.float32).reshape(q.shape), q)
    b = kvs.attention(q, bf16=True)
    assert b.queries_dtype == kvs.common_pb2.DTYPE_BFLOAT16
    assert np.array_equal(np.frombuffer(b.inline_queries, np.uint16), kvs.float32_to_bf16(q).ravel())
    with pytest.raises(kvs.errors.InvalidArgument, match="queries"):
        kvs.attention(q[0])
