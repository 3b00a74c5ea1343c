"""What a SidecarCache's decode steps attend over: every row's held K/V, per layer, in the
sidecar's slot order, kept exact from each DecodeStep's answer (used by kvsidecar.hf).

Gathering every layer's held K/V out of the arena by block table at every decode step (one
``index_select`` of (row, K or V, head, block) runs per layer) cost more than the attention over
them: a cache holding a quarter of the tokens decoded no faster than the full DynamicCache. The
slot mirror reads each layer out of the arena once (after a prefill block, or when an answer does
not say exactly what changed) and then follows the sidecar's compaction step by step:

  before attention   the decode token's K/V (rounded through the session dtype, as stored) goes
                     into slot ``count`` of every row, where the DecodeStep will append it; the
                     layer attends over a view of slots [0, max count + 1) (no copy).
  the answer         per (row, layer): no token evicted, nothing moves; one token per head evicted
                     and nothing merged: the sidecar's hole filling (cache/compaction.h) moved the
                     token of the last slot into the evicted one, and the mirror does the same (one
                     indexed copy for every row, layer and head of the step). Anything else (a
                     D2O merge rewrote kept rows, several tokens evicted, a position the mirror
                     does not hold) marks the (row, layer) stale: it is read from the arena again
                     before its next attention.

Memory: the mirror holds what the sidecar keeps (budget-sized under a budget) in the attention
dtype on the model's device, as [L][B][H][capacity][D] for K and for V; capacity grows by a
quarter when a row outgrows it. The arena stays the only copy the sidecar serves; the tests check
the mirror against it slot for slot after every step.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

# Slots added beyond what is held when the mirror is (re)allocated: decode steps of a cache
# without a budget grow every layer by one token each.
_HEADROOM = 64


class SlotMirror:
    """K/V [L][B][H][capacity][D] and positions [L][B][H][capacity] in slot order; `count` [L][B]
    slots held and `clean` [L][B] (False: read the (layer, row) from the arena before use)."""

    def __init__(self, num_layers: int, batch: int, heads: int, head_dim: int, dtype: Any,
                 device: Any, mirrored: Sequence[bool]) -> None:
        self.shape = (num_layers, batch, heads, head_dim)
        self.dtype = dtype
        self.device = device
        # Layers whose attention reads the mirror (OmniKV's sparse layers read staging views).
        self.mirrored = np.asarray(mirrored, bool)
        self.count = np.zeros((num_layers, batch), np.int64)
        self.clean = np.zeros((num_layers, batch), bool)
        self.k: Any = None
        self.v: Any = None
        self.pos = np.zeros((num_layers, batch, heads, 0), np.int32)
        self.refills = 0  # (layer, row) pairs read from the arena, for tests and benchmarks

    @property
    def capacity(self) -> int:
        return int(self.pos.shape[3])

    def reserve(self, need: int) -> None:
        """Room for `need` slots in every (layer, row), keeping what is held."""
        cap = self.capacity
        if need <= cap:
            return
        new_cap = max(need + _HEADROOM, cap + cap // 4)
        num_layers, batch, heads, head_dim = self.shape
        # Zeroed: slots past a shorter row's count are masked, but attention multiplies their
        # (zero) probabilities by V, and uninitialised memory may hold NaN.
        k = torch.zeros((num_layers, batch, heads, new_cap, head_dim), dtype=self.dtype,
                        device=self.device)
        v = torch.zeros_like(k)
        pos = np.zeros((num_layers, batch, heads, new_cap), np.int32)
        if cap:
            k[:, :, :, :cap] = self.k
            v[:, :, :, :cap] = self.v
            pos[:, :, :, :cap] = self.pos
        self.k, self.v, self.pos = k, v, pos

    def fill(self, layer: int, row: int, kv: Any, positions: np.ndarray) -> None:
        """The (layer, row) as read from the arena: kv [2][H][n][D], positions [H][n]."""
        n = int(positions.shape[1])
        self.reserve(n + 1)
        self.k[layer, row, :, :n] = kv[0]
        self.v[layer, row, :, :n] = kv[1]
        self.pos[layer, row, :, :n] = positions
        self.count[layer, row] = n
        self.clean[layer, row] = True
        self.refills += 1

    def append(self, layer: int, new_k: Any, new_v: Any, counts: Sequence[int]
               ) -> Tuple[Any, Any]:
        """Writes the decode token of every row ([B][H][1][D]) into slot counts[row] (what the
        rows hold of the layer, as the sidecar answered); returns the K and V views
        [B][H][max count + 1][D] the layer attends over. The token's position is recorded by
        apply(), for every layer at once."""
        width = max(counts)
        if width >= self.capacity:
            self.reserve(width + 1)
        k, v = self.k[layer], self.v[layer]
        if min(counts) == width:
            k[:, :, width] = new_k[:, :, 0]
            v[:, :, width] = new_v[:, :, 0]
        else:
            rows = torch.arange(len(counts), device=self.device)
            slots = torch.as_tensor(counts, device=self.device)
            k[rows, :, slots] = new_k[:, :, 0]
            v[rows, :, slots] = new_v[:, :, 0]
        return k[:, :, :width + 1], v[:, :, :width + 1]

    def apply(self, position: int, counts: np.ndarray, evicted: np.ndarray,
              merged: np.ndarray) -> None:
        """Replays one DecodeStep answer for the token at `position` (appended by append() in
        slot count of every layer): counts [B][L] after the step, evicted [B][L][H] (the position
        each (layer, head) evicted, -1 = none), merged [B] (D2O merges)."""
        new = counts.T  # [L][B]
        used = self.count + 1  # the token appended in slot count
        li, bi = np.nonzero(self.clean & self.mirrored[:, None])
        self.pos[li, bi, :, self.count[li, bi]] = position
        gone = used - new
        live = self.clean & self.mirrored[:, None]
        exact = live & ((gone == 0) | ((gone == 1) & (merged[None, :] == 0)))
        one = exact & (gone == 1)
        if one.any():
            li, bi = np.nonzero(one)
            width = int(used[li, bi].max())
            e = evicted.transpose(1, 0, 2)[li, bi]  # [P][H]
            held = self.pos[li, bi, :, :width]  # [P][H][S]
            hit = (held == e[:, :, None]) & (np.arange(width) < used[li, bi][:, None, None])
            found = hit.any(axis=2).all(axis=1)
            exact[li[~found], bi[~found]] = False
            slot = hit.argmax(axis=2)  # [P][H]
            last = np.broadcast_to((used[li, bi] - 1)[:, None], slot.shape)
            pi, hi = np.nonzero((slot != last) & found[:, None])
            if pi.size:
                lm, bm = li[pi], bi[pi]
                dst, src = slot[pi, hi], last[pi, hi]
                index = [torch.as_tensor(a, device=self.device) for a in (lm, bm, hi)]
                d = torch.as_tensor(dst, device=self.device)
                s = torch.as_tensor(src, device=self.device)
                self.k[index[0], index[1], index[2], d] = self.k[index[0], index[1], index[2], s]
                self.v[index[0], index[1], index[2], d] = self.v[index[0], index[1], index[2], s]
                self.pos[lm, bm, hi, dst] = self.pos[lm, bm, hi, src]
        self.clean &= exact | ~self.mirrored[:, None]
        self.count = np.where(self.clean, new, self.count)

    def invalidate(self, rows: Optional[Sequence[int]] = None) -> None:
        """Marks every layer of `rows` (None: all) stale: a prefill block or Compress changed
        them in ways no answer spells out."""
        if rows is None:
            self.clean[:] = False
        else:
            self.clean[:, list(rows)] = False

    def stale_layers(self, row: int) -> np.ndarray:
        """The mirrored layers of `row` to read from the arena before their next attention."""
        return np.flatnonzero(self.mirrored & ~self.clean[:, row])
