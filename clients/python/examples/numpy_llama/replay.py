"""Record a prefill once, replay it into many caches.

A prompt's K/V and queries do not depend on the cache policy as long as nothing is evicted before
the prompt ends ("full" prefill mode), so the quality harness runs the model over the prompt once
with RecordingCache and replays the recorded blocks (the same Reserve/write/Commit calls, with the
same queries) into one sidecar sequence per policy and budget: the expensive forward pass is not
repeated per configuration. Replay then finish_prefill() gives exactly the sidecar state a real
"full"-mode prefill would have left.

Not thread-safe.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .gguf_weights import LlamaConfig
from .llama import LocalKVCache


class RecordingCache(LocalKVCache):
    """A full local cache that also keeps, per block, the positions, K/V and queries per layer."""

    def __init__(self, config: LlamaConfig, capacity: int = 256) -> None:
        super().__init__(config, capacity)
        self.blocks: List[Tuple[np.ndarray, List[Optional[Tuple[np.ndarray, ...]]]]] = []

    def begin_block(self, positions: np.ndarray) -> None:
        super().begin_block(positions)
        self.blocks.append((np.asarray(positions, np.int32), [None] * self._cfg.n_layers))

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, q: np.ndarray) -> None:
        super().append(layer, k, v, q)
        self.blocks[-1][1][layer] = (k.copy(), v.copy(), q.copy())


def replay(blocks: Sequence[Tuple[np.ndarray, Sequence[Any]]], cache: Any) -> None:
    """Feeds recorded prefill blocks into `cache` through the cache protocol (no model
    forward), announcing the prompt length first, as Llama.generate does."""
    begin = getattr(cache, "begin_prefill", None)
    if begin is not None:
        begin(sum(len(p) for p, _ in blocks))
    for positions, layers in blocks:
        cache.begin_block(positions)
        for li, (k, v, q) in enumerate(layers):
            cache.append(li, k, v, q)
        cache.end_block()
