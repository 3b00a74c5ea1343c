#!/usr/bin/env python3
"""Time to first token with and without compressed prefix reuse, on SmolLM2-135M-Instruct (the
GGUF of deploy/fetch_model.sh, loaded and dequantised by transformers) on the CPU.

    KVSIDECAR_BIN=build/service/kvsidecar build/pyenv/bin/python bench/prefix_reuse_bench.py

Worker A prefills a --doc-tokens document (bench/quality/data/alice_ch1.txt) into a
kvsidecar.hf.SidecarCache, compressed by a query-agnostic policy (--policy, keydiff by default)
to --budget tokens per layer, and publishes it under kvsidecar.prefix_key. Worker B (another
session of the tenant) answers a --question-tokens question on the same document two ways:
  - cold: a fresh SidecarCache, generate() over document + question (prefill and compression of
    the whole document, then the question);
  - reuse: SidecarCache.from_prefix(key), generate() over document + question (the cache says
    the document is seen: only the question is computed).
Time to first token = the wall time of generate(max_new_tokens=1) (for reuse, plus the
CreateSequence from the prefix), median of --repeats runs, interleaved on the same machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALICE = os.path.join(HERE, "quality", "data", "alice_ch1.txt")


def load(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


def generate(model, ids, cache, new_tokens):
    import torch
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()


def prefill(model, ids, cache):
    import torch
    with torch.no_grad():
        t0 = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True)
        return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: deploy/fetch_model.sh)")
    ap.add_argument("--server", default=None, help="a running sidecar (default: start one "
                    "from $KVSIDECAR_BIN)")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.model is None:
        args.model = subprocess.run([os.path.join(REPO, "deploy", "fetch_model.sh")],
                                    check=True, capture_output=True, text=True).stdout.strip()

    import torch

    import kvsidecar as kvs
    from kvsidecar.hf import SidecarCache, blocks_for, layout_for
    from kvsidecar.server import LocalServer
    torch.set_num_threads(args.threads)
    server = None
    if args.server is None:
        server = LocalServer(lease_ms=60000)
        server.__enter__()
        args.server = server.address
    try:
        model, tok = load(args.model)
        with open(ALICE, encoding="utf-8") as f:
            text = tok.encode(f.read(), add_special_tokens=False)
        question = tok.encode(" Question: who did Alice follow down the hole? Answer:",
                              add_special_tokens=False)
        doc = text[:args.doc_tokens]
        question = (question * args.question_tokens)[:args.question_tokens]
        doc_ids = torch.tensor([doc])
        full_ids = torch.tensor([doc + question])
        layout = layout_for(model, "fp32")
        need = blocks_for(model, len(doc) + len(question) + 8, 1)
        key = kvs.prefix_key(doc, layout, args.policy, args.budget)
        with kvs.Client(args.server, timeout=600) as client, \
                client.attach(layout, tenant="bench", num_blocks=need) as worker_a, \
                client.attach(layout, tenant="bench", num_blocks=2 * need) as worker_b:
            cache_a = SidecarCache(worker_a, model, policy=args.policy, budget=args.budget)
            prefill_s = prefill(model, doc_ids, cache_a)
            t0 = time.perf_counter()
            published = cache_a.publish(key)
            publish_s = time.perf_counter() - t0
            cache_a.release()
            print(f"worker A: prefill {prefill_s:.2f} s, publish {publish_s * 1e3:.1f} ms "
                  f"({published.bytes} bytes, tier {kvs.Tier.Name(published.tier)})",
                  file=sys.stderr)
            cold, reuse, create = [], [], []
            for rep in range(args.repeats):
                cache = SidecarCache(worker_b, model, policy=args.policy, budget=args.budget)
                wall, _ = generate(model, full_ids, cache, 1)
                cache.release()
                cold.append(wall)
                t0 = time.perf_counter()
                cache = SidecarCache.from_prefix(worker_b, model, key)
                created = time.perf_counter() - t0
                wall, _ = generate(model, full_ids, cache, 1)
                cache.release()
                create.append(created)
                reuse.append(wall + created)
                print(f"  rep {rep}: cold {cold[-1]:.3f} s, reuse {reuse[-1]:.3f} s "
                      f"(create from prefix {created * 1e3:.1f} ms)", file=sys.stderr)
            row = {"model": os.path.basename(args.model), "policy": args.policy,
                   "doc_tokens": len(doc), "question_tokens": len(question),
                   "budget": args.budget, "threads": args.threads, "repeats": args.repeats,
                   "prefix_bytes": published.bytes,
                   "ttft_cold_s": round(statistics.median(cold), 3),
                   "ttft_reuse_s": round(statistics.median(reuse), 3),
                   "create_from_prefix_ms": round(statistics.median(create) * 1e3, 1)}
            row["speedup"] = round(row["ttft_cold_s"] / row["ttft_reuse_s"], 2)
            print(json.dumps(row), flush=True)
    finally:
        if server is not None:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
