#!/usr/bin/env python3
"""kvsidecar.hf.SidecarCache generating on the GPU (run by deploy/gpu/check.sh).

`kvsidecar --backend=cuda` ($KVSIDECAR_BIN) owns a CUDA arena; this process maps it (CUDA IPC),
and a tiny randomly initialised transformers model on the same GPU generates with SidecarCache
over that arena: the K/V it writes and the K/V its attention reads are CUDA tensors inside the
mapping. Checks, for Llama (global layers) and Gemma 3 (sliding and global layers):
  - at 100 % budget, the greedy tokens equal DynamicCache's and the logits agree within LOGIT_TOL
    (fp32 arena: only where the K/V are read from differs);
  - at 25 % budget (SnapKV, fp16 arena), generation runs and every sequence holds what the
    budget allows, as GetLayout reports it;
  - the views the cache attends over are CUDA tensors inside the mapped arena.

  hf_cuda_check.py [--kvsidecar BIN] [--json FILE] [--device cpu]
(--device cpu: the same steps on the CPU backend and a CPU model, to try the script without a GPU.)
Exit status 0 iff every check held; one line per check on stdout.
"""

import argparse
import inspect
import json
import os
import sys
import time

import torch
from transformers import (DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM)

import kvsidecar as kvs
from kvsidecar.hf import SidecarCache, blocks_for, layout_for
from kvsidecar.server import LocalServer

LOGIT_TOL = 1e-3  # fp32 on the GPU: TF32 is off below, so this is reduction-order noise only
PROMPT, STEPS, BATCH = 96, 24, 2
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
    else "past_key_values"

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def make_model(family, device):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                         "full_attention"]))
    model.set_attn_implementation("sdpa")
    return model.to(device).eval()


def generate(model, ids, cache):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE: cache},
                              max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def run_family(client, family, device, results):
    model = make_model(family, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (BATCH, PROMPT), generator=g).to(device)
    ref = generate(model, ids, DynamicCache(config=model.config))
    with client.attach(layout_for(model, "fp32"),
                       num_blocks=blocks_for(model, PROMPT + STEPS, BATCH)) as s:
        arena = s.arena
        cuda = device == "cuda"
        check(isinstance(arena, kvs.CudaArena) == cuda,
              f"{family}: the session's arena is a {'CudaArena' if cuda else 'host arena'}")
        cache = SidecarCache(s, model, policy="snapkv", budget=1.0)
        t0 = time.perf_counter()
        out = generate(model, ids, cache)
        results[f"{family}_full_generate_s"] = round(time.perf_counter() - t0, 3)
        check(torch.equal(out.sequences, ref.sequences),
              f"{family}: 100 % budget, greedy tokens equal DynamicCache's "
              f"({BATCH} x {STEPS} tokens)")
        diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
        results[f"{family}_full_max_logit_diff"] = diff
        check(diff <= LOGIT_TOL, f"{family}: logits within {LOGIT_TOL} of DynamicCache's ({diff:.2e})")
        if cuda:
            view = cache._arena()  # the torch view attention reads through
            lo, hi = arena.base, arena.base + arena.size_bytes
            check(view.is_cuda and lo <= view.data_ptr() < hi,
                  f"{family}: the cache's arena view is a CUDA tensor inside the mapping")
        cache.release()
    with client.attach(layout_for(model, "fp16"),
                       num_blocks=blocks_for(model, PROMPT + STEPS, BATCH)) as s:
        budget = PROMPT // 4
        cache = SidecarCache(s, model, policy="snapkv", budget=0.25)
        out = generate(model, ids, cache)
        check(out.sequences.shape == (BATCH, PROMPT + STEPS),
              f"{family}: 25 % budget (SnapKV, fp16 arena) generates {STEPS} tokens per row")
        counts = [max(entry.count for entry in s.get_layout(seq).layers)
                  for seq in cache.sequence_ids]
        results[f"{family}_budget_counts"] = counts
        check(all(c <= budget for c in counts),
              f"{family}: every sequence holds at most its budget of {budget} ({counts})")
        cache.release()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvsidecar", default=os.environ.get("KVSIDECAR_BIN"))
    parser.add_argument("--json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        check(torch.cuda.is_available(), f"torch {torch.__version__} sees a CUDA device")
    if failures:
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {}
    with LocalServer(args.kvsidecar, extra_args=[f"--backend={args.device}"]) as server, \
            kvs.Client(server.address, timeout=120, worker_name="hf-cuda-check") as client:
        for family in ("llama", "gemma3"):
            try:
                run_family(client, family, args.device, results)
            except Exception as e:  # one family's failure is reported, the other still runs
                check(False, f"{family}: {type(e).__name__}: {e}")
    results["failures"] = failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
