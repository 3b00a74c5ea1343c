"""A KV cache for numpy_llama.llama.Llama whose K/V live in the sidecar.

The sidecar holds the sequence (its memory, budget, policy state and compaction); the worker keeps
a float32 MIRROR of what the sidecar holds, per layer in the sidecar's slot order ([H][count][D]
K and V plus the [H][count] position table), and attends over the mirror. The mirror is kept
exact by replaying what the sidecar reports instead of re-reading the arena every step:

  prefill block   begin_block: Reserve(T tokens) in every layer. append: writes the layer's
                  post-RoPE K/V straight into the reserved arena slots (zero copy), and the same
                  values, rounded through the session dtype exactly as stored, into the mirror.
                  end_block: Commit with the block's queries (attention-based policies need them)
                  and compress_if_over_budget.
  decode step     ONE RPC: DecodeStep with the token's K/V inline ([L][2][H][1][D], session dtype)
                  and its query; the sidecar appends it at slot `count`, folds the query into the
                  policy state and evicts each layer back to its budget. Its answer (new counts and
                  the position each (layer, head) evicted) replays the sidecar's hole-filling
                  compaction (cache/compaction.h) on the mirror: evicting slot e of a head holding
                  count+1 tokens moves the token of the last slot into e (nothing moves if e was
                  the last slot). With overlap (the default) end_block only sends the step; its
                  answer is applied when the cache is next used (sync(), begin_block, counts, ...),
                  so the sidecar runs the step while the model computes its logits. SnapKV and
                  TOVA send no query on a step that cannot evict (their step scores would be
                  dropped unused).
  resync          whenever the answer does not say exactly what happened (a Commit or Compress
                  that evicted, more than one token evicted per head, a D2O merge that rewrote
                  kept rows), the affected layers are marked dirty and read back from the mapped
                  arena by block table (one GetLayout) at the next begin_block.

verify_mirror() re-reads every layer from the arena and checks the mirror against it bit for bit
(the tests do it after every decode step).

Prefill modes: "blockwise" compresses at every block commit (the cache never holds much more than
budget + one block: the memory saving holds during prefill too); "full" lets the whole prompt in
and compresses once, at the Commit of the last prefill block (with that block's queries as the
observation window), SnapKV-style. The model tells the cache the prompt length with
begin_prefill(n) (Llama.generate does) and that decoding starts with finish_prefill().

Batches: Llama.forward_batch runs a block of several sequences (one SidecarKVCache each, same
session) in one step through the static begin_blocks / end_blocks: ONE BatchReserve and ONE
BatchCommit per prefill block step, ONE DecodeStep per decode step for the whole batch.

Memory: the mirror holds what the sidecar keeps (budget-sized under a budget) in float32, in the
worker's process; a worker that can attend over the arena blocks in place (a GPU kernel over the
block table) needs no mirror.

Not thread-safe: one cache per sequence, used by one thread (a batch of caches: that thread).
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import numpy as np

from kvsidecar.arena import dtype_bytes, storage_dtype, to_float32, to_storage
from kvsidecar.client import (DecodeItem, Reservation, ReserveItem, Session, attention,
                              budget as make_budget, model_layout)
from kvsidecar.client import policy as make_policy
from kvsidecar.errors import InvalidArgument
from kvsidecar.v1 import common_pb2, sidecar_pb2

from .gguf_weights import LlamaConfig

# Policies whose score uses no queries: nothing is sent.
KEY_ONLY_POLICIES = {"streaming_llm", "keydiff"}
# Policies whose decode-step query only scores that step's eviction (the scores are dropped after
# the step): a step that cannot evict needs no query (the sidecar would compute attention over
# every key for nothing). Only with the default (uniform) allocator: the D2O allocator accumulates.
STEP_SCORED_POLICIES = {"snapkv", "tova"}
# Policies that accumulate every query they are sent (sending the last block again at the final
# compress would count it twice).
ACCUMULATING_POLICIES = {"h2o", "d2o"}
POLICIES = ["streaming_llm", "keydiff", "h2o", "tova", "snapkv", "cake", "d2o", "caote"]


def layout_for(cfg: LlamaConfig, dtype: str = "fp32",
               block_tokens: int = 16) -> common_pb2.ModelLayout:
    """The sidecar ModelLayout of a model: L, H (kv heads), Hq, D from its GGUF metadata."""
    return model_layout(num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads,
                        num_q_heads=cfg.n_heads, head_dim=cfg.head_dim, dtype=dtype,
                        block_tokens=block_tokens)


def blocks_needed(cfg: LlamaConfig, max_tokens: int, block_tokens: int = 16) -> int:
    """Arena blocks for one sequence of up to max_tokens tokens held in full (plus slack)."""
    return cfg.n_layers * (math.ceil(max_tokens / block_tokens) + 2)


def policy_spec(name: str, budget_tokens: int = 0, **params: Any) -> common_pb2.PolicySpec:
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
                 sequence_id: str = "", read_through: bool = False, overlap: bool = True):
        """read_through: do not trust the mirror; read every layer back from the arena (one
        GetLayout) at every block, as a worker without a mirror would (slower; tests compare the
        two bit for bit). overlap: end_block sends the DecodeStep and returns without waiting
        for the answer (the model computes its logits meanwhile); the answer is applied at the
        next use of the cache (see sync)."""
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
        self.read_through = read_through
        self.overlap = overlap
        self._inflight: Optional[_InflightStep] = None  # a DecodeStep sent, answer not applied
        self.dtype = lay.dtype
        resp = session.create_sequence(
            policy=policy, budget=make_budget(budget_tokens) if budget_tokens > 0 else None,
            sequence_id=sequence_id)
        self.sequence_id = resp.sequence_id
        self._send_queries = policy.name not in KEY_ONLY_POLICIES
        self._decoding = False
        self._prefill_tokens = 0  # prompt length announced by begin_prefill (0 = unknown)
        self._res: Optional[Reservation] = None
        self._inline = False  # this block is a decode step sent inline (no reservation)
        self._block_pos: np.ndarray = np.zeros(0, np.int32)  # positions of the open block
        self._queries: List[Optional[np.ndarray]] = [None] * cfg.n_layers
        self._last_attention: Optional[common_pb2.AttentionInputs] = None
        # The mirror: K, V [L][H][capacity][D] float32 and positions [L][H][capacity] in the
        # sidecar's slot order; slots [0, n[l]) of layer l hold its committed tokens, the next T
        # slots the block being computed. One array for all layers: a decode step's answer is
        # replayed on every layer with a few whole-array operations.
        h, d = cfg.n_kv_heads, cfg.head_dim
        self._mk = np.empty((cfg.n_layers, h, 64, d), np.float32)
        self._mv = np.empty((cfg.n_layers, h, 64, d), np.float32)
        self._mpos = np.empty((cfg.n_layers, h, 64), np.int32)
        self._n = np.zeros(cfg.n_layers, np.int64)
        self._dirty: Set[int] = set()  # layers to read back from the arena before the next block
        # The decode token's K/V in the session dtype, [L][2][H][1][D]: DecodeStep.inline_kv.
        self._inline_kv = np.empty((cfg.n_layers, 2, h, 1, d), storage_dtype(self.dtype))
        self.resyncs = 0  # layers read back from the arena (statistics for tests and benches)
        self._tokens_seen = 0
        self._counts: List[int] = [0] * cfg.n_layers
        self._peak_tokens = 0
        self._evicted_total = 0

    # -- state (each read applies a DecodeStep answer still in flight first) -------------------

    def sync(self) -> None:
        """Waits for the DecodeStep in flight (overlap) and applies its answer; raises its
        error, if it failed."""
        if self._inflight is not None:
            self._inflight.settle()

    @property
    def tokens_seen(self) -> int:
        """Tokens ever appended (what a full cache would hold)."""
        self.sync()
        return self._tokens_seen

    @property
    def counts(self) -> List[int]:
        """Tokens held per layer now."""
        self.sync()
        return self._counts

    @property
    def peak_tokens(self) -> int:
        """Max over time of sum(counts) right after a block commits."""
        self.sync()
        return self._peak_tokens

    @property
    def evicted_total(self) -> int:
        """Tokens evicted per layer, summed over the blocks (Commit: max over layers; decode
        steps: every layer's)."""
        self.sync()
        return self._evicted_total

    # -- the cache protocol used by Llama.forward --------------------------------------------

    def begin_block(self, positions: np.ndarray) -> None:
        self.begin_blocks([self], [positions])

    @staticmethod
    def begin_blocks(caches: Sequence["SidecarKVCache"], positions: Sequence[np.ndarray]) -> None:
        """begin_block of several caches at once (Llama.forward_batch): the blocks that need a
        reservation (prefill blocks) get it in ONE BatchReserve per session; decode steps go
        inline and reserve nothing."""
        for cache in caches:
            cache.sync()
        by_session: Dict[int, List[SidecarKVCache]] = {}
        for cache, pos in zip(caches, positions):
            pos = np.asarray(pos, np.int32)
            cache._block_pos = pos
            cache._inline = cache._decoding and len(pos) == 1
            if not cache._inline:
                by_session.setdefault(id(cache.session), []).append(cache)
        for group in by_session.values():
            session = group[0].session
            items = [ReserveItem(c.sequence_id, len(c._block_pos),
                                 positions=[int(p) for p in c._block_pos]) for c in group]
            if len(group) == 1:
                reservations = [session.reserve(items[0].sequence_id, items[0].num_tokens,
                                                positions=items[0].positions)]
            else:
                reservations = session.batch_reserve(items)
            for cache, res in zip(group, reservations):
                cache._res = res
        for cache in caches:
            cache._begin_mirror()

    def _begin_mirror(self) -> None:
        positions = self._block_pos
        t = len(positions)
        if self._res is not None and self._res.response.evicted_before > 0:
            self._dirty.update(range(self.cfg.n_layers))  # a strict budget evicted first
        if self.read_through and self._tokens_seen > 0:
            self._dirty.update(range(self.cfg.n_layers))
        if self._dirty:
            self._resync(sorted(self._dirty))
        self._reserve_mirror(int(self._n.max()) + t)
        if t == 1:
            self._mpos[np.arange(self.cfg.n_layers), :, self._n] = positions[0]
        else:
            for layer, n in enumerate(self._n):
                self._mpos[layer, :, n:n + t] = positions

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, q: np.ndarray) -> None:
        kh = k.transpose(1, 0, 2)  # (H, T, D)
        vh = v.transpose(1, 0, 2)
        n, t = int(self._n[layer]), kh.shape[1]
        if self._send_queries:
            self._queries[layer] = q.transpose(1, 0, 2)  # (Hq, T, D)
        if self._inline and self.dtype != common_pb2.DTYPE_BFLOAT16:
            # Decode fast path: numpy's float casts round exactly as to_storage / to_float32 do.
            buf = self._inline_kv[layer]  # (2, H, 1, D), session dtype
            buf[0] = kh
            buf[1] = vh
            self._mk[layer, :, n:n + 1] = buf[0]
            self._mv[layer, :, n:n + 1] = buf[1]
            return
        stored_k = to_storage(kh, self.dtype)
        stored_v = to_storage(vh, self.dtype)
        if self._inline:
            self._inline_kv[layer, 0] = stored_k
            self._inline_kv[layer, 1] = stored_v
        else:
            assert self._res is not None  # begin_blocks reserved this block
            for first, kview, vview in self._res.views(layer):
                run = kview.shape[1]
                kview[...] = stored_k[:, first:first + run]
                vview[...] = stored_v[:, first:first + run]
        # What the sidecar holds, as float32: the block attends to the same values later steps see.
        self._mk[layer, :, n:n + t] = to_float32(stored_k, self.dtype)
        self._mv[layer, :, n:n + t] = to_float32(stored_v, self.dtype)

    def get(self, layer: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = int(self._n[layer]) + len(self._block_pos)
        return self._mk[layer, :, :m], self._mv[layer, :, :m], self._mpos[layer, :, :m]

    def _attention(self) -> Optional[common_pb2.AttentionInputs]:
        if not self._send_queries:
            return None
        q = np.stack(cast(List[np.ndarray], self._queries))  # (L, Hq, T, D), all layers set
        return attention(q.astype(np.float32, copy=False),
                         query_positions=self._block_pos.tolist())

    def _step_may_evict(self) -> bool:
        """False when this decode step cannot evict: no budget, or every layer stays within it
        (the default allocator gives every layer budget_tokens)."""
        if self.budget_tokens <= 0:
            return False
        if self.policy.HasField("allocator"):
            return True
        return int(self._n.max()) + 1 > self.budget_tokens

    def _decode_item(self, force_query: bool = False) -> DecodeItem:
        skip = (not force_query and self.policy.name in STEP_SCORED_POLICIES
                and not self.policy.HasField("allocator") and not self._step_may_evict())
        return DecodeItem(self.sequence_id, attention=None if skip else self._attention(),
                          inline_kv=self._inline_kv.tobytes())

    @staticmethod
    def _decode_step(session: Session, caches: Sequence["SidecarKVCache"]) -> None:
        """Sends one DecodeStep for `caches` (all of `session`); its answer is replayed on their
        mirrors now, or, with overlap, at the next use of any of them."""
        step = _InflightStep(session, caches)
        if all(cache.overlap for cache in caches):
            for cache in caches:
                cache._inflight = step
        else:
            step.settle()

    def end_block(self) -> None:
        self.end_blocks([self])

    def _commit_args(self) -> Tuple[bool, Optional[common_pb2.AttentionInputs]]:
        """(compress_if_over_budget, attention) of this block's Commit."""
        t = len(self._block_pos)
        compress = self.budget_tokens > 0 and (
            self.prefill_mode == "blockwise" or self._decoding
            or (self._prefill_tokens > 0 and self._tokens_seen + t >= self._prefill_tokens))
        return compress, self._attention()

    def _finish_commit(self, resp: sidecar_pb2.CommitResponse,
                       attn: Optional[common_pb2.AttentionInputs]) -> None:
        t = len(self._block_pos)
        counts = list(resp.counts)
        self._evicted_total += resp.evicted
        for layer, count in enumerate(counts):
            if count != self._n[layer] + t:  # compressed: the arena says what it kept
                self._dirty.add(layer)
            self._n[layer] = count
        self._finish_block(counts, attn)

    @staticmethod
    def end_blocks(caches: Sequence["SidecarKVCache"]) -> None:
        """end_block of several caches at once (Llama.forward_batch): their decode steps go to the
        sidecar as ONE DecodeStep per session, their prefill blocks as ONE BatchCommit."""
        steps: Dict[int, List[SidecarKVCache]] = {}
        commits: Dict[int, List[SidecarKVCache]] = {}
        for cache in caches:
            pending = steps if cache._inline else commits
            pending.setdefault(id(cache.session), []).append(cache)
        for group in commits.values():
            session = group[0].session
            args = [cache._commit_args() for cache in group]
            if len(group) == 1:
                # A block that is not a decode step was reserved by begin_blocks.
                responses: Sequence[sidecar_pb2.CommitResponse] = [session.commit(
                    cast(Reservation, group[0]._res), compress_if_over_budget=args[0][0],
                    attention=args[0][1])]
            else:
                request = sidecar_pb2.BatchCommitRequest(requests=[
                    session._commit_request(cast(Reservation, cache._res), compress, attn)
                    for cache, (compress, attn) in zip(group, args)])
                responses = session._call(session.stub.BatchCommit, request).responses
            for cache, (_, attn), resp in zip(group, args, responses):
                cache._finish_commit(resp, attn)
        for group in steps.values():
            SidecarKVCache._decode_step(group[0].session, group)

    def _finish_decode(self, out: sidecar_pb2.DecodeStepResponse.Item,
                       attn: Optional[common_pb2.AttentionInputs]) -> None:
        """Replays one DecodeStep answer on the mirror (see the module comment)."""
        pos = int(self._block_pos[0])
        if out.position != pos:
            raise RuntimeError(f"sequence {self.sequence_id}: the sidecar appended the decode "
                               f"token at position {out.position}, the model computed {pos}")
        counts = list(out.counts)
        n_layers, h = self.cfg.n_layers, self.cfg.n_kv_heads
        if len(counts) != n_layers or len(out.evicted_positions) != n_layers * h:
            raise RuntimeError(f"sequence {self.sequence_id}: DecodeStep answered "
                               f"{len(counts)} counts for {n_layers} layers")
        used = self._n + 1  # slots in use with the new token, which sits in slot used - 1
        new = np.asarray(counts, np.int64)
        gone = used - new  # tokens each head of a layer evicted
        self._n = new
        self._evicted_total += int(gone.sum())
        # Exactly one token per head, nothing merged: the last slot moved into the evicted one.
        # Anything else (several holes, a D2O merge that rewrote kept rows) is read back.
        one = (gone == 1) if out.merged == 0 else np.zeros(n_layers, bool)
        self._dirty.update(np.flatnonzero((gone != 0) & ~one).tolist())
        layers = np.flatnonzero(one)
        if layers.size:
            width = int(used[layers].max())
            evicted = np.asarray(out.evicted_positions, np.int32).reshape(n_layers, h)[layers]
            live = np.arange(width)[None, None, :] < used[layers][:, None, None]
            hit = (self._mpos[layers, :, :width] == evicted[:, :, None]) & live  # (L', H, S)
            found = hit.any(axis=2).all(axis=1)
            self._dirty.update(layers[~found].tolist())  # a position the mirror does not hold
            slot = hit.argmax(axis=2)  # (L', H): the evicted slot of each head
            last = np.broadcast_to((used[layers] - 1)[:, None], slot.shape)
            li, hi = np.nonzero((slot != last) & found[:, None])
            if li.size:
                ls, dst, src = layers[li], slot[li, hi], last[li, hi]
                self._mk[ls, hi, dst] = self._mk[ls, hi, src]
                self._mv[ls, hi, dst] = self._mv[ls, hi, src]
                self._mpos[ls, hi, dst] = self._mpos[ls, hi, src]
        self._finish_block(counts, attn)

    def _finish_block(self, counts: List[int],
                      attn: Optional[common_pb2.AttentionInputs]) -> None:
        self._last_attention = attn
        self._tokens_seen += len(self._block_pos)
        self._set_counts(counts)
        self._res = None
        self._inline = False
        self._queries = [None] * self.cfg.n_layers

    # -- the mirror ----------------------------------------------------------------------------

    def _reserve_mirror(self, need: int) -> None:
        """Room for `need` slots in every layer (grows by doubling, keeping what is held)."""
        cap = self._mk.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        keep = int(self._n.max())
        l, h, d = self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim
        k = np.empty((l, h, new_cap, d), np.float32)
        v = np.empty((l, h, new_cap, d), np.float32)
        pos = np.empty((l, h, new_cap), np.int32)
        k[:, :, :keep] = self._mk[:, :, :keep]
        v[:, :, :keep] = self._mv[:, :, :keep]
        pos[:, :, :keep] = self._mpos[:, :, :keep]
        self._mk, self._mv, self._mpos = k, v, pos

    def _read_arena(self, entry: common_pb2.LayerLayout
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """K, V [H][count][D] float32 and positions [H][count] of one GetLayout entry, gathered
        from the mapped arena by block table."""
        arena = self.session.arena
        h, d, bt = self.cfg.n_kv_heads, self.cfg.head_dim, arena.block_tokens
        n = entry.count
        nb = -(-n // bt)
        table = np.asarray(entry.block_table[:nb], dtype=np.int64)
        if len(table) < nb or (nb and (table.min() < 0 or table.max() >= arena.num_blocks)):
            raise ValueError(f"layer {entry.layer}: bad block table for {n} tokens")
        blocks = arena.blocks[table]  # (nb, 2, H, B, D), one fancy-index copy
        kv = blocks.transpose(1, 2, 0, 3, 4).reshape(2, h, nb * bt, d)[:, :, :n]
        pos = np.asarray(entry.positions, dtype=np.int32).reshape(h, n)
        return to_float32(kv[0], self.dtype), to_float32(kv[1], self.dtype), pos

    def _resync(self, layers: List[int]) -> None:
        layout = self.session.get_layout(self.sequence_id, layers=layers)
        for entry in layout.layers:
            layer, n = entry.layer, entry.count
            k, v, pos = self._read_arena(entry)
            self._reserve_mirror(n + 1)
            self._mk[layer, :, :n] = k
            self._mv[layer, :, :n] = v
            self._mpos[layer, :, :n] = pos
            self._n[layer] = n
            self.resyncs += 1
        self._dirty.difference_update(layers)

    def verify_mirror(self) -> None:
        """Reads every layer back from the arena and raises AssertionError unless the mirror
        (outside a block, dirty layers excepted) holds exactly the same counts, positions and
        K/V, slot by slot."""
        self.sync()
        layout = self.session.get_layout(self.sequence_id)
        for entry in layout.layers:
            layer = entry.layer
            if layer in self._dirty:
                continue
            n = int(self._n[layer])
            if entry.count != n:
                raise AssertionError(f"layer {layer}: mirror holds {n} tokens, sidecar "
                                     f"{entry.count}")
            k, v, pos = self._read_arena(entry)
            if not np.array_equal(pos, self._mpos[layer, :, :n]):
                raise AssertionError(f"layer {layer}: positions differ from the sidecar's")
            if not (np.array_equal(k, self._mk[layer, :, :n])
                    and np.array_equal(v, self._mv[layer, :, :n])):
                raise AssertionError(f"layer {layer}: K/V differ from the sidecar's")

    # -- phases and accounting ---------------------------------------------------------------

    def _set_counts(self, counts: List[int]) -> None:
        if len(counts) == self.cfg.n_layers:
            self._counts = counts
        self._peak_tokens = max(self._peak_tokens, sum(self._counts))

    def begin_prefill(self, num_tokens: int) -> None:
        """Announces the prompt length: in "full" mode the block that completes it compresses."""
        self.sync()
        self._prefill_tokens = self._tokens_seen + num_tokens
        if self.budget_tokens <= 0 or self.prefill_mode == "full":
            # The whole prompt will be held at once: size the mirror now, plus room for decoding,
            # rather than doubling it (a copy of everything) in the middle of the run.
            self._reserve_mirror(int(self._n.max()) + num_tokens + 64)

    def finish_prefill(self) -> None:
        """Ends the prefill; later one-token blocks are decode steps (DecodeStep). In "full" mode
        without begin_prefill, compresses now (with the last block's queries, except for
        policies that already accumulated them)."""
        self.sync()
        if (self.prefill_mode == "full" and self.budget_tokens > 0
                and self._prefill_tokens == 0):
            attn = None
            if self._send_queries and self.policy.name not in ACCUMULATING_POLICIES:
                attn = self._last_attention
            self.session.compress(self.sequence_id, attention=attn)
            layout = self.session.get_layout(self.sequence_id, omit_positions=True)
            self._set_counts([e.count for e in sorted(layout.layers, key=lambda e: e.layer)])
            for layer, count in enumerate(self._counts):  # the mirror reads the survivors back
                if count != self._n[layer]:
                    self._dirty.add(layer)
                    self._n[layer] = count
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
        try:
            self.sync()
        finally:
            self.session.release_sequence(self.sequence_id)


class _InflightStep:
    """One DecodeStep sent for a group of caches of one session, until its answer is applied
    (settle: by the first of them to be used again). A step sent without a query that the
    sidecar must evict anyway (an Admin re-budget lowered the budget) is refused as a whole,
    changing nothing: it is sent again, synchronously, with every query."""

    def __init__(self, session: Session, caches: Sequence[SidecarKVCache]) -> None:
        self.session = session
        self.caches = list(caches)
        self.items = [cache._decode_item() for cache in self.caches]
        self.future = session.decode_step_future(self.items)
        self.sent = time.perf_counter()
        self.wall_s: Optional[float] = None  # send -> answer available to settle (statistics)

    def settle(self) -> None:
        caches, self.caches = self.caches, []
        if not caches:
            return
        for cache in caches:
            cache._inflight = None
        try:
            resp = self.future.result()
        except InvalidArgument:
            if all(item.attention is not None or not cache._send_queries
                   for cache, item in zip(caches, self.items)):
                raise
            self.items = [cache._decode_item(force_query=True) for cache in caches]
            resp = self.session.decode_step(self.items)
        self.wall_s = time.perf_counter() - self.sent
        for cache, item, out in zip(caches, self.items, resp.items):
            cache._finish_decode(out, item.attention)
