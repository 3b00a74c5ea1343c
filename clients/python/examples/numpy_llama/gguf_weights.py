"""Reads a Llama-architecture GGUF file: the architecture numbers and the weights as float32 numpy.

Everything the forward pass needs comes from the file's metadata (no hard-coded sizes). The
quantized tensors (Q4_1, Q8_0, ...) are dequantized with the `gguf` package's numpy code.

Weight layout note: llama.cpp's converter permutes the rows of attn_q / attn_k inside every head
so that RoPE rotates ADJACENT pairs (x[2i], x[2i+1]) (GGML's "normal" rope), whereas the Hugging
Face checkpoint rotates the two halves (x[i], x[i + d/2]). The forward pass here keeps the GGUF
layout and applies interleaved RoPE, which is mathematically the same model: q.k is invariant
under the same permutation of both. (Keys held in the sidecar are therefore in the GGUF head-dim
order; nothing outside the worker interprets individual head dimensions.)

Not thread-safe to mutate; the loaded arrays are read-only after construction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture numbers, all read from the GGUF metadata."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_base: float
    rope_dim: int
    rms_eps: float
    tied_embeddings: bool

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads


@dataclasses.dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (d_model,)
    wqkv: np.ndarray  # (d_model, (n_heads + 2 n_kv_heads) head_dim), input-major for x @ W
    wo: np.ndarray  # (n_heads head_dim, d_model)
    ffn_norm: np.ndarray  # (d_model,)
    wgate_up: np.ndarray  # (d_model, 2 d_ff): gate columns then up columns
    wdown: np.ndarray  # (d_ff, d_model)


@dataclasses.dataclass
class LlamaWeights:
    config: LlamaConfig
    tok_embd: np.ndarray  # (vocab, d_model)
    output: np.ndarray  # (d_model, vocab), input-major; the embedding transposed when tied
    output_norm: np.ndarray  # (d_model,)
    layers: List[LayerWeights]
    tokens: List[str]  # vocabulary, id order
    token_types: List[int]
    merges: List[str]
    bos_id: int
    eos_id: int
    chat_template: Optional[str]
    tokenizer_pre: str


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return default
    return f.contents()


def _dequant(tensor: Any) -> np.ndarray:
    """Float32 numpy array in the logical (row-major, PyTorch-like) shape of a GGUF tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists ne0 (innermost) first
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype == GGMLQuantizationType.F32:
        arr = np.asarray(tensor.data, dtype=np.float32)
    elif qtype == GGMLQuantizationType.F16:
        arr = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
    else:
        arr = dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    return np.ascontiguousarray(arr.reshape(shape))


_CACHE_FORMAT = 1
_LAYER_FIELDS = [f.name for f in dataclasses.fields(LayerWeights)]


def _cache_dir(path: str) -> str:
    return path + ".f32"


