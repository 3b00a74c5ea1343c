#!/usr/bin/env python3
"""Throughput and memory of transformers `generate` with kvsidecar.hf.SidecarCache against
DynamicCache, on SmolLM2-135M-Instruct (the GGUF of deploy/fetch_model.sh, loaded and dequantised
by transformers) on the CPU.

    KVSIDECAR_BIN=build/service/kvsidecar build/pyenv/bin/python bench/hf_cache_bench.py

Per batch size: greedy `generate` of --new-tokens tokens after a --prompt-tokens prompt (rows are
different slices of bench/quality/data/alice_ch1.txt, equal length), with DynamicCache, with
SidecarCache at 100 % (nothing evicted) and at 25 %, interleaved, best of --repeats. tokens/s
counts the generated tokens of every row over the whole call (prefill included). The figure that
matters is the ratio SidecarCache/DynamicCache, measured in the same run: the machine is shared.

Memory: the K/V bytes each cache holds at the end, and the worker's peak RSS (VmHWM) in a fresh
process per cache (--rss-prompt-tokens, batch --rss-batch): DynamicCache at 100 % against
SidecarCache at 25 %. The mapped arena is shared memory: pages of it the worker touched count in
its RSS as RssShmem, reported apart from RssAnon (the worker's own memory).
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


def _status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def load(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


def rows(tok, batch, length):
    import torch
    with open(ALICE, encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False)
    step = max(1, (len(ids) - length) // max(1, batch))
    if len(ids) < length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {length}")
    return torch.tensor([ids[i * step:i * step + length] for i in range(batch)])


def dynamic_bytes(cache):
    total = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def generate(model, ids, cache, new_tokens):
    import torch
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, out


def throughput(args, model, tok, session):
    from transformers import DynamicCache

    from kvsidecar.hf import SidecarCache
    results = []
    for batch in args.batches:
        ids = rows(tok, batch, args.prompt_tokens)
        best = {"dynamic": 1e30, "sidecar_100": 1e30, "sidecar_25": 1e30}
        held = {}
        same = True
        for rep in range(args.repeats):
            for kind in best:
                if kind == "dynamic":
                    cache = DynamicCache(config=model.config)
                else:
                    cache = SidecarCache(session, model, policy=args.policy,
                                         budget=1.0 if kind == "sidecar_100" else 0.25)
                wall, out = generate(model, ids, cache, args.new_tokens)
                best[kind] = min(best[kind], wall)
                if kind == "dynamic":
                    held[kind] = dynamic_bytes(cache)
                    ref = out
                else:
                    held[kind] = cache.kv_bytes()
                    if kind == "sidecar_100":
                        same = same and bool((out == ref).all())
                    cache.release()
                print(f"  batch {batch} rep {rep} {kind:12s} {wall:7.2f} s", file=sys.stderr)
        toks = batch * args.new_tokens
        row = {"batch": batch, "prompt_tokens": args.prompt_tokens,
               "new_tokens": args.new_tokens, "same_tokens_at_100": same}
        for kind, wall in best.items():
            row[f"{kind}_tok_s"] = round(toks / wall, 2)
            row[f"{kind}_kv_bytes"] = held[kind]
        row["ratio_100"] = round(row["sidecar_100_tok_s"] / row["dynamic_tok_s"], 3)
        row["ratio_25"] = round(row["sidecar_25_tok_s"] / row["dynamic_tok_s"], 3)
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def rss_child(args):
    """One fresh process: load, run one cache kind, print its memory figures."""
    import torch
    from transformers import DynamicCache

    import kvsidecar as kvs
    from kvsidecar.hf import SidecarCache, blocks_for, layout_for
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    ids = rows(tok, args.rss_batch, args.rss_prompt_tokens)
    loaded = _status()
    if args.rss_child == "dynamic":
        cache = DynamicCache(config=model.config)
        generate(model, ids, cache, args.rss_new_tokens)
        held = dynamic_bytes(cache)
    else:
        with kvs.Client(args.server, timeout=600) as client, client.attach(
                layout_for(model, "fp32"),
                num_blocks=blocks_for(model, args.rss_prompt_tokens + args.rss_new_tokens,
                                      args.rss_batch)) as session:
            cache = SidecarCache(session, model, policy=args.policy, budget=0.25)
            generate(model, ids, cache, args.rss_new_tokens)
            held = cache.kv_bytes()
            end = _status()
            cache.release()
    end = end if args.rss_child != "dynamic" else _status()
    print(json.dumps({"cache": args.rss_child, "kv_bytes_held": held,
                      "rss_after_load": loaded["VmRSS"], "peak_rss": end["VmHWM"],
                      "rss_anon_end": end["RssAnon"], "rss_shmem_end": end["RssShmem"]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: deploy/fetch_model.sh)")
    ap.add_argument("--server", default=None, help="a running sidecar (default: start one "
                    "from $KVSIDECAR_BIN)")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rss-batch", type=int, default=4)
    ap.add_argument("--rss-prompt-tokens", type=int, default=1024)
    ap.add_argument("--rss-new-tokens", type=int, default=16)
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--rss-child", choices=["dynamic", "sidecar_25"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.model is None:
        args.model = subprocess.run([os.path.join(REPO, "deploy", "fetch_model.sh")],
                                    check=True, capture_output=True, text=True).stdout.strip()
    if args.rss_child:
        return rss_child(args)

    import torch

    import kvsidecar as kvs
    from kvsidecar.hf import blocks_for, layout_for
    from kvsidecar.server import LocalServer
    torch.set_num_threads(args.threads)
    server = None
    if args.server is None:
        server = LocalServer(lease_ms=60000)
        server.__enter__()
        args.server = server.address
    try:
        results = []
        if not args.skip_throughput:
            model, tok = load(args.model)
            need = blocks_for(model, args.prompt_tokens + args.new_tokens, max(args.batches))
            with kvs.Client(args.server, timeout=600) as client, \
                    client.attach(layout_for(model, "fp32"), num_blocks=need) as session:
                results = throughput(args, model, tok, session)
            del model
        mem = []
        if not args.skip_rss:
            for kind in ("dynamic", "sidecar_25"):
                out = subprocess.run(
                    [sys.executable, __file__, "--rss-child", kind, "--model", args.model,
                     "--server", args.server, "--policy", args.policy,
                     "--threads", str(args.threads), "--rss-batch", str(args.rss_batch),
                     "--rss-prompt-tokens", str(args.rss_prompt_tokens),
                     "--rss-new-tokens", str(args.rss_new_tokens)],
                    check=True, capture_output=True, text=True)
                mem.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(mem[-1]), flush=True)
        print(json.dumps({"throughput": results, "memory": mem}))
    finally:
        if server is not None:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
