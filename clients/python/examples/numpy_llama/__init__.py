"""A real pretrained LLM (SmolLM2-135M-Instruct, Llama architecture, from a GGUF file) in numpy,
with a KV-cache interface that the sidecar can back.

    from numpy_llama import load_model, LocalKVCache
    model, tok = load_model()                      # fetches the GGUF via deploy/fetch_model.sh
    gen = model.generate(tok.encode(tok.chat_prompt("Hi")), LocalKVCache(model.cfg), 20)

Modules: gguf_weights (GGUF reading), tokenizer (BPE from the GGUF), llama (forward + caches),
sidecar_cache (K/V kept in the sidecar), fetch (locating the model file), worker (CLI).
"""

from typing import Optional, Tuple

from .fetch import model_path
from .gguf_weights import LlamaConfig, LlamaWeights, load_gguf
from .llama import Generation, Llama, LocalKVCache, log_softmax, perplexity
from .tokenizer import Tokenizer


def load_model(path: Optional[str] = None) -> Tuple[Llama, Tokenizer]:
    """Returns (Llama, Tokenizer) for the GGUF at `path` (default: the fetched SmolLM2)."""
    weights = load_gguf(path or model_path())
    return Llama(weights), Tokenizer(weights)


__all__ = [
    "Generation", "Llama", "LlamaConfig", "LlamaWeights", "LocalKVCache", "Tokenizer",
    "load_gguf", "load_model", "log_softmax", "model_path", "perplexity",
]
