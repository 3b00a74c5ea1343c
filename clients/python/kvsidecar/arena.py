"""Dtype helpers and the zero-copy view of a session's arena.

Block layout (proto/kvsidecar/v1/common.proto, gpu/base/layout.h): one block holds one layer of
one sequence for every kv head, ``[2][H][B][D]`` elements of the session dtype, keys (index 0) then
values (index 1). Slot ``s`` of a layer sits in block ``block_table[s // B]`` at in-block index
``s % B``. The byte offset of element (kv, head, in_block, d) of block b is::

    b * block_bytes + (((kv * H + head) * B + in_block) * D + d) * dtype_bytes

On the CPU backend the arena is a shared-memory file the client maps once (``mmap``, MAP_SHARED);
:attr:`Arena.blocks` is a numpy array ``[num_blocks][2][H][B][D]`` over that mapping, so writing
into it writes the sidecar's memory and reading it reads the sidecar's memory, with no copy and no
RPC. bfloat16 has no numpy dtype: it is exposed as ``uint16`` bit patterns, converted with
:func:`bf16_to_float32` / :func:`float32_to_bf16`.

A CUDA arena (``KIND_CUDA_IPC``, the CUDA backend, not built yet) would be opened with
``cudaIpcOpenMemHandle`` through torch / CuPy / DLPack; this client raises ``NotImplementedError``
for it.

Threading: an Arena is a plain mapping; concurrent writes to distinct slots are fine, and the
sidecar only changes memory during calls that the caller makes (commit, compress, decode_step).
"""

from __future__ import annotations

import mmap
import os
from typing import Optional

import numpy as np

from kvsidecar.errors import InvalidArgument, OutOfRange
from kvsidecar.v1 import common_pb2

__all__ = [
    "DType", "dtype_bytes", "storage_dtype", "bf16_to_float32", "float32_to_bf16", "to_storage",
    "to_float32", "Arena",
]

DType = common_pb2.DType

_STORAGE = {
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


class Arena:
    """The mapped arena of one session (CPU backend), with its block geometry.

    Attributes:
        blocks: ``[num_blocks][2][H][B][D]`` numpy array of the storage dtype over the shared
            memory: writes go straight into the sidecar's memory.
        num_blocks, num_kv_heads, block_tokens, head_dim, dtype: the geometry.
    """

    def __init__(self, handle: "common_pb2.ArenaHandle", layout: "common_pb2.ModelLayout") -> None:
        kind = handle.kind
        if kind == common_pb2.ArenaHandle.KIND_CUDA_IPC:
            raise NotImplementedError(
                "CUDA IPC arenas (the CUDA backend) are not supported by this client yet: they "
                "need cudaIpcOpenMemHandle through torch/CuPy/DLPack; only the CPU backend's "
                "shared-memory arena can be mapped")
        if kind != common_pb2.ArenaHandle.KIND_SHARED_MEMORY_FILE:
            raise InvalidArgument(f"arena.kind {kind} cannot be mapped")
        self.dtype: int = layout.dtype
        self.num_kv_heads: int = layout.num_kv_heads
        self.block_tokens: int = layout.block_tokens
        self.head_dim: int = layout.head_dim
        self.num_blocks: int = handle.num_blocks
        self.block_bytes: int = handle.block_bytes
        self.size_bytes: int = handle.size_bytes
        self.path: str = handle.shm_path
        self.generation: int = handle.generation
        np_dtype = storage_dtype(self.dtype)
        expected = 2 * self.num_kv_heads * self.block_tokens * self.head_dim * np_dtype.itemsize
        if expected != self.block_bytes:
            raise InvalidArgument(
                f"arena.block_bytes {self.block_bytes} != 2*H*B*D*dtype_bytes = {expected}")
        if self.num_blocks * self.block_bytes > self.size_bytes:
            raise InvalidArgument(
                f"arena.size_bytes {self.size_bytes} < num_blocks*block_bytes "
                f"{self.num_blocks * self.block_bytes}")
        if not self.path:
            raise InvalidArgument("arena.shm_path is empty")
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size < self.size_bytes:
                raise InvalidArgument(
                    f"arena {self.path} is smaller than arena.size_bytes {self.size_bytes}")
            self._mmap: Optional[mmap.mmap] = mmap.mmap(
                fd, self.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.blocks: np.ndarray = np.ndarray(
            (self.num_blocks, 2, self.num_kv_heads, self.block_tokens, self.head_dim),
            dtype=np_dtype, buffer=self._mmap, offset=0)

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype of the elements (bf16 -> uint16)."""
        return self.blocks.dtype

    def block(self, block: int) -> np.ndarray:
        """Zero-copy view ``[2][H][B][D]`` of one block."""
        if not 0 <= block < self.num_blocks:
            raise OutOfRange(f"block {block} outside the arena's {self.num_blocks} blocks")
        return self.blocks[block]

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
