"""The connector's parts against the installed vLLM, without an engine: the CPU paged-cache layout
(vLLM's own kernel writes it), the RoPE re-rotation (vLLM's own rotary embedding), the keys and
the settings."""

import random

import pytest
import torch

from kvsidecar.vllm import config, keys, paged
from kvsidecar.vllm.rerotate import Rerotator, contiguous_positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_cache_layout_is_transposed_keys_then_values(dtype):
    # vLLM's cpu_attn_reshape_and_cache writes a block; read_blocks must find every token.
    assert paged.check_layout(dtype, 128, 2, 32) == ""
    assert paged.check_layout(dtype, 128, 3, 64) == ""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    b, h, d = 128, 2, 32
    cache = torch.zeros(4, h, b, 2 * d, dtype=dtype)
    kc, vc = cache.view(4, h, 2 * b, d).chunk(2, dim=2)
    k = torch.randn(b, h, d).to(dtype)
    v = torch.randn(b, h, d).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(2 * b, 3 * b),
                                   _get_attn_isa(dtype, b, d))
    # The documented layout, element by element: K^T [D][B], then V [B][D], per block and head.
    flat = cache[2].reshape(h, 2 * b * d)
    assert torch.equal(flat[:, :b * d].reshape(h, d, b), k.permute(1, 2, 0))
    assert torch.equal(flat[:, b * d:].reshape(h, b, d), v.permute(1, 0, 2))
    # write_blocks is read_blocks' inverse, and write_tokens fills slots 0..T-1.
    got_k, got_v = paged.read_blocks(cache, [2])
    other = torch.zeros_like(cache)
    paged.write_blocks(other, [1], got_k, got_v)
    assert torch.equal(other[1], cache[2])
    tokens = torch.zeros_like(cache)
    paged.write_tokens(tokens, [3, 0], k.transpose(0, 1)[:, :100], v.transpose(0, 1)[:, :100])
    back_k, back_v = paged.read_blocks(tokens, [3])
    assert torch.equal(back_k[0][:, :100], k.transpose(0, 1)[:, :100])
    assert torch.equal(back_v[0][:, 100:], torch.zeros(h, 28, d, dtype=dtype))


def _vllm_rope(rope_parameters):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(32, max_position=4096, is_neox_style=True,
                        rope_parameters=rope_parameters, dtype=torch.float32)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
])
def test_rerotated_keys_equal_the_models_rope_at_the_new_positions(rope_parameters):
    # Keys cached at their original positions, kept in any slot order, come back as vLLM's own
    # RoPE would have rotated them at positions 0..C-1.
    rope = _vllm_rope(rope_parameters)
    rotator = Rerotator(rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
    heads, dim, prefix, kept = 2, 32, 700, 96
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(heads, prefix, dim, generator=gen)   # keys before RoPE

    def rotate_at(positions, k):  # vLLM's rotary embedding on [T][H*D] keys
        q = torch.zeros(len(positions), heads * dim)
        _, out = rope.forward_native(torch.as_tensor(positions), q, k.reshape(len(positions), -1))
        return out.reshape(len(positions), heads, dim)

    cached = rotate_at(list(range(prefix)), raw.transpose(0, 1)).transpose(0, 1)
    rng = random.Random(5)
    kept_pos = [sorted(rng.sample(range(prefix), kept)) for _ in range(heads)]
    slots = [rng.sample(range(kept), kept) for _ in range(heads)]  # sidecar slot order
    pos = torch.tensor([[kept_pos[h][s] for s in slots[h]] for h in range(heads)])
    k = torch.stack([cached[h, pos[h]] for h in range(heads)])
    v = torch.randn(heads, kept, dim, generator=gen)
    got_k, got_v = contiguous_positions(k, v, pos, rotator)
    for h in range(heads):
        order = torch.argsort(pos[h])
        want = rotate_at(list(range(kept)), raw[h, pos[h][order]].unsqueeze(1).expand(
            kept, heads, dim).contiguous())[:, 0]
        # float32 cos/sin of angles up to 700 rad: a few 1e-5 of rounding.
        torch.testing.assert_close(got_k[h], want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got_v[h], v[h][order])
    # Kept at their own positions (nothing evicted): unchanged.
    full = torch.arange(kept).unsqueeze(0).expand(heads, kept)
    same_k, _ = contiguous_positions(cached[:, :kept], v, full, rotator)
    assert torch.equal(same_k, cached[:, :kept])


def test_a_table_with_an_attention_factor_is_refused():
    rope = _vllm_rope({"rope_type": "default", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="not a pure rotation"):
        Rerotator(rope.cos_sin_cache * 1.1, rope.rotary_dim, True)


def test_block_keys_chain_and_compressed_keys_differ():
    root = keys.root_hash("m", b"layout")
    a = list(range(300))
    b = list(range(128)) + [7] * 172
    ca, cb = keys.block_chain(root, a, 128, 2), keys.block_chain(root, b, 128, 2)
    assert ca[0] == cb[0] and ca[1] != cb[1]       # same first block, different second
    assert keys.block_chain(keys.root_hash("other", b"layout"), a, 128, 1)[0] != ca[0]
    k1 = keys.compressed_key(root, ca, a, 128, 256, b"keydiff\x000.25")
    assert k1 != keys.compressed_key(root, ca, a, 128, 256, b"keydiff\x000.5")
    assert k1 != keys.compressed_key(root, ca, a, 128, 200, b"keydiff\x000.25")
    assert len(k1) == 64 and len(keys.hex_key(ca[0])) == 64


def test_settings_are_checked():
    cfg = config.parse({"policy": "keydiff", "budget": "25%", "tier": "redis"})
    assert cfg.budget_for(256) == 64 and cfg.budget_for(3) == 1
    assert config.parse({"policy": "keydiff", "budget": 100}).budget_for(64) == 64
    for bad, match in [({"policy": "h2o", "budget": "10%"}, "query-agnostic"),
                       ({"policy": "keydiff", "budget": "10%", "window": 8}, "snapkv only"),
                       ({"policy": "keydiff"}, "budget is required"),
                       ({"budget": "10%"}, "needs a policy"),
                       ({"tier": "tape"}, "tier"),
                       ({"adress": "x"}, "unknown keys")]:
        with pytest.raises(ValueError, match=match):
            config.parse(bad)
