"""Dtype helpers and the zero-copy view of a session's arena.

Block layout (proto/kvsidecar/v1/common.proto, gpu/base/layout.h): one block holds one layer of
one sequence for every kv head, ``[2][H][B][D]`` elements of the session dtype, keys (index 0) then
values (index 1). Slot ``s`` of a layer sits in block ``block_table[s // B]`` at in-block index
``s % B``. The byte offset of element (kv, head, in_block, d) of block b is::

    b * block_bytes + (((kv * H + head) * B + in_block) * D + d) * dtype_bytes

On the CPU backend the arena is shared memory the client maps once (``mmap``, MAP_SHARED): by
default an anonymous memfd (``KIND_MEMFD``) whose descriptor :func:`fetch_arena_fd` receives from
the sidecar's arena socket with the single-use nonce of the Attach response (no other process can
open it by name), or, from a sidecar run with ``--arena_shm_names``, a named file opened by path;
:attr:`Arena.blocks` is a numpy array ``[num_blocks][2][H][B][D]`` over that mapping, so writing
into it writes the sidecar's memory and reading it reads the sidecar's memory, with no copy and no
RPC. bfloat16 has no numpy dtype: it is exposed as ``uint16`` bit patterns, converted with
:func:`bf16_to_float32` / :func:`float32_to_bf16`.

A CUDA arena (``KIND_CUDA_IPC``, a ``--backend=cuda`` sidecar) is a :class:`CudaArena`: the
handle is opened once per (session, generation) with ``cudaIpcOpenMemHandle`` through ctypes on
the CUDA runtime (``libcudart``; ``$KVS_CUDART`` names it explicitly), on the local GPU whose UUID
is ``arena.cuda_device_uuid`` (ordinals differ between processes). It exposes the mapping as
``__cuda_array_interface__`` (CuPy, Numba), as torch tensors over the same memory
(:attr:`CudaArena.blocks`, :meth:`CudaArena.block`; needs torch with CUDA) and, without torch, as
synchronous ``cudaMemcpy`` copies to and from numpy. A handle of another session, or of another
generation while one is mapped, is refused (``FailedPrecondition``), as in the C++ client.

Synchronisation (common.proto ``ArenaHandle``): synchronise the stream(s) that wrote reserved slots
before commit / decode_step / compress (``torch.cuda.synchronize()`` or the stream's
``synchronize()``); every call that changes the arena has finished its device work when its
response arrives, so reading right after the call is safe. ``cuda_ipc_event_handle`` is empty.

Threading: an Arena is a plain mapping; concurrent writes to distinct slots are fine, and the
sidecar only changes memory during calls that the caller makes (commit, compress, decode_step).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import socket
import threading
from typing import Any, Dict, List, Optional, Union

import numpy as np

from kvsidecar.errors import (FailedPrecondition, Internal, InvalidArgument, OutOfRange,
                              PermissionDenied, Unavailable)
from kvsidecar.v1 import common_pb2

__all__ = [
    "DType", "dtype_bytes", "storage_dtype", "bf16_to_float32", "float32_to_bf16", "to_storage",
    "to_float32", "Arena", "CudaArena", "open_arena", "parse_cuda_uuid", "format_cuda_uuid",
]

DType = common_pb2.DType

_STORAGE: Dict[int, np.dtype[Any]] = {
    common_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    common_pb2.DTYPE_BFLOAT16: np.dtype("<u2"),
    common_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
}


def dtype_bytes(dtype: int) -> int:
    """Bytes of one element of a ``DType`` (0 for DTYPE_UNSPECIFIED / unknown values)."""
    return _STORAGE[dtype].itemsize if dtype in _STORAGE else 0


def storage_dtype(dtype: int) -> np.dtype:
    """The numpy dtype that holds elements of ``dtype`` bit for bit (bf16 -> uint16)."""
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} has no storage type") from None


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise InvalidArgument(f"bf16_to_float32 wants uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(f)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return out


def to_storage(values: np.ndarray, dtype: int) -> np.ndarray:
    """``values`` as the storage type of ``dtype``.

    Arrays already of the storage type are passed through bit for bit (for bf16: uint16 bit
    patterns). Floating arrays are converted (fp16/fp32 by numpy casting, bf16 by
    :func:`float32_to_bf16`).
    """
    values = np.asarray(values)
    target = storage_dtype(dtype)
    if values.dtype == target:
        return values
    if dtype == common_pb2.DTYPE_BFLOAT16:
        if not np.issubdtype(values.dtype, np.floating):
            raise InvalidArgument(
                f"bf16 data must be uint16 bit patterns or floating point, got {values.dtype}")
        return float32_to_bf16(values.astype(np.float32))
    if not np.issubdtype(values.dtype, np.floating):
        raise InvalidArgument(f"K/V data must be floating point, got {values.dtype}")
    return values.astype(target)


def to_float32(values: np.ndarray, dtype: int) -> np.ndarray:
    """Storage-typed ``values`` of ``dtype`` -> float32."""
    values = np.asarray(values)
    if dtype == common_pb2.DTYPE_BFLOAT16:
        return bf16_to_float32(values)
    return values.astype(np.float32)



class _Geometry:
    """The block geometry both arena kinds share, set from the handle by _set_geometry."""

    dtype: int
    num_kv_heads: int
    block_tokens: int
    head_dim: int
    num_blocks: int
    block_bytes: int
    size_bytes: int
    generation: int
    staging_offset: int  # the query staging area (0 bytes when the session asked for none)
    staging_bytes: int


def _set_geometry(arena: _Geometry, handle: "common_pb2.ArenaHandle",
                  layout: "common_pb2.ModelLayout") -> np.dtype:
    """Sets the block geometry both arena kinds share on `arena`, checked against the layout.

    Returns the storage dtype. InvalidArgument when the handle's block size or total size do not
    fit the layout.
    """
    arena.dtype = layout.dtype
    arena.num_kv_heads = layout.num_kv_heads
    arena.block_tokens = layout.block_tokens
    arena.head_dim = layout.head_dim
    arena.num_blocks = handle.num_blocks
    arena.block_bytes = handle.block_bytes
    arena.size_bytes = handle.size_bytes
    arena.generation = handle.generation
    arena.staging_offset = handle.staging_offset
    arena.staging_bytes = handle.staging_bytes
    if handle.staging_bytes and handle.staging_offset + handle.staging_bytes > handle.size_bytes:
        raise InvalidArgument(
            f"arena staging area [{handle.staging_offset}, +{handle.staging_bytes}) leaves the "
            f"arena of {handle.size_bytes} bytes")
    np_dtype = storage_dtype(layout.dtype)
    expected = 2 * layout.num_kv_heads * layout.block_tokens * layout.head_dim * np_dtype.itemsize
    if expected != handle.block_bytes:
        raise InvalidArgument(
            f"arena.block_bytes {handle.block_bytes} != 2*H*B*D*dtype_bytes = {expected}")
    if handle.num_blocks * handle.block_bytes > handle.size_bytes:
        raise InvalidArgument(
            f"arena.size_bytes {handle.size_bytes} < num_blocks*block_bytes "
            f"{handle.num_blocks * handle.block_bytes}")
    return np_dtype

class Arena(_Geometry):
    """The mapped arena of one session (CPU backend), with its block geometry.

    Attributes:
        blocks: ``[num_blocks][2][H][B][D]`` numpy array of the storage dtype over the shared
            memory: writes go straight into the sidecar's memory.
        num_blocks, num_kv_heads, block_tokens, head_dim, dtype: the geometry.
    """

    def __init__(self, handle: "common_pb2.ArenaHandle", layout: "common_pb2.ModelLayout",
                 session_id: str = "") -> None:
        kind = handle.kind
        if kind == common_pb2.ArenaHandle.KIND_CUDA_IPC:
            raise InvalidArgument(
                "a KIND_CUDA_IPC arena is device memory: map it with CudaArena (or open_arena), "
                "not Arena (host shared memory)")
        np_dtype = _set_geometry(self, handle, layout)
        if kind == common_pb2.ArenaHandle.KIND_MEMFD:
            if not session_id:
                raise InvalidArgument("a KIND_MEMFD arena needs the session id to fetch it")
            # Anonymous memory: there is no path; the descriptor comes from the sidecar.
            self.path: str = ""
            what = f"of session {session_id} (from {handle.fd_socket_path})"
            fd = fetch_arena_fd(handle.fd_socket_path, session_id, handle.fd_nonce)
        elif kind == common_pb2.ArenaHandle.KIND_SHARED_MEMORY_FILE:
            self.path = handle.shm_path
            if not self.path:
                raise InvalidArgument("arena.shm_path is empty")
            what = self.path
            fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        else:
            raise InvalidArgument(f"arena.kind {kind} cannot be mapped")
        try:
            if os.fstat(fd).st_size < self.size_bytes:
                raise InvalidArgument(
                    f"arena {what} is smaller than arena.size_bytes {self.size_bytes}")
            self._mmap: Optional[mmap.mmap] = mmap.mmap(
                fd, self.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory
        self.blocks: np.ndarray = np.ndarray(
            (self.num_blocks, 2, self.num_kv_heads, self.block_tokens, self.head_dim),
            dtype=np_dtype, buffer=self._mmap, offset=0)

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype of the elements (bf16 -> uint16)."""
        return self.blocks.dtype

    @property
    def staging(self) -> np.ndarray:
        """The query staging area as a float32 array over the shared memory (empty without one):
        write a step's queries ``[layers][Hq][w][D]`` at some offset, then name the offset (in
        bytes) in :func:`kvsidecar.client.staged_attention`."""
        if self._mmap is None:
            raise FailedPrecondition("the arena is closed")
        return np.ndarray((self.staging_bytes // 4,), dtype=np.float32, buffer=self._mmap,
                          offset=self.staging_offset)

    def block(self, block: int) -> np.ndarray:
        """Zero-copy view ``[2][H][B][D]`` of one block."""
        if not 0 <= block < self.num_blocks:
            raise OutOfRange(f"block {block} outside the arena's {self.num_blocks} blocks")
        view: np.ndarray = self.blocks[block]
        return view

    def close(self) -> bool:
        """Unmaps the arena. Returns False (and keeps the mapping alive) while numpy views of it
        are still referenced; the mapping then goes away with the last view."""
        if self._mmap is None:
            return True
        self.blocks = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            return False
        self._mmap = None
        return True


# ---------------------------------------------------------------------------------------------
# CUDA arenas (KIND_CUDA_IPC)

_CUDA_PREFIX = "cannot map the KIND_CUDA_IPC arena: "
_IPC_HANDLE_BYTES = 64
_UUID_RE = re.compile(r"^(?:GPU-|MIG-)?([0-9a-fA-F]{8})-([0-9a-fA-F]{4})-([0-9a-fA-F]{4})-"
                      r"([0-9a-fA-F]{4})-([0-9a-fA-F]{12})$")
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


def parse_cuda_uuid(text: str) -> bytes:
    """The 16 bytes of a device UUID printed as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``
    (``GPU-``/``MIG-`` prefix optional, any case). ``InvalidArgument`` otherwise."""
    match = _UUID_RE.match(text or "")
    if match is None:
        raise InvalidArgument(
            f"{text!r} is not a CUDA device UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return bytes.fromhex("".join(match.groups()))


def format_cuda_uuid(uuid: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (lower-case hex), the sidecar's format."""
    h = bytes(uuid).hex()
    if len(h) != 32:
        raise InvalidArgument(f"a CUDA UUID has 16 bytes, got {len(uuid)}")
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


class _Cudart:
    """The few CUDA runtime calls a CUDA arena needs, through ctypes on libcudart."""

    _NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")

    def __init__(self) -> None:
        explicit = os.environ.get("KVS_CUDART")
        names = [explicit] if explicit else list(self._NAMES)
        errors = []
        lib = None
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as error:
                errors.append(f"{name}: {error}")
        if lib is None:
            raise FailedPrecondition(
                _CUDA_PREFIX + "the CUDA runtime library could not be loaded (" +
                "; ".join(errors) + "); install the CUDA runtime (torch with CUDA ships one) or "
                "set KVS_CUDART to its path")
        self.lib = lib
        try:
            self._bind(lib)
        except AttributeError as error:  # a runtime without one of the calls below
            raise FailedPrecondition(
                _CUDA_PREFIX + f"the CUDA runtime library {lib._name} lacks a call: {error}"
            ) from None

    def _bind(self, lib: Any) -> None:
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [c_int]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [c_int]
        lib.cudaGetLastError.restype = c_int
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(c_int)]
        lib.cudaGetDeviceCount.restype = c_int
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(c_int)]
        lib.cudaGetDevice.restype = c_int
        lib.cudaSetDevice.argtypes = [c_int]
        lib.cudaSetDevice.restype = c_int
        # CUDA 12 names the current struct layout _v2; name[256] then the 16-byte uuid in both.
        self._props = getattr(lib, "cudaGetDeviceProperties_v2", None) or \
            lib.cudaGetDeviceProperties
        self._props.argtypes = [c_void_p, c_int]
        self._props.restype = c_int
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(c_void_p), _IpcMemHandle,
                                             ctypes.c_uint]
        lib.cudaIpcOpenMemHandle.restype = c_int
        lib.cudaIpcCloseMemHandle.argtypes = [c_void_p]
        lib.cudaIpcCloseMemHandle.restype = c_int
        lib.cudaMemcpy.argtypes = [c_void_p, c_void_p, c_size_t, c_int]
        lib.cudaMemcpy.restype = c_int

    def error(self, code: int, what: str) -> str:
        self.lib.cudaGetLastError()  # do not leave a non-sticky error for the caller's next call
        name = (self.lib.cudaGetErrorName(code) or b"?").decode()
        text = (self.lib.cudaGetErrorString(code) or b"?").decode()
        return f"{what}: {name} ({text})"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise Internal(self.error(code, what))

    def device_uuids(self) -> List[bytes]:
        count = ctypes.c_int(0)
        code = self.lib.cudaGetDeviceCount(ctypes.byref(count))
        if code != 0 or count.value == 0:
            why = self.error(code, "cudaGetDeviceCount") if code else "no device visible"
            raise FailedPrecondition(
                _CUDA_PREFIX + f"no CUDA device is usable in this process: {why}")
        uuids = []
        props = ctypes.create_string_buffer(16384)  # larger than any cudaDeviceProp
        for ordinal in range(count.value):
            code = self._props(props, ordinal)
            if code != 0:
                raise FailedPrecondition(
                    _CUDA_PREFIX + self.error(code, f"cudaGetDeviceProperties({ordinal})"))
            uuids.append(bytes(props.raw[256:272]))
        return uuids

    def _with_device(self, device: int, fn: Any) -> Any:
        """Runs fn() with `device` current, restoring the thread's device after."""
        previous = ctypes.c_int(-1)
        if self.lib.cudaGetDevice(ctypes.byref(previous)) != 0:
            self.lib.cudaGetLastError()
            previous.value = -1
        if previous.value != device:
            self.check(self.lib.cudaSetDevice(device), "cudaSetDevice")
        try:
            return fn()
        finally:
            if previous.value >= 0 and previous.value != device:
                self.lib.cudaSetDevice(previous.value)

    def open(self, device: int, handle: bytes) -> int:
        ipc = _IpcMemHandle()
        ctypes.memmove(ctypes.byref(ipc), handle, _IPC_HANDLE_BYTES)
        pointer = ctypes.c_void_p()

        def run() -> int:
            code = self.lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), ipc,
                                                 _IPC_LAZY_ENABLE_PEER_ACCESS)
            if code != 0:
                raise FailedPrecondition(
                    _CUDA_PREFIX + self.error(code, f"cudaIpcOpenMemHandle on device {device}"))
            return int(pointer.value or 0)
        return int(self._with_device(device, run))

    def close(self, device: int, base: int) -> None:
        self._with_device(device, lambda: self.check(
            self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(base)), "cudaIpcCloseMemHandle"))

    def memcpy(self, device: int, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._with_device(device, lambda: self.check(
            self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, kind),
            "cudaMemcpy"))


