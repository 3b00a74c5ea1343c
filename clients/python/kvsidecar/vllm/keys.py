"""Content keys of the prefixes the vLLM connector stores: a hash chain over blocks of token ids.

Like vLLM's own prefix-cache hashes, block ``i``'s hash covers every token before the end of block
``i``: ``h_0`` is the hash of what makes KV reusable at all (the model, its KV layout, the
connector's format version), and ``h_i = sha256(h_{i-1}, token ids of block i)``. Two prompts
share ``h_i`` exactly when they share their first ``i`` blocks of tokens under the same model. A
whole (uncompressed) prefix is stored block by block, block ``i`` under ``h_i``; a compressed
prefix of ``n`` tokens is one copy under a key that adds the policy, its budget and ``n`` to the
chain hash of those tokens. Every key is 64 lowercase hex digits, the shape the sidecar's
``prefix_key`` takes; the tenant is not in the key: the sidecar keeps each tenant's prefixes
apart.
"""

from __future__ import annotations

import hashlib
from typing import List, Sequence

import numpy as np

_VERSION = b"kvsidecar-vllm-v1\0"


def _part(digest: "hashlib._Hash", data: bytes) -> None:
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def root_hash(model_id: str, layout_bytes: bytes) -> bytes:
    """``h_0``: the model (its name or path as vLLM loads it) and the serialized
    ``ModelLayout`` (layers, kv heads, head size, dtype, block size)."""
    digest = hashlib.sha256(_VERSION)
    _part(digest, model_id.encode())
    _part(digest, layout_bytes)
    return digest.digest()


def _tokens(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i8").tobytes()


def block_chain(root: bytes, token_ids: Sequence[int], block_tokens: int,
                num_blocks: int) -> List[bytes]:
    """``[h_1, ..., h_n]`` for the first ``num_blocks`` full blocks of ``token_ids``."""
    if num_blocks * block_tokens > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_tokens} tokens need "
                         f"{num_blocks * block_tokens} token ids, got {len(token_ids)}")
    chain: List[bytes] = []
    previous = root
    for i in range(num_blocks):
        digest = hashlib.sha256(previous)
        _part(digest, _tokens(token_ids[i * block_tokens:(i + 1) * block_tokens]))
        previous = digest.digest()
        chain.append(previous)
    return chain


def hex_key(chain_hash: bytes) -> str:
    """The prefix key of a whole block: its chain hash as 64 hex digits."""
    return chain_hash.hex()


def compressed_key(root: bytes, chain: Sequence[bytes], token_ids: Sequence[int],
                   block_tokens: int, num_tokens: int, method: bytes) -> str:
    """The key of a compressed copy of the first ``num_tokens`` tokens: the chain hash of their
    full blocks, the tokens of their last partial block, ``num_tokens`` and ``method`` (the
    serialized policy, budget and query window)."""
    full = num_tokens // block_tokens
    if full > len(chain) or num_tokens > len(token_ids):
        raise ValueError(f"{num_tokens} tokens exceed the {len(token_ids)} given or the "
                         f"{len(chain)} chained blocks")
    digest = hashlib.sha256(b"compressed\0")
    _part(digest, chain[full - 1] if full else root)
    _part(digest, _tokens(token_ids[full * block_tokens:num_tokens]))
    _part(digest, str(num_tokens).encode())
    _part(digest, method)
    return digest.hexdigest()