def _source_stamp(path: str) -> Dict[str, Any]:
    st = os.stat(path)
    return {"format": _CACHE_FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _save_cache(w: LlamaWeights, path: str) -> None:
    """Writes the dequantized weights as .npy files (+ meta.json) next to the GGUF, atomically."""
    final = _cache_dir(path)
    parent = os.path.dirname(os.path.abspath(final))
    try:
        tmp = tempfile.mkdtemp(prefix=".f32.", dir=parent)
    except OSError:
        return  # a read-only model dir only costs speed
    try:
        arrays = {"tok_embd": w.tok_embd, "output_norm": w.output_norm}
        if not w.config.tied_embeddings:
            arrays["output"] = np.ascontiguousarray(w.output)
        for i, lw in enumerate(w.layers):
            for f in _LAYER_FIELDS:
                arrays[f"l{i}.{f}"] = getattr(lw, f)
        for name, a in arrays.items():
            np.save(os.path.join(tmp, name + ".npy"), a)
        meta = {
            "stamp": _source_stamp(path),
            "config": dataclasses.asdict(w.config),
            "tokens": w.tokens, "token_types": w.token_types, "merges": w.merges,
            "bos_id": w.bos_id, "eos_id": w.eos_id, "chat_template": w.chat_template,
            "tokenizer_pre": w.tokenizer_pre,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as out:
            json.dump(meta, out)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a read-only cache dir only costs speed


def _load_cache(path: str) -> Optional[LlamaWeights]:
    d = _cache_dir(path)
    try:
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("stamp") != _source_stamp(path):
        return None
    cfg = LlamaConfig(**meta["config"])

    # Memory-mapped, read-only: the page cache is shared between processes.
    def arr(name: str) -> np.ndarray:
        array: np.ndarray = np.load(os.path.join(d, name + ".npy"), mmap_mode="r")
        return array

    try:
        tok_embd = arr("tok_embd")
        layers = [LayerWeights(**{f: arr(f"l{i}.{f}") for f in _LAYER_FIELDS})
                  for i in range(cfg.n_layers)]
        output = tok_embd.T if cfg.tied_embeddings else arr("output")
        return LlamaWeights(
            config=cfg, tok_embd=tok_embd, output=output, output_norm=arr("output_norm"),
            layers=layers, tokens=meta["tokens"], token_types=meta["token_types"],
            merges=meta["merges"], bos_id=meta["bos_id"], eos_id=meta["eos_id"],
            chat_template=meta["chat_template"], tokenizer_pre=meta["tokenizer_pre"])
    except (OSError, ValueError):
        return None


def load_gguf(path: str, use_cache: bool = True) -> LlamaWeights:
    """Loads a llama-architecture GGUF file into float32 numpy weights (about 4 bytes/param).

    Parsing the GGUF (the gguf package walks 100k vocabulary/merge entries one by one) and
    dequantizing take tens of seconds on a small CPU, so with use_cache the float32 result is kept
    in <path>.f32/ (memory-mapped .npy files, invalidated when the GGUF's size or mtime change).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    if use_cache:
        cached = _load_cache(path)
        if cached is not None:
            return cached
    w = _load_gguf_file(path)
    if use_cache:
        _save_cache(w, path)
    return w


def _load_gguf_file(path: str) -> LlamaWeights:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, only 'llama' is supported")
    p = arch + "."
    n_heads = int(_field(reader, p + "attention.head_count"))
    d_model = int(_field(reader, p + "embedding_length"))
    head_dim = d_model // n_heads
    tensors: Dict[str, object] = {t.name: t for t in reader.tensors}
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    cfg = LlamaConfig(
        n_layers=int(_field(reader, p + "block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, p + "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(_field(reader, p + "feed_forward_length")),
        vocab_size=int(_field(reader, p + "vocab_size", len(tokens))),
        context_length=int(_field(reader, p + "context_length")),
        rope_base=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_dim=int(_field(reader, p + "rope.dimension_count", head_dim)),
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors,
    )
    if cfg.rope_dim != cfg.head_dim:
        raise ValueError(f"partial RoPE (dim {cfg.rope_dim} of {cfg.head_dim}) is not supported")

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(f"{path}: missing tensor {name}")
        return _dequant(tensors[name])

    tok_embd = get("token_embd.weight")
    if tok_embd.shape != (cfg.vocab_size, cfg.d_model):
        raise ValueError(f"token_embd shape {tok_embd.shape} does not match the metadata")
    output = tok_embd if cfg.tied_embeddings else get("output.weight")
    layers = []
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        wq, wk, wv = get(b + "attn_q.weight"), get(b + "attn_k.weight"), get(b + "attn_v.weight")
        assert wq.shape == (cfg.n_heads * head_dim, d_model), wq.shape
        assert wk.shape == (cfg.n_kv_heads * head_dim, d_model), wk.shape
        gate, up = get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")
        layers.append(
            LayerWeights(
                attn_norm=get(b + "attn_norm.weight"),
                wqkv=np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=0).T),
                wo=np.ascontiguousarray(get(b + "attn_output.weight").T),
                ffn_norm=get(b + "ffn_norm.weight"),
                wgate_up=np.ascontiguousarray(np.concatenate([gate, up], axis=0).T),
                wdown=np.ascontiguousarray(get(b + "ffn_down.weight").T),
            )
        )
    ct = reader.fields.get("tokenizer.chat_template")
    return LlamaWeights(
        config=cfg,
        tok_embd=tok_embd,
        output=output.T,  # a view when tied: BLAS reads the transpose in place
        output_norm=get("output_norm.weight"),
        layers=layers,
        tokens=tokens,
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        chat_template=ct.contents() if ct is not None else None,
        tokenizer_pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
    )
