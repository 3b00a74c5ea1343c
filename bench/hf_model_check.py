#!/usr/bin/env python3
"""A real model through kvsidecar.hf.SidecarCache against DynamicCache, on the CPU: SmolLM2-135M
(Llama family, deploy/fetch_model.sh) or Gemma 3 270M (sliding-window and global layers,
deploy/fetch_gemma.sh), each loaded and dequantised from its GGUF by transformers.

    KVSIDECAR_BIN=build/service/kvsidecar build/pyenv/bin/python bench/hf_model_check.py gemma3

Greedy `generate` of --new-tokens after a --prompt-tokens prompt (the Alice text): DynamicCache,
then SidecarCache at 100 % (must give the same tokens; the largest logit difference is printed)
and at each --budgets fraction with each --policies policy (tokens and what each layer holds).
Gemma's GGUF tokenizer does not add <bos>: it is prepended here (without it the model degenerates).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALICE = os.path.join(HERE, "quality", "data", "alice_ch1.txt")
FETCH = {"smollm2": "fetch_model.sh", "gemma3": "fetch_gemma.sh"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(FETCH))
    ap.add_argument("--gguf", default=None, help="GGUF path (default: the deploy/ fetch script)")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--policies", default="snapkv,h2o")
    ap.add_argument("--budgets", default="0.25")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    path = args.gguf or subprocess.run([os.path.join(REPO, "deploy", FETCH[args.model])],
                                       check=True, capture_output=True, text=True).stdout.strip()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvsidecar as kvs
    from kvsidecar.hf import SidecarCache, blocks_for, layout_for
    from kvsidecar.server import LocalServer
    torch.set_num_threads(args.threads)
    directory, name = os.path.split(path)
    started = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.float32).eval()
    config = model.config
    print(json.dumps({"model": type(model).__name__, "load_s": round(time.perf_counter() - started),
                      "layers": config.num_hidden_layers,
                      "sliding_window": getattr(config, "sliding_window", None),
                      "layer_types": sorted(set(getattr(config, "layer_types", None) or []))}),
          flush=True)
    with open(ALICE, encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False)[:args.prompt_tokens]
    if args.model == "gemma3":
        ids = [tok.bos_token_id] + ids
    ids = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
              min_new_tokens=args.new_tokens, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=tok.pad_token_id or 0)
    with torch.no_grad():
        ref = model.generate(ids, past_key_values=DynamicCache(config=config), **kw)
    new = ref.sequences[0, ids.shape[1]:]
    print(json.dumps({"cache": "dynamic", "text": tok.decode(new)}), flush=True)
    runs = [("snapkv", 1.0)] + [(p, float(b)) for b in args.budgets.split(",")
                                for p in args.policies.split(",")]
    with LocalServer() as server, kvs.Client(server.address, timeout=600) as client, \
            client.attach(layout_for(model, "fp32"),
                          num_blocks=blocks_for(model, ids.shape[1] + args.new_tokens)) as s:
        for policy, budget in runs:
            cache = SidecarCache(s, model, policy=policy, budget=budget)
            with torch.no_grad():
                out = model.generate(ids, past_key_values=cache, **kw)
            diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
            print(json.dumps({
                "cache": f"sidecar {policy} {budget:g}",
                "same_tokens": bool(torch.equal(out.sequences, ref.sequences)),
                "max_logit_diff": diff, "held_per_layer": cache.counts[0],
                "text": tok.decode(out.sequences[0, ids.shape[1]:])}), flush=True)
            cache.release()


if __name__ == "__main__":
    sys.exit(main())
