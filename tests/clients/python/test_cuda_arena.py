"""kvsidecar.arena.CudaArena: KIND_CUDA_IPC arenas.

Without a GPU: UUID text, the process-wide mapping cache (open once per session and generation,
refuse stale and foreign handles and devices this process does not see, close on the last
release) and the Session's copy paths (write_reserved / read_layer through cudaMemcpy), all over a
fake CUDA runtime whose "device memory" is host memory; and the clear error of the real runtime
on a host without CUDA. With torch + CUDA and a device: the real two-process path against
`kvsidecar --backend=cuda` (skipped with the reason otherwise).
"""

import ctypes
import os

import numpy as np
import pytest

import kvsidecar as kvs
from kvsidecar import arena as arena_mod
from kvs_py_util import layout, random_kv

UUID_A = "GPU-0123abcd-4567-89ef-0011-2233445566ff"
UUID_B = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"


class FakeRuntime:
    """The _Cudart interface over host memory: each open returns a fresh zeroed numpy buffer."""

    def __init__(self, uuids, nbytes=1 << 16):
        self.uuids = [kvs.arena.parse_cuda_uuid(u) for u in uuids]
        self.nbytes = nbytes
        self.buffers = {}
        self.opens = []
        self.closes = []
        self.copies = 0

    def device_uuids(self):
        if not self.uuids:
            raise kvs.errors.FailedPrecondition("no CUDA device (fake)")
        return self.uuids

    def open(self, device, handle):
        buffer = np.zeros(self.nbytes, np.uint8)
        self.buffers[buffer.ctypes.data] = buffer
        self.opens.append((device, handle))
        return buffer.ctypes.data

    def close(self, device, base):
        self.closes.append(device)
        del self.buffers[base]

    def memcpy(self, device, dst, src, nbytes, kind):
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)


def cuda_handle(fill=b"x", generation=7, uuid=UUID_B, num_blocks=4, lay=None):
    lay = lay or layout("fp16", num_kv_heads=2, head_dim=8, block_tokens=4)
    block_bytes = 2 * lay.num_kv_heads * lay.block_tokens * lay.head_dim * 2
    return kvs.common_pb2.ArenaHandle(
        kind=kvs.common_pb2.ArenaHandle.KIND_CUDA_IPC, cuda_ipc_handle=fill * 64,
        cuda_device=3, cuda_device_uuid=uuid, size_bytes=num_blocks * block_bytes,
        generation=generation, block_bytes=block_bytes, num_blocks=num_blocks), lay


def test_uuid_text_round_trips_and_refuses_malformed_text():
    raw = kvs.arena.parse_cuda_uuid(UUID_A)
    assert raw[:2] == b"\x01\x23" and raw[-1] == 0xFF and len(raw) == 16
    assert kvs.arena.format_cuda_uuid(raw) == UUID_A
    assert kvs.arena.parse_cuda_uuid(UUID_A.upper().replace("GPU-", "MIG-")) == raw
    assert kvs.arena.parse_cuda_uuid(UUID_A[4:]) == raw
    for bad in ["", "GPU-", UUID_A + "0", UUID_A[:-1], UUID_A.replace("-", "", 1),
                UUID_A.replace("a", "g"), "XPU-" + UUID_A[4:]]:
        with pytest.raises(kvs.errors.InvalidArgument, match="not a CUDA device UUID"):
            kvs.arena.parse_cuda_uuid(bad)


def test_maps_on_the_device_with_the_handles_uuid_once_and_closes_on_last_release():
    runtime = FakeRuntime([UUID_A, UUID_B])
    handle, lay = cuda_handle()
    first = kvs.CudaArena(handle, lay, "s1", runtime=runtime)
    assert first.device == 1 and first.generation == 7  # the local ordinal of UUID_B
    assert runtime.opens == [(1, b"x" * 64)]
    again = kvs.CudaArena(handle, lay, "s1", runtime=runtime)  # cached: no second open
    assert again.base == first.base and len(runtime.opens) == 1
    cai = first.__cuda_array_interface__
    assert cai["data"] == (first.base, False) and cai["shape"] == (handle.size_bytes,)
    assert cai["typestr"] == "|u1" and cai["version"] == 3
    first.close()
    assert runtime.closes == []  # still used by `again`
    again.close()
    assert runtime.closes == [1]
    assert again.close()  # idempotent
    with pytest.raises(kvs.errors.FailedPrecondition, match="closed"):
        again.read_blocks([0])


