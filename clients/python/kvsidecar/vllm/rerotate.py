"""RoPE re-rotation of a compressed prefix's keys, with the model's own rotary embedding.

vLLM caches keys after RoPE. A compressed prefix keeps ``C`` of its ``P`` tokens, per layer and
kv head, at their original positions ``p``; loaded into vLLM it occupies slots ``0..C-1``, and
vLLM gives the tokens that follow positions counted from ``C``. For attention to see the kept
keys as a contiguous run before them, each head's kept tokens are put in position order and the
``j``-th one's key is rotated from ``p`` to ``j`` (by ``-(p - j)``; RoPE is a rotation per
frequency pair, so rotating by a difference is exact up to float rounding). Values carry no
position and are unchanged. kvpress's ``KeyRerotationPress`` applies the same rule.

The rotation uses the cos/sin table of the rotary embedding vLLM builds for the model
(``vllm.model_executor.layers.rotary_embedding.get_rope`` with the model's head size, maximum
position and rope parameters), so it follows the model's base, scaling and style. Rotary
embeddings whose table is not a pure rotation (YaRN's attention factor scales cos and sin) are
refused: the connector then serves no compressed prefix for that model.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

# Architectures whose attention applies vLLM's get_rope(..., is_neox_style=True) to the keys
# before caching them, with nothing position-dependent beside it.
NEOX_ROPE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class Rerotator:
    """Rotates cached keys by position differences with one model's RoPE table."""

    def __init__(self, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox_style: bool) -> None:
        self.cos_sin = cos_sin_cache.to(torch.float32)
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        half = rotary_dim // 2
        norm = self.cos_sin[:, :half] ** 2 + self.cos_sin[:, half:] ** 2
        if not torch.allclose(norm, torch.ones_like(norm), atol=1e-5):
            raise ValueError("the model's rotary table is not a pure rotation (cos^2 + sin^2 "
                             "!= 1, e.g. YaRN's attention factor): keys cannot be re-rotated")

    @classmethod
    def for_model(cls, vllm_config: Any) -> "Rerotator":
        """The rotator of a vLLM config's model; ValueError naming why it has none."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        model_config = vllm_config.model_config
        hf = model_config.hf_text_config
        archs = tuple(getattr(model_config.hf_config, "architectures", None) or ())
        if not any(a in NEOX_ROPE_ARCHITECTURES for a in archs):
            raise ValueError(f"architecture {archs} is not one whose keys this connector can "
                             f"re-rotate ({', '.join(NEOX_ROPE_ARCHITECTURES)})")
        with set_current_vllm_config(vllm_config):
            rope = get_rope(model_config.get_head_size(),
                            max_position=hf.max_position_embeddings,
                            is_neox_style=True,
                            rope_parameters=getattr(hf, "rope_parameters", None),
                            dtype=torch.float32)
        return cls(rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)

    def _pairs(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        r = x[..., :self.rotary_dim]
        if self.is_neox_style:
            half = self.rotary_dim // 2
            return r[..., :half], r[..., half:]
        return r[..., 0::2], r[..., 1::2]

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[..., T, D]`` rotated by ``-delta`` (``delta`` ``[..., T]``, >= 0, below
        the table's length): a key cached at position ``p`` comes back as the key of position
        ``p - delta``. Computed in float32, returned in the keys' dtype."""
        if delta.numel() and (int(delta.min()) < 0 or int(delta.max()) >= self.cos_sin.shape[0]):
            raise ValueError(f"position shifts must be in [0, {self.cos_sin.shape[0]}), got "
                             f"[{int(delta.min())}, {int(delta.max())}]")
        half = self.rotary_dim // 2
        table = self.cos_sin[delta.long()]
        cos, sin = table[..., :half], -table[..., half:]  # rotation by -delta
        x = keys.to(torch.float32)
        x1, x2 = self._pairs(x)
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.is_neox_style:
            rotated = torch.cat([o1, o2], dim=-1)
        else:
            rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
        out = torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)
        return out.to(keys.dtype)


def contiguous_positions(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                         rotator: Rerotator) -> Tuple[torch.Tensor, torch.Tensor]:
    """A compressed layer as vLLM loads it: per head, the kept tokens (``keys``, ``values``
    ``[H][C][D]``, original ``positions`` ``[H][C]`` in any slot order) sorted by position, and
    the ``j``-th key re-rotated from its position to ``j``."""
    order = torch.argsort(positions.long(), dim=1)
    pos = torch.gather(positions.long(), 1, order)
    idx = order.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    k = torch.gather(keys, 1, idx)
    v = torch.gather(values, 1, idx)
    target = torch.arange(pos.shape[1], dtype=torch.long).unsqueeze(0)
    return rotator.rotate(k, pos - target), v
