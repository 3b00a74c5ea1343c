"""GPT-2-style byte-level BPE tokenizer rebuilt from a GGUF file's vocabulary and merges.

Uses the `tokenizers` package. The pre-tokenizer follows the GGUF `tokenizer.ggml.pre` name the
way llama.cpp does: "smollm" (and the StarCoder family) split every digit on its own, then apply
the GPT-2 byte-level regex; the GPT-2 default applies the byte-level regex only. Control tokens
(token_type 3, e.g. <|im_start|>) are special tokens matched verbatim in the text.

Also formats the ChatML chat template SmolLM2 ships (the GGUF's Jinja template, re-implemented
for the system/user/assistant roles so no Jinja dependency is needed).

A Tokenizer object is safe to share between threads for encode/decode (tokenizers is).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from .gguf_weights import LlamaWeights

_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_CONTROL = 3

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Tokenizer:
    def __init__(self, weights: LlamaWeights):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab: Dict[str, int] = {t: i for i, t in enumerate(weights.tokens)}
        merges = [(a, b) for a, b in (m.split(" ", 1) for m in weights.merges)]
        tok = HfTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if weights.tokenizer_pre in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif weights.tokenizer_pre in ("default", "gpt2", "gpt-2"):
            tok.pre_tokenizer = byte_level
        else:
            raise ValueError(f"unsupported GGUF pre-tokenizer {weights.tokenizer_pre!r}")
        tok.decoder = decoders.ByteLevel()
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(weights.tokens, weights.token_types)
            if ty == _CONTROL
        ]
        tok.add_special_tokens(specials)
        self._tok = tok
        self._special_ids = {vocab[s.content] for s in specials}
        self.bos_id = weights.bos_id
        self.eos_id = weights.eos_id
        self.vocab_size = len(weights.tokens)
        self.im_end_id = vocab.get("<|im_end|>", weights.eos_id)

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @staticmethod
    def chat_prompt(user: str, system: Optional[str] = DEFAULT_SYSTEM) -> str:
        """ChatML prompt for one user turn, ending with the assistant header (generation prompt)."""
        parts = []
        if system is not None:
            parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        parts.append(f"<|im_start|>user\n{user}<|im_end|>\n")
        parts.append("<|im_start|>assistant\n")
        return "".join(parts)
