"""The sidecar side of the vLLM connector: one attached session and the prefix calls it makes.

Whole prefixes are stored one vLLM block per published copy (block ``i`` of a prompt under its
chain key ``h_i``, see :mod:`kvsidecar.vllm.keys`), so that any two prompts sharing their first
blocks share those copies. A compressed prefix is one copy: the prompt's first ``P`` tokens
written into a sequence with the configured policy and budget, compressed by the sidecar, then
published. Writes and reads go through the session's mapped arena (on the CPU backend, shared
memory: vLLM's blocks are copied straight into it and out of it); the only bytes on gRPC are the
calls themselves.

Every method raises :class:`kvsidecar.errors.KvsError` (or ValueError for a copy whose shape is
not what this session expects); the connector turns that into "no hit" or "recompute".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import kvsidecar as kvs
from kvsidecar.v1 import common_pb2, sidecar_pb2
from kvsidecar.vllm.paged import arena_tensor

TIERS = {"": common_pb2.TIER_UNSPECIFIED, "host": common_pb2.TIER_HOST,
         "disk": common_pb2.TIER_DISK, "remote": common_pb2.TIER_REMOTE,
         "redis": common_pb2.TIER_REMOTE}

# (layer) -> K, V [n][H][B][D] of the n blocks being saved.
BlockSource = Callable[[int], Tuple[torch.Tensor, torch.Tensor]]
# (layer, i, K [H][B][D], V) for block i of a load.
BlockSink = Callable[[int, int, torch.Tensor, torch.Tensor], None]


@dataclass
class Compressed:
    """A compressed prefix as read back: per layer K, V ``[H][C][D]`` and positions ``[H][C]``."""
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    positions: List[torch.Tensor]


class SidecarStore:
    """A session on the sidecar for one vLLM process (the scheduler's or a worker's)."""

    def __init__(self, address: str, layout: common_pb2.ModelLayout, dtype: torch.dtype, *,
                 token: Optional[str], tenant: str, num_blocks: int, timeout: float,
                 worker_name: str) -> None:
        self.layout = layout
        self.dtype = dtype
        self.client = kvs.Client(address, timeout=timeout, connect_timeout=min(timeout, 1.0),
                                 token=token, worker_name=worker_name)
        try:
            self.session = self.client.attach(layout, tenant=tenant, num_blocks=num_blocks)
        except BaseException:
            self.client.close()
            raise
        arena = self.session.arena
        if not isinstance(arena, kvs.Arena):
            self.close()
            raise ValueError("the sidecar handed out a device arena; this connector maps the "
                             "CPU backend's shared-memory arena (run the sidecar with "
                             "--backend=cpu beside vLLM's CPU backend)")
        self.arena = arena_tensor(arena.blocks, dtype)  # [N][2][H][B][D] over shared memory

    def close(self) -> None:
        try:
            self.session.detach()
        except kvs.KvsError:
            pass
        self.client.close()

    def healthy(self) -> bool:
        return self.session.health is None and not self.session.detached

    def lookup(self, keys: Sequence[str]) -> Dict[int, sidecar_pb2.LookupPrefixesResponse.Found]:
        return self.session.lookup_prefixes(keys) if keys else {}

    def save_blocks(self, keys: Sequence[str], source: BlockSource,
                    tier: common_pb2.Tier.ValueType) -> int:
        """Publishes block ``i`` (K/V from ``source``) under ``keys[i]``; returns the bytes
        stored."""
        session, n = self.session, len(keys)
        ids = [session.create_sequence().sequence_id for _ in keys]
        stored = 0
        try:
            reservations = session.batch_reserve([(seq, self.layout.block_tokens) for seq in ids])
            for layer in range(self.layout.num_layers):
                k, v = source(layer)
                if k.shape[0] != n:
                    raise ValueError(f"layer {layer}: {k.shape[0]} blocks for {n} keys")
                for i, r in enumerate(reservations):
                    block = r.slots(layer).blocks[0]
                    self.arena[block, 0].copy_(k[i])
                    self.arena[block, 1].copy_(v[i])
            session.batch_commit(reservations)
            for seq, key in zip(ids, keys):
                stored += session.publish(seq, key, tier=tier).bytes
        finally:
            for seq in ids:
                session.release_sequence(seq)
        return stored

    def load_blocks(self, keys: Sequence[str], sink: BlockSink) -> None:
        """Hands block ``i`` of every layer, read from the copy under ``keys[i]``, to ``sink``."""
        session, b = self.session, self.layout.block_tokens
        for i, key in enumerate(keys):
            seq = session.create_sequence(from_prefix=key).sequence_id
            try:
                layout = session.get_layout(seq, omit_positions=True)
                if len(layout.layers) != self.layout.num_layers:
                    raise ValueError(f"prefix {key}: {len(layout.layers)} layers, expected "
                                     f"{self.layout.num_layers}")
                for entry in layout.layers:
                    if entry.count != b or len(entry.block_table) < 1:
                        raise ValueError(f"prefix {key} layer {entry.layer}: {entry.count} "
                                         f"tokens, expected one block of {b}")
                    block = entry.block_table[0]
                    sink(entry.layer, i, self.arena[block, 0], self.arena[block, 1])
            finally:
                session.release_sequence(seq)

    def save_compressed(self, key: str, num_tokens: int, source: BlockSource,
                        policy: common_pb2.PolicySpec, budget_tokens: int,
                        tier: common_pb2.Tier.ValueType, query_window: int = 0,
                        attention: Optional[common_pb2.AttentionInputs] = None) -> int:
        """Writes the first ``num_tokens`` tokens (``source(layer)``: K, V of the blocks that
        hold them), compresses them to ``budget_tokens`` per layer with ``policy`` and publishes
        the result under ``key``; returns the bytes stored. ``attention``: the queries a
        query-aware policy scores with (snapkv: its window's), ``query_window`` their count."""
        session = self.session
        seq = session.create_sequence(policy=policy, budget=budget_tokens).sequence_id
        try:
            r = session.reserve(seq, num_tokens)
            for layer in range(self.layout.num_layers):
                k, v = source(layer)
                # [n][H][B][D] -> [H][n*B][D], the first num_tokens of them.
                kk = k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1])[:, :num_tokens]
                vv = v.transpose(0, 1).reshape(v.shape[1], -1, v.shape[-1])[:, :num_tokens]
                for first, kview, vview in r.views(layer):
                    n = kview.shape[1]
                    _as_torch(kview, self.dtype).copy_(kk[:, first:first + n])
                    _as_torch(vview, self.dtype).copy_(vv[:, first:first + n])
            session.commit(r, compress_if_over_budget=True, attention=attention)
            return session.publish(seq, key, query_window=query_window or None, tier=tier).bytes
        finally:
            session.release_sequence(seq)

    def fetch_compressed(self, key: str) -> Compressed:
        """Reads the compressed copy under ``key`` out of the arena (K, V and positions of
        every layer), then releases the sequence."""
        session = self.session
        seq = session.create_sequence(from_prefix=key).sequence_id
        try:
            layout = session.get_layout(seq)
            if len(layout.layers) != self.layout.num_layers:
                raise ValueError(f"prefix {key}: {len(layout.layers)} layers, expected "
                                 f"{self.layout.num_layers}")
            out = Compressed([], [], [])
            for entry in sorted(layout.layers, key=lambda e: e.layer):
                kv = session.read_layer(entry)
                if kv.positions is None:
                    raise ValueError(f"prefix {key} layer {entry.layer}: no positions")
                out.keys.append(_as_torch(kv.k, self.dtype).clone())
                out.values.append(_as_torch(kv.v, self.dtype).clone())
                out.positions.append(torch.from_numpy(kv.positions.astype("int64")))
            return out
        finally:
            session.release_sequence(seq)


def _as_torch(array: Any, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor
