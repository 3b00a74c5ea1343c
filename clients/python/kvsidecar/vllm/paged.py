"""vLLM's CPU paged KV cache and the sidecar's arena blocks, side by side.

On vLLM's CPU backend (``CPUAttentionBackend``, the ``vec`` / ``vec16`` kernels) each attention
layer's cache is one tensor ``[num_blocks, kv_heads, B, 2 * head_dim]``; within a block and a head
its ``2 * B * head_dim`` elements are the block's keys *transposed*, ``[head_dim][B]``, then its
values ``[B][head_dim]`` (what ``cpu_attn_reshape_and_cache`` writes). A sidecar arena block is
``[2][kv_heads][B][head_dim]`` (K then V). With the session's block size equal to vLLM's, one
vLLM block is one arena block, and the copies here move whole blocks between the two with torch
(on a CPU arena: straight into and out of the sidecar's shared memory).

:func:`check_layout` runs vLLM's own kernel on a scratch block to confirm this layout for the
dtype, block and head size in use; the connector serves nothing when it does not hold.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np
import torch

# torch dtype of a vLLM cache -> the sidecar's dtype name (kvsidecar.model_layout).
SIDECAR_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def arena_tensor(blocks: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The mapped arena ``[num_blocks][2][H][B][D]`` as a torch tensor over the same memory
    (bf16 is stored as uint16 and viewed back)."""
    tensor = torch.from_numpy(blocks)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


def _flat(cache: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    num_blocks, heads, block_tokens, two_d = cache.shape
    return cache.view(num_blocks, heads, block_tokens * two_d), heads, block_tokens, two_d // 2


def read_blocks(cache: torch.Tensor, block_ids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n][H][B][D]`` of vLLM blocks ``block_ids`` (copies)."""
    flat, heads, b, d = _flat(cache)
    rows = flat[torch.as_tensor(list(block_ids), dtype=torch.long)]
    k = rows[:, :, :b * d].reshape(-1, heads, d, b).transpose(-1, -2)
    v = rows[:, :, b * d:].reshape(-1, heads, b, d)
    return k, v


def write_blocks(cache: torch.Tensor, block_ids: Sequence[int], k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """Writes K and V ``[n][H][B][D]`` into vLLM blocks ``block_ids``."""
    flat, heads, b, d = _flat(cache)
    ids = torch.as_tensor(list(block_ids), dtype=torch.long)
    n = len(ids)
    flat[ids, :, :b * d] = k.transpose(-1, -2).reshape(n, heads, b * d).to(cache.dtype)
    flat[ids, :, b * d:] = v.reshape(n, heads, b * d).to(cache.dtype)


def write_tokens(cache: torch.Tensor, block_ids: Sequence[int], k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """Writes ``T`` tokens' K and V ``[H][T][D]`` into slots ``0..T-1`` of the blocks
    ``block_ids`` (as many as ``T`` needs); the last block's slots past ``T`` are zeroed, for
    vLLM to fill with the tokens it computes next."""
    _, heads, b, d = _flat(cache)
    t = k.shape[1]
    n = -(-t // b)
    if n > len(block_ids):
        raise ValueError(f"{t} tokens need {n} blocks of {b}, got {len(block_ids)}")
    pad = n * b - t
    kk = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(heads, n, b, d).transpose(0, 1)
    vv = torch.nn.functional.pad(v, (0, 0, 0, pad)).reshape(heads, n, b, d).transpose(0, 1)
    write_blocks(cache, list(block_ids)[:n], kk, vv)


def check_layout(dtype: torch.dtype, block_tokens: int, heads: int, head_dim: int) -> str:
    """Empty when vLLM's CPU kernel writes the layout this module reads for these parameters,
    else why not (a vLLM build whose CPU cache is laid out otherwise)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as e:  # pragma: no cover - a vLLM without the CPU backend
        return f"vLLM's CPU attention backend is not importable: {e}"
    isa: Any = _get_attn_isa(dtype, block_tokens, head_dim)
    cache = torch.zeros(2, heads, block_tokens, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(2, heads, 2 * block_tokens, head_dim).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(block_tokens, heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(block_tokens, heads, head_dim, generator=gen).to(dtype)
    slots = torch.arange(block_tokens, 2 * block_tokens, dtype=torch.long)
    try:
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    except Exception as e:  # noqa: BLE001 - any kernel failure means: do not serve
        return f"vLLM's cpu_attn_reshape_and_cache failed on a probe block: {e}"
    got_k, got_v = read_blocks(cache, [1])
    if not (torch.equal(got_k[0], k.transpose(0, 1)) and torch.equal(got_v[0], v.transpose(0, 1))):
        return (f"vLLM's CPU cache layout (isa {isa}, {dtype}, block {block_tokens}, head size "
                f"{head_dim}) is not [blocks][heads][K^T (D x B), V (B x D)]")
    if cache[0].abs().sum().item() != 0:
        return "vLLM's CPU kernel wrote outside the probed block"
    return ""