def test_refuses_stale_generations_and_handles_of_other_sessions():
    runtime = FakeRuntime([UUID_B])
    handle, lay = cuda_handle(generation=7)
    mapped = kvs.CudaArena(handle, lay, "s1", runtime=runtime)
    for generation in (6, 8):
        stale, _ = cuda_handle(fill=b"y", generation=generation)
        with pytest.raises(kvs.errors.FailedPrecondition, match="generation 7 mapped"):
            kvs.CudaArena(stale, lay, "s1", runtime=runtime)
    with pytest.raises(kvs.errors.FailedPrecondition, match="arena of session s1"):
        kvs.CudaArena(handle, lay, "s2", runtime=runtime)
    assert len(runtime.opens) == 1
    mapped.close()
    fresh, _ = cuda_handle(fill=b"y", generation=8)
    kvs.CudaArena(fresh, lay, "s1", runtime=runtime).close()  # a new generation after release
    assert len(runtime.opens) == 2 and runtime.closes == [0, 0]


def test_refuses_devices_this_process_does_not_see_and_malformed_handles():
    runtime = FakeRuntime([UUID_A])
    handle, lay = cuda_handle(uuid=UUID_B)
    with pytest.raises(kvs.errors.FailedPrecondition,
                       match=f"arena.cuda_device_uuid {UUID_B}.*{UUID_A}.*CUDA_VISIBLE_DEVICES"):
        kvs.CudaArena(handle, lay, "s1", runtime=runtime)
    with pytest.raises(kvs.errors.FailedPrecondition, match="no CUDA device"):
        kvs.CudaArena(handle, lay, "s1", runtime=FakeRuntime([]))
    short, _ = cuda_handle()
    short.cuda_ipc_handle = b"abc"
    with pytest.raises(kvs.errors.Internal, match="has 3 bytes, expected 64"):
        kvs.CudaArena(short, lay, "s1", runtime=runtime)
    bad_uuid, _ = cuda_handle(uuid="GPU-nope")
    with pytest.raises(kvs.errors.Internal, match="cuda_device_uuid"):
        kvs.CudaArena(bad_uuid, lay, "s1", runtime=runtime)
    assert runtime.opens == []


def test_copies_rows_and_blocks_at_the_block_layout_offsets():
    runtime = FakeRuntime([UUID_B])
    handle, lay = cuda_handle()
    arena = kvs.CudaArena(handle, lay, "s1", runtime=runtime)
    memory = runtime.buffers[arena.base]
    rows = np.arange(3 * 8, dtype=np.float16).reshape(3, 8)
    arena.write_rows(2, 1, 1, 1, rows)  # block 2, V, head 1, slots 1..3
    row_bytes = 8 * 2
    at = 2 * handle.block_bytes + ((1 * 2 + 1) * 4 + 1) * row_bytes
    assert memory[at:at + rows.nbytes].tobytes() == rows.tobytes()
    blocks = arena.read_blocks([2, 0])
    assert blocks.shape == (2, 2, 2, 4, 8) and blocks.dtype == np.float16
    assert np.array_equal(blocks[0, 1, 1, 1:4], rows)
    assert not blocks[1].any()
    with pytest.raises(kvs.errors.OutOfRange):
        arena.write_rows(2, 1, 1, 2, rows)  # the last row would leave the block
    with pytest.raises(kvs.errors.OutOfRange):
        arena.read_blocks([4])
    with pytest.raises(kvs.errors.InvalidArgument):
        arena.write_rows(0, 0, 0, 0, np.zeros((1, 7), np.float16))
    arena.close()