_cudart_lock = threading.Lock()
_cudart: Optional[_Cudart] = None


def _runtime() -> _Cudart:
    global _cudart
    with _cudart_lock:
        if _cudart is None:
            _cudart = _Cudart()
        return _cudart


class _Mapping:
    def __init__(self, runtime: Any, handle: bytes, generation: int, device: int,
                 base: int) -> None:
        self.runtime = runtime
        self.handle = handle
        self.generation = generation
        self.device = device
        self.base = base
        self.references = 1


# The process-wide cache of open IPC mappings, keyed by session id (one generation each): CUDA
# maps an allocation at most once per process, and a stale or foreign handle must be refused.
_mappings_lock = threading.Lock()
_mappings: Dict[str, _Mapping] = {}


def _acquire(runtime: Any, session_id: str, handle: "common_pb2.ArenaHandle") -> _Mapping:
    raw = bytes(handle.cuda_ipc_handle)
    if len(raw) != _IPC_HANDLE_BYTES:
        raise Internal(_CUDA_PREFIX + f"arena.cuda_ipc_handle has {len(raw)} bytes, expected "
                       f"{_IPC_HANDLE_BYTES}")
    try:
        uuid = parse_cuda_uuid(handle.cuda_device_uuid)
    except InvalidArgument as error:
        raise Internal(_CUDA_PREFIX + "arena.cuda_device_uuid: " + error.message) from None
    with _mappings_lock:
        mapping = _mappings.get(session_id)
        if mapping is not None:
            if mapping.generation != handle.generation:
                raise FailedPrecondition(
                    _CUDA_PREFIX + f"session {session_id} has arena generation "
                    f"{mapping.generation} mapped in this process and the handle carries "
                    f"generation {handle.generation}; a mapping of another generation is never "
                    "reused (detach the session first)")
            if mapping.handle != raw:
                raise FailedPrecondition(
                    _CUDA_PREFIX + f"session {session_id} has a different IPC handle of "
                    f"generation {handle.generation} mapped in this process")
            mapping.references += 1
            return mapping
        for other, entry in _mappings.items():
            if entry.handle == raw:
                raise FailedPrecondition(
                    _CUDA_PREFIX + f"the IPC handle is the arena of session {other}, mapped in "
                    "this process; a handle of another session is refused")
        uuids = runtime.device_uuids()
        if uuid not in uuids:
            seen = ", ".join(format_cuda_uuid(u) for u in uuids)
            raise FailedPrecondition(
                _CUDA_PREFIX + f"arena.cuda_device_uuid {handle.cuda_device_uuid} (the sidecar's "
                f"device {handle.cuda_device}) is not among the devices this process sees "
                f"({seen}); the worker must run on the sidecar's GPU (check "
                "CUDA_VISIBLE_DEVICES)")
        device = uuids.index(uuid)
        base = runtime.open(device, raw)
        mapping = _Mapping(runtime, raw, handle.generation, device, base)
        _mappings[session_id] = mapping
        return mapping


