#!/usr/bin/env python3
"""The Python CUDA arena end to end, as a worker uses it with torch (run by deploy/gpu/check.sh).

Two processes on one GPU: `kvsidecar --backend=cuda` ($KVSIDECAR_BIN) owns the arena; this process
maps it (CudaArena, CUDA IPC), writes every layer's K/V into the reserved blocks through torch
views on its own stream, synchronises, commits, asks the sidecar to compress (KeyDiff: keys only;
H2O: with the window's queries, so the sidecar's attention kernels run), and reads the compacted
cache in place: the torch views must be CUDA tensors inside the mapping (no copy) and hold exactly
the K/V of the positions the sidecar reports kept. The cudaMemcpy read path must agree. The session
runs twice: after each detach the server's device memory (nvidia-smi) must be back where it was
before the second one. The first session's own growth is reported, not held to that: it is
taken to be the server's one-time CUDA set-up (kernels loaded on their first launch under CUDA's
lazy module loading, each host thread's default stream), which a second session must not repeat.

  cuda_arena_check.py [--kvsidecar BIN] [--json FILE]
Exit status 0 iff every check held; one line per check on stdout.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

import kvsidecar as kvs
from kvsidecar.server import LocalServer

L, H, HQ, D, B = 4, 8, 32, 128, 16
TOKENS, BUDGET, WINDOW = 1024, 256, 32

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def gpu_used_mib(pid):
    """Device memory nvidia-smi attributes to process `pid` (MiB), or None if not listed."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1])
    return None


def thread_count(pid):
    """Threads of process `pid` (/proc), or None. Each host thread that calls into CUDA gets a
    default stream of its own, so a count that grows with the device memory names a suspect."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_policy(session, name, k, v, q, results):
    arena = session.arena
    policy = kvs.policy(name)
    seq = session.create_sequence(policy=policy, budget=BUDGET).sequence_id
    r = session.reserve(seq, TOKENS)
    stream = torch.cuda.Stream(device=arena.device)
    lo, hi = arena.base, arena.base + arena.size_bytes
    inside = True
    with torch.cuda.stream(stream):
        for layer in range(L):
            for first, kview, vview in r.views(layer):
                n = kview.shape[1]
                inside &= kview.is_cuda and lo <= kview.data_ptr() < hi
                kview.copy_(k[layer][:, first:first + n])
                vview.copy_(v[layer][:, first:first + n])
    stream.synchronize()  # the writes are complete before the commit (the sync rule)
    check(inside, f"{name}: reserved views are CUDA tensors inside the mapped arena")
    session.commit(r)
    attention = None
    if name != "keydiff":
        attention = kvs.attention(q.cpu().numpy(), query_positions=list(range(TOKENS - WINDOW,
                                                                              TOKENS)))
    t0 = time.perf_counter()
    session.compress(seq, attention=attention)
    results[f"{name}_compress_ms"] = (time.perf_counter() - t0) * 1e3
    layout = session.get_layout(seq)
    exact, in_place, copies_agree = True, True, True
    for entry in layout.layers:
        if entry.count != BUDGET:
            check(False, f"{name}: layer {entry.layer} holds {entry.count}, not {BUDGET}")
            continue
        blocks = session.layer_blocks(entry)
        in_place &= all(b.is_cuda and lo <= b.data_ptr() < hi for b, _ in blocks)
        pos = torch.tensor(list(entry.positions), device=k.device).reshape(H, BUDGET)
        got_k = torch.cat([b[0, :, :n] for b, n in blocks], dim=1)
        got_v = torch.cat([b[1, :, :n] for b, n in blocks], dim=1)
        for h in range(H):
            exact &= torch.equal(got_k[h], k[entry.layer][h, pos[h]])
            exact &= torch.equal(got_v[h], v[entry.layer][h, pos[h]])
        kv = session.read_layer(entry)  # cudaMemcpy path
        copies_agree &= np.array_equal(kv.k, got_k.cpu().numpy())
        copies_agree &= np.array_equal(kv.v, got_v.cpu().numpy())
    check(in_place, f"{name}: compacted blocks read in place (CUDA views inside the arena)")
    check(exact, f"{name}: every kept row bit-identical to what the worker wrote at its position")
    check(copies_agree, f"{name}: read_layer (cudaMemcpy) equals the torch views")
    session.release_sequence(seq)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvsidecar", default=os.environ.get("KVSIDECAR_BIN"))
    parser.add_argument("--json")
    args = parser.parse_args()
    check(torch.cuda.is_available(), f"torch {torch.__version__} sees a CUDA device")
    if failures:
        return 1
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(L, H, TOKENS, D, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(L, H, TOKENS, D, device="cuda", dtype=torch.float16, generator=gen)
    q = torch.randn(L, HQ, WINDOW, D, device="cuda", dtype=torch.float16, generator=gen)
    results = {}
    layout = kvs.model_layout(num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                              dtype="fp16", block_tokens=B)
    with LocalServer(args.kvsidecar, extra_args=["--backend=cuda"]) as server, \
            kvs.Client(server.address, timeout=120) as client:
        pid = server.process.pid
        mib = [gpu_used_mib(pid)]  # before, then attached and after detach, per session
        threads = [thread_count(pid)]  # at the same points
        for _ in range(2):
            with client.attach(layout, num_blocks=L * (TOKENS // B) + 64) as session:
                check(isinstance(session.arena, kvs.CudaArena),
                      "the session's arena is a CudaArena")
                mib.append(gpu_used_mib(pid))
                threads.append(thread_count(pid))
                for name in ("keydiff", "h2o"):
                    run_policy(session, name, k, v, q, results)
            time.sleep(1.0)
            mib.append(gpu_used_mib(pid))
            threads.append(thread_count(pid))
        before, attached, warm, attached2, after = mib
        results.update(server_mib_before=before, server_mib_attached=attached,
                       server_mib_after_first_detach=warm, server_mib_attached_again=attached2,
                       server_mib_after_detach=after, server_threads=threads)
        print(f"note: the sidecar's threads at the same points: {threads}")
        if None not in mib:
            print(f"note: the first session left {warm - before} MiB of one-time set-up")
            check(attached > before and attached2 > warm and after <= warm + 2,
                  f"the sidecar's device memory: {before} MiB, {attached} MiB attached, "
                  f"{warm} MiB after the first detach, {attached2} MiB attached again, "
                  f"{after} MiB after the second detach")
        else:
            print(f"note: nvidia-smi lists no per-process memory here ({mib})")
    results["failures"] = failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
