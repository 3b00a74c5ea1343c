#!/usr/bin/env python3
"""Decode speed of the SmolLM2 worker: the KV cache in the sidecar vs in the worker, batch 1 or N.

Prefills the same prompts into LocalKVCaches and into SidecarKVCaches (optionally under a budget),
then times decode steps of the same forced tokens (Llama.forward_batch over the whole batch: one
DecodeStep per step for the sidecar), interleaving local and sidecar steps so both see the same
machine load. Reports tokens/s of each, the sidecar's share of a step,
(t_sidecar - t_local) / t_sidecar, medians over the steps (and, less sensitive to load swings, the
median of the per-step differences), and the median time from sending a DecodeStep to its answer.
A sidecar step is timed until its DecodeStep answer is applied (SidecarKVCache.sync), so the RPC
the worker overlaps with its logits counts in full when it is not hidden. --read-through re-reads
every layer from the arena at every step (GetLayout + gather, what the worker did before it kept a
mirror) for comparison; --no-overlap waits for each DecodeStep inside the step.

    PYTHONPATH=clients/python/examples python -m numpy_llama.overhead \\
        --kvsidecar-bin build/service/kvsidecar --prompt-tokens 512 --batch 1 --dtype fp16
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
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded per step")
    ap.add_argument("--budget", type=int, default=0, help="tokens per layer, 0 = unbounded")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--dtype", default="fp16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--read-through", action="store_true",
                    help="no mirror: read every layer from the arena at every step")
    ap.add_argument("--no-overlap", action="store_true",
                    help="wait for each DecodeStep before computing the logits")
    ap.add_argument("--server")
    ap.add_argument("--kvsidecar-bin")
    args = ap.parse_args(argv)

    import kvsidecar as kvs
    from numpy_llama import LocalKVCache, load_model
    from numpy_llama.sidecar_cache import (SidecarKVCache, blocks_needed, layout_for,
                                               policy_spec)
    from kvsidecar.server import LocalServer

    model, tok = load_model()
    text = open(os.path.join(HERE, "..", "..", "..", "..", "bench", "quality", "data",
                             "alice_ch1.txt"), encoding="utf-8").read()
    ids = tok.encode(text)
    need = args.prompt_tokens + args.steps
    # Sequence i starts 37 * i tokens into the text: different prompts, same length.
    while len(ids) < need + 37 * args.batch:
        ids = ids + ids
    prompts = [ids[37 * i: 37 * i + args.prompt_tokens] for i in range(args.batch)]
    conts = [ids[37 * i + args.prompt_tokens: 37 * i + need] for i in range(args.batch)]
    locals_ = []
    for p in prompts:
        local = LocalKVCache(model.cfg, need)
        model.prefill(p, local, 64)
        locals_.append(local)
    server = None if args.server else LocalServer(args.kvsidecar_bin)
    address = args.server or server.address
    rpc = []
    try:
        with kvs.Client(address, timeout=120) as client, client.attach(
                layout_for(model.cfg, args.dtype),
                num_blocks=args.batch * blocks_needed(model.cfg, need + 64)) as session:
            caches = []
            for p in prompts:
                cache = SidecarKVCache(session, model.cfg, policy_spec(args.policy, args.budget),
                                       args.budget, "full", read_through=args.read_through,
                                       overlap=not args.no_overlap)
                cache.begin_prefill(len(p))
                model.prefill(p, cache, 64, align_last=True)
                cache.finish_prefill()
                caches.append(cache)
            real_step = session.decode_step_future

            class Timed:  # records send -> answer of each DecodeStep
                def __init__(self, items):
                    t0 = time.perf_counter()
                    self.future = real_step(items)
                    self.future.add_done_callback(
                        lambda _: rpc.append(time.perf_counter() - t0))

                def result(self, timeout=None):
                    return self.future.result(timeout)

            session.decode_step_future = Timed
            t_local, t_side = [], []
            for i in range(args.steps):
                toks = [c[i] for c in conts]
                pos = [args.prompt_tokens + i] * args.batch
                t0 = time.perf_counter()
                model.forward_batch(toks, pos, locals_)
                t1 = time.perf_counter()
                model.forward_batch(toks, pos, caches)
                for cache in caches:
                    cache.sync()
                t2 = time.perf_counter()
                t_local.append(t1 - t0)
                t_side.append(t2 - t1)
            for cache in caches:
                cache.release()
    finally:
        if server is not None:
            server.close()
    ml, ms = statistics.median(t_local), statistics.median(t_side)
    b = args.batch
    print(f"batch {b}, prompt {args.prompt_tokens} tokens, {args.steps} decode steps, "
          f"K/V {args.dtype}, budget {args.budget or 'unbounded'} ({args.policy})"
          f"{', read-through' if args.read_through else ''}"
          f"{', no overlap' if args.no_overlap else ''}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"local cache:   {b / ml:.2f} tokens/s (median step {1000 * ml:.1f} ms)")
    print(f"sidecar cache: {b / ms:.2f} tokens/s (median step {1000 * ms:.1f} ms; DecodeStep "
          f"sent -> answer {1000 * statistics.median(rpc):.2f} ms)")
    print(f"sidecar share of a decode step: {100 * (ms - ml) / ms:.1f}%")
    # Less sensitive to load swings between steps: the median of the paired differences.
    paired = statistics.median(s - l for s, l in zip(t_side, t_local))
    print(f"median paired difference: {1000 * paired:.2f} ms = {100 * paired / ms:.1f}% of a "
          f"sidecar step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
