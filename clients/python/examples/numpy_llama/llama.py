"""A numpy Llama forward pass (RMSNorm, RoPE, GQA attention, SwiGLU, tied embeddings) whose
attention reads K/V through a small cache interface, so the same model runs with its cache in its
own process (LocalKVCache) or in the sidecar (numpy_llama.sidecar_cache.SidecarKVCache).

Cache protocol (one block of new tokens at a time, layers in order):
    cache.begin_block(positions)          # int32 (T,), absolute positions of the new tokens
    for each layer:
        cache.append(layer, k, v, q)      # post-RoPE K/V (T, Hkv, D) and queries (T, Hq, D)
        K, V, pos = cache.get(layer)      # everything the layer may attend to, new block included:
                                          # K/V (Hkv, S, D) float32, pos (Hkv, S) int32; a key is
                                          # masked for a query at a lower position (causal)
    cache.end_block()                     # after the last layer (a sidecar cache commits here)
Per-head positions let an evicting cache keep different tokens in each KV head.

Everything is float32 numpy; one Llama object may be used from one thread at a time.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .gguf_weights import LlamaConfig, LlamaWeights


class LocalKVCache:
    """The full cache in this process: every token of every layer, growable arrays."""

    def __init__(self, config: LlamaConfig, capacity: int = 256):
        self._cfg = config
        h, d = config.n_kv_heads, config.head_dim
        self._k = [np.empty((h, capacity, d), np.float32) for _ in range(config.n_layers)]
        self._v = [np.empty((h, capacity, d), np.float32) for _ in range(config.n_layers)]
        self._pos = np.empty(capacity, np.int32)
        self._len = 0  # committed tokens
        self._block: np.ndarray = np.zeros(0, np.int32)  # the positions of the open block

    def __len__(self) -> int:
        return self._len

    def kv_bytes(self) -> int:
        """Bytes of K and V held (float32), all layers."""
        c = self._cfg
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self._len * 4

    def _grow(self, need: int) -> None:
        cap = self._pos.shape[0]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for arrs in (self._k, self._v):
            for i, a in enumerate(arrs):
                b = np.empty((a.shape[0], new_cap, a.shape[2]), np.float32)
                b[:, : self._len] = a[:, : self._len]
                arrs[i] = b
        p = np.empty(new_cap, np.int32)
        p[: self._len] = self._pos[: self._len]
        self._pos = p

    def begin_block(self, positions: np.ndarray) -> None:
        positions = np.asarray(positions, np.int32)
        self._grow(self._len + len(positions))
        self._pos[self._len : self._len + len(positions)] = positions
        self._block = positions

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, q: np.ndarray) -> None:
        t = k.shape[0]
        self._k[layer][:, self._len : self._len + t] = k.transpose(1, 0, 2)
        self._v[layer][:, self._len : self._len + t] = v.transpose(1, 0, 2)

    def get(self, layer: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self._len + len(self._block)
        pos = np.broadcast_to(self._pos[:n], (self._cfg.n_kv_heads, n))
        return self._k[layer][:, :n], self._v[layer][:, :n], pos

    def end_block(self) -> None:
        self._len += len(self._block)
        self._block = np.zeros(0, np.int32)

    def get_committed(self, layer: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """K, V (Hkv, n, D) and positions (Hkv, n) of the committed tokens (outside a block)."""
        n = self._len
        pos = np.broadcast_to(self._pos[:n], (self._cfg.n_kv_heads, n))
        return self._k[layer][:, :n], self._v[layer][:, :n], pos


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    out: np.ndarray = (x / np.sqrt(var + eps)) * w
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = x / (1.0 + np.exp(-x))
    return out


class Llama:
    def __init__(self, weights: LlamaWeights):
        self.w = weights
        self.cfg = weights.config
        c = self.cfg
        half = c.head_dim // 2
        # theta_i = base^(-2i/d) for the i-th adjacent pair (GGUF "normal" rope, see gguf_weights).
        self._inv_freq = (c.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / c.head_dim))
        self._scale = np.float32(1.0 / np.sqrt(c.head_dim))

    # -- pieces -------------------------------------------------------------------------------

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotates adjacent pairs of x (T, H, D) by position * theta_i."""
        ang = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]  # (T, D/2)
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def _attention(
        self, q: np.ndarray, qpos: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray
    ) -> np.ndarray:
        """q (T, Hq, D); k, v (Hkv, S, D); kpos (Hkv, S). Returns (T, Hq*D)."""
        c = self.cfg
        t = q.shape[0]
        g = c.group_size
        # Query head h uses KV head h // g (heads of a group are consecutive).
        qh = q.transpose(1, 0, 2).reshape(c.n_kv_heads, g * t, c.head_dim)
        scores = np.matmul(qh, k.transpose(0, 2, 1)) * self._scale  # (Hkv, g*T, S)
        scores = scores.reshape(c.n_kv_heads, g, t, -1)
        masked = kpos[:, None, None, :] > qpos[None, None, :, None]  # (Hkv, 1, T, S)
        if masked.any():
            scores = np.where(masked, np.float32(-np.inf), scores)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores.reshape(c.n_kv_heads, g * t, -1), v)  # (Hkv, g*T, D)
        rows: np.ndarray = out.reshape(c.n_heads, t, c.head_dim).transpose(1, 0, 2).reshape(t, -1)
        return rows

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], positions: Sequence[int], cache: Any, all_logits: bool = False
    ) -> np.ndarray:
        """Runs one block of new tokens through the model, adding their K/V to `cache`.

        Returns float32 logits: (T, vocab) if all_logits, else (vocab,) for the last token.
        """
        c = self.cfg
        ids = np.asarray(tokens, np.int64)
        pos = np.asarray(positions, np.int32)
        t = len(ids)
        if t == 0 or len(pos) != t:
            raise ValueError("forward needs at least one token and one position per token")
        hq, hk, d = c.n_heads, c.n_kv_heads, c.head_dim
        x = self.w.tok_embd[ids]  # (T, d_model)
        cache.begin_block(pos)
        for li, lw in enumerate(self.w.layers):
            h = _rms_norm(x, lw.attn_norm, c.rms_eps)
            qkv = h @ lw.wqkv
            q = self._rope(qkv[:, : hq * d].reshape(t, hq, d), pos)
            k = self._rope(qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d), pos)
            v = qkv[:, (hq + hk) * d :].reshape(t, hk, d)
            cache.append(li, k, v, q)
            kk, vv, kpos = cache.get(li)
            x = x + self._attention(q, pos, kk, vv, kpos) @ lw.wo
            h = _rms_norm(x, lw.ffn_norm, c.rms_eps)
            gu = h @ lw.wgate_up
            x = x + (_silu(gu[:, : c.d_ff]) * gu[:, c.d_ff :]) @ lw.wdown
        cache.end_block()
        if not all_logits:
            x = x[-1:]
        logits = _rms_norm(x, self.w.output_norm, c.rms_eps) @ self.w.output
        result: np.ndarray = logits if all_logits else logits[0]
        return result

    def forward_batch(self, tokens: Sequence[Any], positions: Sequence[Any],
                      caches: Sequence[Any]) -> np.ndarray:
        """One block of new tokens for each of several sequences at once: tokens[i] (an int, or a
        list of ints) at positions[i] into caches[i] (one cache per sequence). The dense parts
        (projections, MLP, logits) run as one matrix product over every row of the batch,
        attention per sequence over its own cache. A cache class with static
        begin_blocks(caches, positions) / end_blocks(caches) gets the batch's blocks together
        (SidecarKVCache: one BatchReserve / BatchCommit / DecodeStep for the whole batch); other
        caches begin_block / end_block one by one.

        Returns float32 logits (B, vocab) of each sequence's last new token."""
        c = self.cfg
        toks = [np.atleast_1d(np.asarray(t, np.int64)) for t in tokens]
        poss = [np.atleast_1d(np.asarray(p, np.int32)) for p in positions]
        b = len(toks)
        if b == 0 or len(poss) != b or len(caches) != b or any(
                len(t) == 0 or len(t) != len(p) for t, p in zip(toks, poss)):
            raise ValueError("forward_batch needs one cache and a block of >= 1 tokens with one "
                             "position each per sequence")
        bounds = np.cumsum([0] + [len(t) for t in toks])
        rows = int(bounds[-1])
        pos = np.concatenate(poss)
        hq, hk, d = c.n_heads, c.n_kv_heads, c.head_dim
        x = self.w.tok_embd[np.concatenate(toks)]  # (rows, d_model)
        kind = type(caches[0])
        batched = all(type(cc) is kind for cc in caches)
        if batched and hasattr(kind, "begin_blocks"):
            kind.begin_blocks(caches, poss)
        else:
            for cache, p in zip(caches, poss):
                cache.begin_block(p)
        att = np.empty((rows, hq * d), np.float32)
        for li, lw in enumerate(self.w.layers):
            h = _rms_norm(x, lw.attn_norm, c.rms_eps)
            qkv = h @ lw.wqkv
            q = self._rope(qkv[:, : hq * d].reshape(rows, hq, d), pos)
            k = self._rope(qkv[:, hq * d : (hq + hk) * d].reshape(rows, hk, d), pos)
            v = qkv[:, (hq + hk) * d :].reshape(rows, hk, d)
            for i, cache in enumerate(caches):
                r0, r1 = bounds[i], bounds[i + 1]
                cache.append(li, k[r0:r1], v[r0:r1], q[r0:r1])
                kk, vv, kpos = cache.get(li)
                att[r0:r1] = self._attention(q[r0:r1], pos[r0:r1], kk, vv, kpos)
            x = x + att @ lw.wo
            h = _rms_norm(x, lw.ffn_norm, c.rms_eps)
            gu = h @ lw.wgate_up
            x = x + (_silu(gu[:, : c.d_ff]) * gu[:, c.d_ff :]) @ lw.wdown
        if batched and hasattr(kind, "end_blocks"):
            kind.end_blocks(caches)
        else:
            for cache in caches:
                cache.end_block()
        last = x[bounds[1:] - 1]
        result: np.ndarray = _rms_norm(last, self.w.output_norm, c.rms_eps) @ self.w.output
        return result

    def prefill_batch(self, prompts: Sequence[Sequence[int]], caches: Sequence[Any],
                      block_size: int = 64) -> np.ndarray:
        """prefill(align_last=True) of several prompts in lockstep: step j runs the j-th block of
        every prompt that has one through one forward_batch (prompts are split as prefill splits
        them: full blocks, the first one taking the remainder). Returns (B, vocab) logits of each
        prompt's last token."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        splits = []
        for p in prompts:
            n = len(p)
            if n == 0:
                raise ValueError("prefill_batch needs non-empty prompts")
            first = n % block_size or block_size
            splits.append([0] + list(range(first, n, block_size)) + [n])
        out = np.empty((len(prompts), self.cfg.vocab_size), np.float32)
        for j in range(max(len(s) - 1 for s in splits)):
            idx = [i for i, s in enumerate(splits) if j + 1 < len(s)]
            blocks = [(splits[i][j], splits[i][j + 1]) for i in idx]
            logits = self.forward_batch([prompts[i][a:e] for i, (a, e) in zip(idx, blocks)],
                                        [range(a, e) for a, e in blocks],
                                        [caches[i] for i in idx])
            out[idx] = logits
        return out

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        caches: Sequence[Any],
        max_new_tokens: int,
        block_size: int = 64,
        stop_ids: Sequence[int] = (),
    ) -> List["Generation"]:
        """generate() for several prompts: the prompts are prefilled in lockstep (prefill_batch),
        then every sequence that has not stopped decodes in the same forward_batch step,
        greedily. Returns one Generation per prompt; decode_s is the batch's
        decode time (shared)."""
        if len(prompts) != len(caches):
            raise ValueError("generate_batch needs one cache per prompt")
        t0 = time.perf_counter()
        for prompt, cache in zip(prompts, caches):
            begin = getattr(cache, "begin_prefill", None)
            if begin is not None:
                begin(len(prompt))
        logits = list(self.prefill_batch(prompts, caches, block_size))
        for cache in caches:
            finish = getattr(cache, "finish_prefill", None)
            if finish is not None:
                finish()
        t1 = time.perf_counter()
        n = len(prompts)
        out: List[List[int]] = [[] for _ in range(n)]
        step_logits: List[List[np.ndarray]] = [[] for _ in range(n)]
        pos = [len(p) for p in prompts]
        active = list(range(n))
        for step in range(max_new_tokens):
            feed = []
            for i in active:
                tok = int(np.argmax(logits[i]))
                step_logits[i].append(logits[i])
                if tok in stop_ids:
                    continue
                out[i].append(tok)
                if step + 1 < max_new_tokens:
                    feed.append((i, tok))
            active = [i for i, _ in feed]
            if not active:
                break
            new = self.forward_batch([t for _, t in feed], [pos[i] for i in active],
                                     [caches[i] for i in active])
            for row, i in enumerate(active):
                logits[i] = new[row]
                pos[i] += 1
        t2 = time.perf_counter()
        gens = []
        for i in range(n):
            g = Generation(out[i], step_logits[i], t1 - t0, t2 - t1, len(prompts[i]))
            gens.append(g)
        return gens

    def prefill(
        self, tokens: Sequence[int], cache: Any, block_size: int = 64, start: int = 0,
        all_logits: bool = False, align_last: bool = False,
    ) -> np.ndarray:
        """Feeds `tokens` in blocks of block_size starting at position `start`.

        align_last: make the LAST block the full one (the first takes the remainder), so a policy
        that reads the prompt's last queries (an observation window) gets a whole block of them.
        Returns the last token's logits, or (T, vocab) logits for all tokens if all_logits.
        """
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        n = len(tokens)
        first = (n % block_size) if align_last and n % block_size else block_size
        bounds = [0] + list(range(first, n, block_size)) + [n]
        outs = []
        last = np.zeros(0, np.float32)
        for b, e in zip(bounds[:-1], bounds[1:]):
            if e <= b:
                continue
            last = self.forward(tokens[b:e], range(start + b, start + e), cache, all_logits)
            if all_logits:
                outs.append(last)
        return np.concatenate(outs, axis=0) if all_logits else last

    def generate(
        self,
        prompt: Sequence[int],
        cache: Any,
        max_new_tokens: int,
        block_size: int = 64,
        stop_ids: Sequence[int] = (),
        on_token: Optional[Callable[[int, np.ndarray], None]] = None,
        forced: Optional[Sequence[int]] = None,
    ) -> "Generation":
        """Block prefill of `prompt`, then greedy decode of up to max_new_tokens tokens.

        forced: if given, these tokens are fed instead of the argmax (teacher forcing; the logits
        are still recorded), which lets two caches be compared on the same continuation.
        on_token(token, logits) is called for every decoded token.
        """
        t0 = time.perf_counter()
        begin = getattr(cache, "begin_prefill", None)
        if begin is not None:  # e.g. the sidecar cache compresses at the prompt's last block
            begin(len(prompt))
        logits = self.prefill(prompt, cache, block_size, align_last=True)
        finish = getattr(cache, "finish_prefill", None)
        if finish is not None:  # e.g. the sidecar cache compresses the prompt here
            finish()
        t1 = time.perf_counter()
        gen = self.decode(cache, logits, len(prompt), max_new_tokens, stop_ids, on_token, forced)
        gen.prefill_s = t1 - t0
        gen.prompt_len = len(prompt)
        return gen

    def decode(
        self,
        cache: Any,
        logits: np.ndarray,
        pos: int,
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        on_token: Optional[Callable[[int, np.ndarray], None]] = None,
        forced: Optional[Sequence[int]] = None,
    ) -> "Generation":
        """Greedy decode after a prefill: `logits` are the last prompt token's, `pos` the
        position of the first new token. See generate for forced and on_token."""
        t1 = time.perf_counter()
        out: List[int] = []
        step_logits: List[np.ndarray] = []
        n = max_new_tokens if forced is None else min(max_new_tokens, len(forced))
        for i in range(n):
            tok = int(np.argmax(logits)) if forced is None else int(forced[i])
            step_logits.append(logits)
            if on_token is not None:
                on_token(tok, logits)
            if forced is None and tok in stop_ids:
                break
            out.append(tok)
            if i + 1 == n:
                break
            logits = self.forward([tok], [pos], cache)
            pos += 1
        t2 = time.perf_counter()
        return Generation(out, step_logits, 0.0, t2 - t1, 0)


class Generation:
    """Result of Llama.generate: tokens, the logits each token was chosen from, timings."""

    def __init__(self, tokens: List[int], logits: List[np.ndarray], prefill_s: float,
                 decode_s: float, prompt_len: int) -> None:
        self.tokens: List[int] = tokens
        self.logits: List[np.ndarray] = logits
        self.prefill_s = prefill_s
        self.decode_s = decode_s
        self.prompt_len = prompt_len

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from the prefill's logits; each later one needed a decode step.
        steps = max(len(self.logits) - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_len / self.prefill_s if self.prefill_s > 0 else float("nan")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return out


def perplexity(model: Llama, tokens: Sequence[int], block_size: int = 128) -> float:
    """exp(mean NLL) of tokens[1:] given their prefixes, full local cache."""
    cache = LocalKVCache(model.cfg, capacity=len(tokens))
    logits = model.prefill(tokens[:-1], cache, block_size, all_logits=True)
    lp = log_softmax(logits)
    nll = -lp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
    return float(np.exp(nll.mean()))