def _release(session_id: str, generation: int) -> None:
    with _mappings_lock:
        mapping = _mappings.get(session_id)
        if mapping is None or mapping.generation != generation:
            return
        mapping.references -= 1
        if mapping.references > 0:
            return
        del _mappings[session_id]
    mapping.runtime.close(mapping.device, mapping.base)


def _torch_dtype(torch: Any, dtype: int) -> Any:
    types: Dict[int, Any] = {
        common_pb2.DTYPE_FLOAT16: torch.float16, common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
        common_pb2.DTYPE_FLOAT32: torch.float32}
    return types[dtype]


class _ByteView:
    """A ``__cuda_array_interface__`` (v3) of a range of device bytes."""

    def __init__(self, base: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (base, False), "strides": None,
            "version": 3,
            # None: no stream synchronisation is needed to read it (the sidecar's rule (b)).
            "stream": None,
        }


class CudaArena(_Geometry):
    """The mapped CUDA arena of one session (``KIND_CUDA_IPC``), with its block geometry.

    Attributes:
        base: the device pointer (int) of the mapping in this process.
        device: this process's ordinal of the arena's GPU (found by UUID).
        num_blocks, num_kv_heads, block_tokens, head_dim, dtype, block_bytes, size_bytes,
        generation: the geometry.

    Views over the device memory stay valid until the session detaches (:meth:`close`); using
    them after that is undefined, as in the C++ client.
    """

    def __init__(self, handle: "common_pb2.ArenaHandle", layout: "common_pb2.ModelLayout",
                 session_id: str, *, runtime: Any = None) -> None:
        if handle.kind != common_pb2.ArenaHandle.KIND_CUDA_IPC:
            raise InvalidArgument(f"CudaArena maps KIND_CUDA_IPC arenas, got kind {handle.kind}")
        self._np_dtype = _set_geometry(self, handle, layout)
        self.session_id = session_id
        runtime = runtime if runtime is not None else _runtime()
        self._mapping: Optional[_Mapping] = _acquire(runtime, session_id, handle)
        self.base: int = self._mapping.base
        self.device: int = self._mapping.device
        self._runtime = runtime
        self._tensor: Any = None

    # -- zero-copy device views --

    def _check_open(self) -> _Mapping:
        if self._mapping is None:
            raise FailedPrecondition("the CUDA arena is closed (the session detached)")
        return self._mapping

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """The whole mapping as a 1-D uint8 device array (CuPy, Numba, torch.as_tensor)."""
        self._check_open()
        return _ByteView(self.base, self.size_bytes).__cuda_array_interface__

    @property
    def blocks(self) -> Any:
        """torch tensor ``[num_blocks][2][H][B][D]`` over the device memory (float16, bfloat16
        or float32): writes go straight into the sidecar's arena. Needs torch with CUDA."""
        self._check_open()
        if self._tensor is None:
            try:
                import torch  # noqa: PLC0415 (optional dependency)
            except ImportError:
                raise FailedPrecondition(
                    "torch tensors over a CUDA arena need torch with CUDA, which is not "
                    "installed; use __cuda_array_interface__ (CuPy) or the copy helpers "
                    "(read_blocks / write_rows)") from None
            if not torch.cuda.is_available():
                raise FailedPrecondition(
                    "torch tensors over a CUDA arena need torch with CUDA; this torch has none")
            raw = torch.as_tensor(_ByteView(self.base, self.num_blocks * self.block_bytes),
                                  device=f"cuda:{self.device}")
            self._tensor = raw.view(_torch_dtype(torch, self.dtype)).view(
                self.num_blocks, 2, self.num_kv_heads, self.block_tokens, self.head_dim)
        return self._tensor

    @property
    def staging(self) -> Any:
        """torch float32 tensor over the query staging area (device memory; empty without one):
        a model writes a step's queries ``[layers][Hq][w][D]`` there with its own kernels, then
        names the byte offset in :func:`kvsidecar.client.staged_attention`. Needs torch with CUDA;
        :meth:`write_staging` copies from the host without it."""
        self._check_open()
        import torch  # noqa: PLC0415 (optional dependency; blocks says why it is needed)
        raw = torch.as_tensor(_ByteView(self.base + self.staging_offset, self.staging_bytes),
                              device=f"cuda:{self.device}")
        return raw.view(torch.float32)

    def write_staging(self, offset: int, values: np.ndarray) -> None:
        """Copies float32 ``values`` to byte ``offset`` of the staging area with one cudaMemcpy."""
        mapping = self._check_open()
        values = np.ascontiguousarray(values, dtype=np.float32)
        if offset < 0 or offset % 4 or offset + values.nbytes > self.staging_bytes:
            raise OutOfRange(f"{values.nbytes} bytes at offset {offset} leave the staging area of "
                             f"{self.staging_bytes} bytes")
        self._runtime.memcpy(mapping.device, self.base + self.staging_offset + offset,
                             values.ctypes.data, values.nbytes, _MEMCPY_HOST_TO_DEVICE)

    def block(self, block: int) -> Any:
        """Zero-copy torch view ``[2][H][B][D]`` of one block (see :attr:`blocks`)."""
        if not 0 <= block < self.num_blocks:
            raise OutOfRange(f"block {block} outside the arena's {self.num_blocks} blocks")
        return self.blocks[block]

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype of the elements in host copies (bf16 -> uint16)."""
        return self._np_dtype

    # -- synchronous copies (cudaMemcpy; no torch needed) --

    def _row_offset(self, block: int, kv: int, head: int, in_block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise OutOfRange(f"block {block} outside the arena's {self.num_blocks} blocks")
        if kv not in (0, 1):
            raise OutOfRange(f"kv must be 0 or 1, got {kv}")
        if not 0 <= head < self.num_kv_heads:
            raise OutOfRange(f"head must be in [0, {self.num_kv_heads}), got {head}")
        if not 0 <= in_block < self.block_tokens:
            raise OutOfRange(f"in-block slot must be in [0, {self.block_tokens}), got {in_block}")
        row = self.head_dim * self._np_dtype.itemsize
        return block * self.block_bytes + ((kv * self.num_kv_heads + head) * self.block_tokens +
                                           in_block) * row

    def write_rows(self, block: int, kv: int, head: int, in_block: int,
                   rows: np.ndarray) -> None:
        """Copies ``rows [n][D]`` (storage dtype) into slots ``in_block .. in_block + n - 1`` of
        (block, kv, head) with one cudaMemcpy."""
        mapping = self._check_open()
        rows = np.ascontiguousarray(rows, dtype=self._np_dtype)
        n = rows.shape[0]
        if rows.ndim != 2 or rows.shape[1] != self.head_dim or n == 0:
            raise InvalidArgument(f"rows must be [n][{self.head_dim}], got {rows.shape}")
        offset = self._row_offset(block, kv, head, in_block)
        self._row_offset(block, kv, head, in_block + n - 1)  # the last row is inside too
        self._runtime.memcpy(mapping.device, self.base + offset, rows.ctypes.data, rows.nbytes,
                             _MEMCPY_HOST_TO_DEVICE)

    def read_blocks(self, table: Union[List[int], np.ndarray]) -> np.ndarray:
        """Host copy ``[len(table)][2][H][B][D]`` (storage dtype) of the listed blocks."""
        mapping = self._check_open()
        table = np.asarray(table, dtype=np.int64).reshape(-1)
        if table.size and (table.min() < 0 or table.max() >= self.num_blocks):
            raise OutOfRange(f"block table outside the arena's {self.num_blocks} blocks")
        out = np.empty((table.size, 2, self.num_kv_heads, self.block_tokens, self.head_dim),
                       dtype=self._np_dtype)
        for i, block in enumerate(table.tolist()):
            self._runtime.memcpy(mapping.device, out[i].ctypes.data,
                                 self.base + block * self.block_bytes, self.block_bytes,
                                 _MEMCPY_DEVICE_TO_HOST)
        return out

    def close(self) -> bool:
        """Closes the mapping (cudaIpcCloseMemHandle once the last user of this session's mapping
        in this process closes it). Torch views of it must not be used afterwards."""
        if self._mapping is None:
            return True
        self._tensor = None
        self._mapping = None
        _release(self.session_id, self.generation)
        return True


def open_arena(handle: "common_pb2.ArenaHandle", layout: "common_pb2.ModelLayout",
               session_id: str) -> Union[Arena, CudaArena]:
    """The arena of a session: :class:`Arena` (shared memory) or :class:`CudaArena`."""
    if handle.kind == common_pb2.ArenaHandle.KIND_CUDA_IPC:
        return CudaArena(handle, layout, session_id)
    return Arena(handle, layout, session_id)


def fetch_arena_fd(socket_path: str, session_id: str, nonce: str, timeout: float = 10.0) -> int:
    """Fetches a ``KIND_MEMFD`` arena's descriptor from the sidecar's arena socket
    (``arena.fd_socket_path``) with the Attach response's single-use ``arena.fd_nonce``: sends
    ``FETCH <session_id> <nonce>``, receives ``OK <size>`` with the descriptor as SCM_RIGHTS, or
    ``ERROR <reason>``. Returns the descriptor (the caller closes it). ``Unavailable`` when the
    socket cannot be reached, ``PermissionDenied`` with the sidecar's reason when it refuses,
    ``Internal`` for a malformed answer."""
    if not socket_path or not nonce:
        raise Internal("arena.fd_socket_path or arena.fd_nonce is empty")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: List[int] = []
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
            sock.sendall(f"FETCH {session_id} {nonce}\n".encode())
            reply = b""
            while b"\n" not in reply and len(reply) < 4096:
                # The descriptor travels with the first bytes of the reply.
                data, received, _, _ = socket.recv_fds(sock, 512, 1)
                fds.extend(received)
                if not data:
                    break
                reply += data
        except OSError as error:
            raise Unavailable(f"arena socket {socket_path}: {error}") from error
    finally:
        sock.close()
    line = reply.split(b"\n", 1)[0].decode("utf-8", "replace")
    if line.startswith("OK ") and b"\n" in reply and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if line.startswith("ERROR "):
        raise PermissionDenied(f"arena socket {socket_path} refused: {line[6:]}")
    raise Internal(f"arena socket {socket_path}: malformed answer {line!r}")
