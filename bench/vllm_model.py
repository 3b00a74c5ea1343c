"""SmolLM2-135M-Instruct for vLLM's CPU build: the GGUF weights (deploy/fetch_model.sh, the file
the quality harness and the worker demo use) copied into a ``LlamaForCausalLM`` and saved as a
safetensors directory, with the tokenizer. vLLM's CPU build has no GGUF loader, and transformers
refuses ``save_pretrained`` on a model loaded from a quantised GGUF, so the dequantised weights
go into a fresh model of the same config.

    python bench/vllm_model.py [OUT_DIR]    # default ~/.cache/kvsidecar/models/smollm2-vllm

Prints OUT_DIR. Idempotent: an OUT_DIR holding model.safetensors is reused.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def convert(out_dir: str) -> str:
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = subprocess.run(["bash", os.path.join(HERE, "..", "deploy", "fetch_model.sh")],
                          check=True, capture_output=True, text=True,
                          env=dict(os.environ, PIP=f"{sys.executable} -m pip",
                                   PYTHON=sys.executable)).stdout.strip()
    d, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    config = src.config
    config.torch_dtype = "float32"
    # The weights are saved dequantised: no GGUF quantisation for vLLM to look for.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # A tied output layer has no weight of its own in either model.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise SystemExit(f"weights do not match: missing {missing}, unexpected {unexpected}")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    default = os.path.join(os.environ.get("KVS_MODEL_DIR",
                                          os.path.expanduser("~/.cache/kvsidecar/models")),
                           "smollm2-vllm")
    print(convert(sys.argv[1] if len(sys.argv) > 1 else default))
