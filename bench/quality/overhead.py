#!/usr/bin/env python3
"""Decode speed of the SmolLM2 worker, batch 1: the KV cache in the sidecar vs in the worker.

Prefills the same prompt into a LocalKVCache and into a SidecarKVCache (optionally under a
budget), then times decode steps of the same forced tokens, interleaving local and sidecar steps
so both see the same machine load. Reports tokens/s of each and the sidecar's share of a step:
(t_sidecar - t_local) / t_sidecar, medians over the steps. Batch 8 is not implemented (the numpy
model decodes one sequence at a time).

    python bench/quality/overhead.py --kvsidecar-bin build/service/kvsidecar --prompt-tokens 512
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=int, default=0, help="tokens per layer, 0 = unbounded")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--dtype", default="fp16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--server")
    ap.add_argument("--kvsidecar-bin")
    args = ap.parse_args(argv)

    import kvsidecar as kvs
    from kvsidecar.model import LocalKVCache, load_model
    from kvsidecar.model.sidecar_cache import (SidecarKVCache, blocks_needed, layout_for,
                                               policy_spec)
    from kvsidecar.server import LocalServer

    model, tok = load_model()
    text = open(os.path.join(HERE, "data", "alice_ch1.txt"), encoding="utf-8").read()
    ids = tok.encode(text)
    need = args.prompt_tokens + args.steps
    while len(ids) < need:
        ids = ids + ids
    prompt, cont = ids[: args.prompt_tokens], ids[args.prompt_tokens: need]
    local = LocalKVCache(model.cfg, need)
    model.prefill(prompt, local, 64)
    server = None if args.server else LocalServer(args.kvsidecar_bin)
    address = args.server or server.address
    try:
        with kvs.Client(address, timeout=120) as client, client.attach(
                layout_for(model.cfg, args.dtype),
                num_blocks=blocks_needed(model.cfg, need + 64)) as session:
            cache = SidecarKVCache(session, model.cfg, policy_spec(args.policy, args.budget),
                                   args.budget, "full")
            cache.begin_prefill(len(prompt))
            model.prefill(prompt, cache, 64, align_last=True)
            cache.finish_prefill()
            t_local, t_side = [], []
            for i, t in enumerate(cont):
                pos = len(prompt) + i
                t0 = time.perf_counter()
                model.forward([t], [pos], local)
                t1 = time.perf_counter()
                model.forward([t], [pos], cache)
                t2 = time.perf_counter()
                t_local.append(t1 - t0)
                t_side.append(t2 - t1)
            cache.release()
    finally:
        if server is not None:
            server.close()
    ml, ms = statistics.median(t_local), statistics.median(t_side)
    print(f"prompt {len(prompt)} tokens, {len(cont)} decode steps, K/V {args.dtype}, "
          f"budget {args.budget or 'unbounded'} ({args.policy})")
    print(f"local cache:   {1 / ml:.2f} tokens/s (median step {1000 * ml:.1f} ms)")
    print(f"sidecar cache: {1 / ms:.2f} tokens/s (median step {1000 * ms:.1f} ms)")
    print(f"sidecar share of a decode step: {100 * (ms - ml) / ms:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
