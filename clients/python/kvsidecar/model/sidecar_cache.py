"""A KV cache for kvsidecar.model.llama.Llama whose K/V live in the sidecar.

Per block of new tokens (a prefill block or one decode token):
  begin_block   Reserve(num_tokens, positions) in every layer, and GetLayout once: the committed
                tokens' block tables and per-head positions (they change when the sidecar evicts).
  append        writes the layer's post-RoPE K/V straight into the reserved arena slots (zero
                copy) and keeps the layer's queries for the policy.
  get           the layer's committed K/V, gathered from the mapped arena by block table, plus the
                block's own K/V (rounded through the session dtype, exactly as stored).
  end_block     prefill: Commit with the block's queries (attention-based policies need them) and
                compress_if_over_budget; decode: DecodeStep with the reservation and the query, so
                the sidecar updates the policy state and evicts back to the budget.

Prefill modes: "blockwise" compresses at every block commit (the cache never holds much more than
budget + one block: the memory saving holds during prefill too); "full" lets the whole prompt in
and compresses once, at the Commit of the last prefill block (with that block's queries as the
observation window), SnapKV-style. The model tells the cache the prompt length with
begin_prefill(n) (Llama.generate does) and that decoding starts with finish_prefill().

Not thread-safe: one cache per sequence, used by one thread.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from kvsidecar.arena import dtype_bytes, to_float32, to_storage
from kvsidecar.client import DecodeItem, Session, attention, budget as make_budget, model_layout
from kvsidecar.client import policy as make_policy
from kvsidecar.v1 import common_pb2

from .gguf_weights import LlamaConfig

# Policies whose score uses no queries: nothing is sent.
KEY_ONLY_POLICIES = {"streaming_llm", "keydiff"}
# Policies that accumulate every query they are sent (sending the last block again at the final
# compress would count it twice).
ACCUMULATING_POLICIES = {"h2o", "d2o"}
POLICIES = ["streaming_llm", "keydiff", "h2o", "tova", "snapkv", "cake", "d2o", "caote"]


def layout_for(cfg: LlamaConfig, dtype: str = "fp32", block_tokens: int = 16):
    """The sidecar ModelLayout of a model: L, H (kv heads), Hq, D from its GGUF metadata."""
    return model_layout(num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads,
                        num_q_heads=cfg.n_heads, head_dim=cfg.head_dim, dtype=dtype,
                        block_tokens=block_tokens)


def blocks_needed(cfg: LlamaConfig, max_tokens: int, block_tokens: int = 16) -> int:
    """Arena blocks for one sequence of up to max_tokens tokens held in full (plus slack)."""
    return cfg.n_layers * (math.ceil(max_tokens / block_tokens) + 2)


def policy_spec(name: str, budget_tokens: int = 0, **params) -> common_pb2.PolicySpec:
    """A PolicySpec by name. H2O (and CAOTE over it) get what the H2O paper uses unless params
    say otherwise: 4 sink tokens and half the budget as the recent window (the sidecar's own
    default is none, and accumulated attention alone starves the newest tokens, which have
    been attended to by few queries: the model then loses the sentence it is in)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; one of {POLICIES}")
    if name in ("h2o", "caote") and budget_tokens > 0:
        params.setdefault("n_sink", 4)
        params.setdefault("n_recent", budget_tokens // 2)
    return make_policy(name, **params)


class SidecarKVCache:
    """K/V of one sequence kept in the sidecar (see the module comment for the protocol)."""

    def __init__(self, session: Session, cfg: LlamaConfig, policy: common_pb2.PolicySpec,
                 budget_tokens: int = 0, prefill_mode: str = "blockwise",
                 sequence_id: str = ""):
        if prefill_mode not in ("blockwise", "full"):
            raise ValueError(f"prefill_mode must be 'blockwise' or 'full', got {prefill_mode!r}")
        lay = session.layout
        if (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (
                cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"session layout L={lay.num_layers} H={lay.num_kv_heads} "
                             f"D={lay.head_dim} does not match the model")
        self.session = session
        self.cfg = cfg
        self.policy = policy
        self.budget_tokens = budget_tokens
        self.prefill_mode = prefill_mode
        self.dtype = lay.dtype
        resp = session.create_sequence(
            policy=policy, budget=make_budget(budget_tokens) if budget_tokens > 0 else None,
            sequence_id=sequence_id)
        self.sequence_id = resp.sequence_id
        self._send_queries = policy.name not in KEY_ONLY_POLICIES
        self._decoding = False
        self._prefill_tokens = 0  # prompt length announced by begin_prefill (0 = unknown)
        self._res = None
        self._layout = None
        self._block_pos: Optional[np.ndarray] = None
        self._pending_k: List[Optional[np.ndarray]] = [None] * cfg.n_layers
        self._pending_v: List[Optional[np.ndarray]] = [None] * cfg.n_layers
        self._queries: List[Optional[np.ndarray]] = [None] * cfg.n_layers
        self._last_attention = None
        self.tokens_seen = 0  # tokens ever appended (what a full cache would hold)
        self.counts: List[int] = [0] * cfg.n_layers  # tokens held per layer now
        self.peak_tokens = 0  # max over time of sum(counts) right after a block commits
        self.evicted_total = 0

    # -- the cache protocol used by Llama.forward --------------------------------------------

    def begin_block(self, positions: np.ndarray) -> None:
        positions = np.asarray(positions, np.int32)
        self._block_pos = positions
        self._res = self.session.reserve(self.sequence_id, len(positions),
                                         positions=[int(p) for p in positions])
        self._layout = self.session.get_layout(self.sequence_id)
        self._layer_entries = {e.layer: e for e in self._layout.layers}

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, q: np.ndarray) -> None:
        kh = np.ascontiguousarray(k.transpose(1, 0, 2))  # (H, T, D)
        vh = np.ascontiguousarray(v.transpose(1, 0, 2))
        stored_k = to_storage(kh, self.dtype)
        stored_v = to_storage(vh, self.dtype)
        for first, kview, vview in self._res.views(layer):
            n = kview.shape[1]
            kview[...] = stored_k[:, first:first + n]
            vview[...] = stored_v[:, first:first + n]
        # What the sidecar holds, as float32: the block attends to the same values later steps see.
        self._pending_k[layer] = to_float32(stored_k, self.dtype)
        self._pending_v[layer] = to_float32(stored_v, self.dtype)
        if self._send_queries:
            self._queries[layer] = q.transpose(1, 0, 2)  # (Hq, T, D)

    def get(self, layer: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        entry = self._layer_entries.get(layer)
        h, d = self.cfg.n_kv_heads, self.cfg.head_dim
        t = len(self._block_pos)
        new_pos = np.broadcast_to(self._block_pos, (h, t))
        if entry is None or entry.count == 0:
            return self._pending_k[layer], self._pending_v[layer], new_pos
        # Gather the layer's blocks out of the mapped arena by block table (one fancy-index copy
        # in the storage dtype), then convert them straight into float32 buffers that have room
        # for this block's tokens: two passes over the data, no concatenation.
        arena = self.session.arena
        bt = arena.block_tokens
        n = entry.count
        nb = -(-n // bt)
        table = np.asarray(entry.block_table[:nb], dtype=np.int64)
        if len(table) < nb or table.min() < 0 or table.max() >= arena.num_blocks:
            raise ValueError(f"layer {layer}: bad block table for {n} tokens")
        blocks = arena.blocks[table]  # (nb, 2, H, B, D)
        size = max(nb * bt, n + t)
        k = np.empty((h, size, d), np.float32)
        v = np.empty((h, size, d), np.float32)
        np.copyto(k[:, : nb * bt].reshape(h, nb, bt, d), blocks[:, 0].transpose(1, 0, 2, 3),
                  casting="unsafe")
        np.copyto(v[:, : nb * bt].reshape(h, nb, bt, d), blocks[:, 1].transpose(1, 0, 2, 3),
                  casting="unsafe")
        if self.dtype == common_pb2.DTYPE_BFLOAT16:  # uint16 bit patterns: convert properly
            k[:, :n] = to_float32(blocks[:, 0].transpose(1, 0, 2, 3).reshape(h, -1, d)[:, :n],
                                  self.dtype)
            v[:, :n] = to_float32(blocks[:, 1].transpose(1, 0, 2, 3).reshape(h, -1, d)[:, :n],
                                  self.dtype)
        k[:, n: n + t] = self._pending_k[layer]
        v[:, n: n + t] = self._pending_v[layer]
        pos = np.empty((h, n + t), np.int32)
        pos[:, :n] = np.asarray(entry.positions, dtype=np.int32).reshape(h, n)
        pos[:, n:] = new_pos
        return k[:, : n + t], v[:, : n + t], pos

    def end_block(self) -> None:
        t = len(self._block_pos)
        attn = None
        if self._send_queries:
            q = np.stack(self._queries)  # (L, Hq, T, D)
            attn = attention(q.astype(np.float32), query_positions=self._block_pos.tolist())
        if self._decoding and t == 1:
            resp = self.session.decode_step(
                [DecodeItem(self.sequence_id, attention=attn, reservation=self._res)])
            item = resp.items[0]
            counts = list(item.counts)
        else:
            compress = self.budget_tokens > 0 and (
                self.prefill_mode == "blockwise" or self._decoding
                or (self._prefill_tokens > 0 and self.tokens_seen + t >= self._prefill_tokens))
            resp = self.session.commit(self._res, compress_if_over_budget=compress,
                                       attention=attn)
            counts = list(resp.counts)
            self.evicted_total += resp.evicted
        self._last_attention = attn
        self.tokens_seen += t
        self._set_counts(counts)
        self._res = None
        self._pending_k = [None] * self.cfg.n_layers
        self._pending_v = [None] * self.cfg.n_layers
        self._queries = [None] * self.cfg.n_layers

    # -- phases and accounting ---------------------------------------------------------------

    def _set_counts(self, counts: List[int]) -> None:
        if len(counts) == self.cfg.n_layers:
            self.counts = counts
        self.peak_tokens = max(self.peak_tokens, sum(self.counts))

    def begin_prefill(self, num_tokens: int) -> None:
        """Announces the prompt length: in "full" mode the block that completes it compresses."""
        self._prefill_tokens = self.tokens_seen + num_tokens

    def finish_prefill(self) -> None:
        """Ends the prefill; later one-token blocks are decode steps (DecodeStep). In "full" mode
        without begin_prefill, compresses now (with the last block's queries, except for
        policies that already accumulated them)."""
        if (self.prefill_mode == "full" and self.budget_tokens > 0
                and self._prefill_tokens == 0):
            attn = None
            if self._send_queries and self.policy.name not in ACCUMULATING_POLICIES:
                attn = self._last_attention
            self.session.compress(self.sequence_id, attention=attn)
            layout = self.session.get_layout(self.sequence_id, omit_positions=True)
            self._set_counts([e.count for e in sorted(layout.layers, key=lambda e: e.layer)])
        self._decoding = True

    def kv_bytes(self) -> int:
        """Bytes of K and V the sidecar holds for this sequence now (all layers)."""
        per_token = 2 * self.cfg.n_kv_heads * self.cfg.head_dim * dtype_bytes(self.dtype)
        return sum(self.counts) * per_token

    def full_kv_bytes(self) -> int:
        """Bytes a full cache of every token seen would hold, in the same dtype."""
        per_token = 2 * self.cfg.n_kv_heads * self.cfg.head_dim * dtype_bytes(self.dtype)
        return self.tokens_seen * self.cfg.n_layers * per_token

    def release(self) -> None:
        self.session.release_sequence(self.sequence_id)