def test_session_writes_and_reads_a_cuda_arena_through_the_copy_paths(client, monkeypatch):
    # A Session over a synthetic CUDA attach response (never sent to the server), with the fake
    # runtime standing in for libcudart.
    runtime = FakeRuntime([UUID_B])
    monkeypatch.setattr(arena_mod, "_runtime", lambda: runtime)
    handle, lay = cuda_handle(num_blocks=4)
    response = kvs.sidecar_pb2.AttachResponse(session_id="cuda-s", arena=handle, layout=lay,
                                              backend="cuda")
    session = kvs.Session(client, response, watch=False, heartbeat=False)
    try:
        assert isinstance(session.arena, kvs.CudaArena)
        reserve = kvs.sidecar_pb2.ReserveResponse(reservation_id=1, positions=list(range(6)))
        reserve.layers.add(layer=0, first_slot=2, blocks=[3, 1])  # slots 2..7: blocks 3 then 1
        reservation = kvs.Reservation(session, "seq", reserve)
        k = random_kv("fp16", (2, 6, 8), seed=1)
        v = random_kv("fp16", (2, 6, 8), seed=2)
        session.write_reserved(reservation, 0, k, v)
        entry = kvs.common_pb2.LayerLayout(layer=0, count=8, block_table=[3, 1])
        kv = session.read_layer(entry)
        assert np.array_equal(kv.k[:, 2:8], k) and np.array_equal(kv.v[:, 2:8], v)
        assert not kv.k[:, :2].any()
    finally:
        session._arena.close()
    assert runtime.closes == [0]


def test_real_runtime_without_cuda_fails_with_a_clear_error():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a CUDA driver is present: the no-CUDA error path does not apply here")
    handle, lay = cuda_handle()
    with pytest.raises(kvs.errors.FailedPrecondition, match="KIND_CUDA_IPC") as error:
        kvs.CudaArena(handle, lay, "nocuda")
    assert ("could not be loaded" in error.value.message or
            "no CUDA device" in error.value.message), error.value.message


def _torch_cuda_or_skip():
    try:
        import torch
    except ImportError:
        pytest.skip("no CUDA device usable from Python: torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch has no usable CUDA device")
    return torch


def test_torch_tensors_over_a_real_cuda_arena():
    """Two processes on one GPU: the sidecar compresses what this process wrote with its own torch
    stream; the compacted cache is read in place through the tensor, bit-identical."""
    torch = _torch_cuda_or_skip()
    from kvsidecar.server import LocalServer
    with LocalServer(extra_args=["--backend=cuda"]) as server, \
            kvs.Client(server.address, timeout=60) as client:
        lay = layout("fp16", num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=64)
        with client.attach(lay, num_blocks=64) as session:
            arena = session.arena
            assert isinstance(arena, kvs.CudaArena)
            assert not session.attach_response.arena.cuda_ipc_event_handle
            seq = session.create_sequence(policy="keydiff", budget=48).sequence_id
            r = session.reserve(seq, 160)
            k = random_kv("fp16", (2, 2, 160, 64), seed=3)
            v = random_kv("fp16", (2, 2, 160, 64), seed=4)
            stream = torch.cuda.Stream(device=arena.device)
            with torch.cuda.stream(stream):
                for layer in range(2):
                    for first, kview, vview in r.views(layer):
                        n = kview.shape[1]
                        kview.copy_(torch.from_numpy(k[layer][:, first:first + n]))
                        vview.copy_(torch.from_numpy(v[layer][:, first:first + n]))
            stream.synchronize()  # rule (a): the writes are complete before commit
            session.commit(r)
            session.compress(seq)
            layout_response = session.get_layout(seq)
            for entry in layout_response.layers:
                assert entry.count == 48
                blocks = session.layer_blocks(entry)  # torch views, read right after compress
                pos = np.asarray(entry.positions).reshape(2, 48)
                got_k = torch.cat([b[0, :, :n] for b, n in blocks], dim=1).cpu().numpy()
                got_v = torch.cat([b[1, :, :n] for b, n in blocks], dim=1).cpu().numpy()
                for head in range(2):
                    assert np.array_equal(got_k[head], k[entry.layer][head, pos[head]])
                    assert np.array_equal(got_v[head], v[entry.layer][head, pos[head]])
                kv = session.read_layer(entry)  # the cudaMemcpy path agrees
                assert np.array_equal(kv.k, got_k) and np.array_equal(kv.v, got_v)
