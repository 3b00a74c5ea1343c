"""A random-weight Llama saved for vLLM (safetensors, fp32): head size 32, the smallest vLLM's
CPU attention takes. Nothing is downloaded."""

import sys


def build(path: str, seed: int = 0, layers: int = 2, vocab: int = 512) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
                         torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    # Larger weights than the default init: the next token depends on the whole context, so
    # that wrong KV changes the greedy tokens.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    build(sys.argv[1])
