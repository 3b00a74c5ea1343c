#!/usr/bin/env python3
"""One-off check of the numpy forward pass (numpy_llama) against Hugging Face transformers
loading the same GGUF file (transformers dequantizes it and un-permutes Q/K to its own layout).

transformers and torch come with the client's `hf` extra (deploy/python_env.sh installs it with
the test and model extras); point --hf-python at a venv that has them, e.g.

    deploy/python_env.sh build/pyenv
    PYTHONPATH=clients/python/examples build/pyenv/bin/python -m numpy_llama.check_against_hf \
        --hf-python build/pyenv/bin/python

It compares, on the same token ids, the logits of every position (largest absolute difference,
argmax agreement) and the tokenizations of the texts by both tokenizers.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HF_SIDE = r'''
import json, sys, numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, ids_file, out = sys.argv[1:]
d, name = path.rsplit("/", 1)
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
model.eval()
spec = json.load(open(ids_file))
res = {}
for key, ids in spec["ids"].items():
    with torch.no_grad():
        res["logits_" + key] = model(torch.tensor([ids])).logits[0].float().numpy()
for key, text in spec["texts"].items():
    res["tok_" + key] = np.array(tok.encode(text, add_special_tokens=False), np.int64)
np.savez(out, **res)
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-python", required=True, help="python of a venv with torch+transformers")
    ap.add_argument("--model", default=None, help="GGUF path (default: deploy/fetch_model.sh)")
    args = ap.parse_args()

    import numpy as np
    from numpy_llama import LocalKVCache, load_model, model_path

    path = args.model or model_path()
    model, tok = load_model(path)
    here = os.path.dirname(os.path.abspath(__file__))
    alice = open(os.path.join(here, "data", "alice_ch1.txt"), encoding="utf-8").read()
    texts = {
        "chat": tok.chat_prompt("What is the capital of France? Answer in one word."),
        "alice": alice[:1500],
        "digits": "In 1865, 42 rabbits ran 3.5 km; x_y = f(z) + 7!",
    }
    ids = {k: tok.encode(v) for k, v in texts.items()}
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "spec.json")
        out = os.path.join(tmp, "hf.npz")
        json.dump({"ids": ids, "texts": texts}, open(spec, "w"))
        subprocess.run([args.hf_python, "-c", HF_SIDE, path, spec, out], check=True)
        hf = dict(np.load(out))
    worst = 0.0
    for key, t in ids.items():
        ours = model.prefill(t, LocalKVCache(model.cfg), block_size=64, all_logits=True)
        ref = hf["logits_" + key]
        diff = float(np.abs(ours - ref).max())
        worst = max(worst, diff)
        agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
        print(f"{key:7s} tokens={len(t):4d} max|logit diff|={diff:.5f} "
              f"logit range=[{ref.min():.1f},{ref.max():.1f}] top-1 agreement={agree:.4f} "
              f"same tokenization={list(hf['tok_' + key]) == t}")
    print(f"largest logit difference over all positions: {worst:.5f}")


if __name__ == "__main__":
    sys.exit(main())
