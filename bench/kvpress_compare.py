#!/usr/bin/env python3
"""kvsidecar's Compress against kvpress's own presses on the same tensors, in one process, on the
CPU (issue 20).

Shape: one sequence of --tokens tokens (8192) in --layers layers (32), 8 kv heads, 32 query heads,
head dim 128, fp16, block 16, compressed to --budget (2048) tokens per layer; SnapKV and
PyramidKV get the post-RoPE queries of the last 32 tokens, TOVA the newest one (all it reads).

- kvpress: `press.compress(module, hidden_states, keys, values, None, kwargs)` for every layer,
  the call kvpress's forward hook makes, on [1][H][T][D] fp16 tensors (`torch.set_num_threads`
  = --threads). The window policies compute their queries from the module: a stand-in layer whose
  `q_proj` is the identity, fed the window queries as hidden states, and RoPE with cos = 1,
  sin = 0, so kvpress attends with exactly the queries the sidecar gets.
- kvsidecar: a `kvsidecar --threads=N` process (CPU backend, $KVSIDECAR_BIN or --kvsidecar); the
  same K/V written into its mapped arena, committed, and the Compress RPC timed (wall clock,
  every layer in one call, queries inline). The Commit before it is timed too (`commit` /
  `kvsidecar_commit_ms`): it checks every written row for NaN/inf and, for KNorm, takes the keys'
  norms in the same read, which the Compress then ranks by without reading the keys.
Medians of --repeats after one untimed run each; layer 0's kept sets of both sides are compared
(`layer0_kept_agreement`, the share of kvpress's kept positions the sidecar keeps). Matched
settings: StreamingLLM 4 sinks; KeyDiff cosine to the mean normalised key; KNorm (no
parameters); TOVA over all query heads (`all_heads`); SnapKV window 32, kernel 7 (kvpress's
defaults are 64 / 5); PyramidKV the same plus beta 20. kvpress's ObservedAttention is not timed:
it reads the model's full eager attention matrix ([Hq][T][T]) and computes no attention itself,
which a window-based H2O cannot be compared with.

Also printed: the FMA rates of this machine measured in the same run (`fma_peak`, next to the
kvsidecar binary's build tree: AVX2 and, where the CPU has it, AVX-512), the window Q.K^T FLOP of
the attention policies as a fraction of the rate of the ISA the sidecar's attention kernels run
at (`fma_isa`: fma_peak's `kernel_isa`, the same detection and KVS_CPU_ISA cap as the sidecar
process started here), and the K/V bytes each Compress copied (CompressResponse.bytes_copied), next to what
filling holes slot by slot over the whole table (the planner before block-granular compaction)
would copy for the same kept sets.

Without torch or kvpress installed it prints why and exits 0.

  KVSIDECAR_BIN=build/service/kvsidecar python bench/kvpress_compare.py [--policies a,b] [--json F]
"""

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import time

H, HQ, D, B, W = 8, 32, 128, 16, 32
GROUP = HQ // H


def fma_peak(kvsidecar_bin, threads):
    """({isa: {threads: GFLOP/s}} of the FMA loops for 1 and `threads` threads, the ISA the
    attention kernels run at), or (None, None) when fma_peak is not built. Lines without "isa"
    (an older fma_peak) are AVX2."""
    build = os.path.dirname(os.path.dirname(os.path.abspath(kvsidecar_bin)))
    path = os.environ.get("KVS_FMA_PEAK", os.path.join(build, "bench", "fma_peak"))
    if not os.path.exists(path):
        return None, None
    out = subprocess.run([path, f"--threads={threads}"], check=True, capture_output=True,
                         text=True).stdout
    peak, kernel_isa = {}, "avx2"
    for line in out.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "kernel_isa" in row:
            kernel_isa = row["kernel_isa"]
        elif "threads" in row:
            peak.setdefault(row.get("isa", "avx2"), {})[row["threads"]] = row["gflops"]
    return peak, kernel_isa


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvsidecar", default=os.environ.get("KVSIDECAR_BIN"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policies", default="streaming_llm,keydiff,tova,snapkv,pyramidkv")
    parser.add_argument("--json")
    parser.add_argument("--sidecar-only", action="store_true",
                        help="time kvsidecar alone (e.g. another build), no kvpress")
    args = parser.parse_args()
    try:
        import torch
        import kvpress
    except ImportError as e:
        print(f"skipped: torch and kvpress are needed for the side-by-side run ({e}); "
              "bench/quality/install_kvpress.sh VENV_PYTHON installs it")
        return 0
    import numpy as np
    from torch import nn

    import kvsidecar as kvs
    from kvsidecar.server import LocalServer, find_binary

    torch.set_num_threads(args.threads)
    L, T, budget = args.layers, args.tokens, args.budget
    ratio = 1.0 - budget / T
    binary = find_binary(args.kvsidecar)
    peak, kernel_isa = fma_peak(binary, args.threads)
    # The rate the fraction is taken of: the ISA the kernels run at (scalar: none to compare).
    fma_rate = (peak or {}).get(kernel_isa, {}).get(args.threads)

    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(L, 1, H, T, D, generator=gen).half()
    values = torch.randn(L, 1, H, T, D, generator=gen).half()
    queries = torch.randn(L, HQ, W, D, generator=gen).half()  # post-RoPE window queries
    scale = 1.0 / math.sqrt(D)

    # --- kvpress ------------------------------------------------------------------------------
    class Config:
        num_attention_heads = HQ
        num_key_value_heads = H
        num_hidden_layers = L
        head_dim = D

    class Layer(nn.Module):
        """What a press reads of an attention layer; q_proj passes the queries through."""

        def __init__(self, layer_idx):
            super().__init__()
            self.config, self.head_dim, self.layer_idx = Config(), D, layer_idx
            self.q_proj = nn.Identity()

    modules = [Layer(i) for i in range(L)]
    # Hidden states [1][W + 1][Hq * D]: the last W rows are the window queries (the presses take
    # the last window_size rows; SnapKV asserts more rows than its window).
    hidden = [torch.cat([torch.zeros(1, 1, HQ * D, dtype=torch.float16),
                         queries[i].transpose(0, 1).reshape(1, W, HQ * D)], dim=1)
              for i in range(L)]
    rope = (torch.ones(1, W + 1, D, dtype=torch.float16),
            torch.zeros(1, W + 1, D, dtype=torch.float16))
    from kvpress import (KeyDiffPress, KnormPress, PyramidKVPress, SnapKVPress,
                         StreamingLLMPress, TOVAPress)
    presses = {
        "streaming_llm": StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "keydiff": KeyDiffPress(compression_ratio=ratio),
        "knorm": KnormPress(compression_ratio=ratio),
        "tova": TOVAPress(compression_ratio=ratio),
        "snapkv": SnapKVPress(compression_ratio=ratio, window_size=W, kernel_size=7),
        "pyramidkv": PyramidKVPress(compression_ratio=ratio, window_size=W, kernel_size=7,
                                    beta=20),
    }

    def kvpress_compress(press):
        kept = 0
        with torch.no_grad():
            for i in range(L):
                k, v = press.compress(modules[i], hidden[i], keys[i], values[i], None,
                                      {"position_embeddings": rope})
                kept += k.shape[2]
        return kept

    # --- kvsidecar ----------------------------------------------------------------------------
    pyramid = kvs.common_pb2.LayerAllocator(kind=kvs.common_pb2.LAYER_ALLOCATOR_PYRAMIDKV,
                                            pyramid_beta=20)
    specs = {
        "streaming_llm": kvs.policy("streaming_llm", n_sink=4),
        "keydiff": kvs.policy("keydiff"),
        "knorm": kvs.policy("knorm"),
        "tova": kvs.policy("tova", all_heads=True),
        "snapkv": kvs.policy("snapkv", window=W, kernel_size=7),
        "pyramidkv": kvs.policy("snapkv", allocator=pyramid, window=W, kernel_size=7),
    }
    window = kvs.attention(queries.numpy(), query_positions=list(range(T - W, T)),
                           softmax_scale=scale)
    # TOVA reads the newest query's attention alone (tova.md), so its worker sends just that
    # query; the window policies get the whole window.
    last = kvs.attention(np.ascontiguousarray(queries.numpy()[:, :, -1:]), query_positions=[T - 1],
                         softmax_scale=scale)
    attention_of = {"tova": last, "snapkv": window, "pyramidkv": window}
    # Per layer, K/V block-major as the arena holds them: [T/B][2][H][B][D].
    blocks = [np.ascontiguousarray(
        torch.stack((keys[i, 0], values[i, 0])).view(2, H, T // B, B, D).permute(2, 0, 1, 3, 4)
        .numpy()) for i in range(L)]
    layout = kvs.model_layout(num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                              dtype="fp16", block_tokens=B)
    seq_bytes = L * T * 2 * H * D * 2
    row_bytes = D * 2

    def sidecar_compress(session, name):
        """Compress times (ms) of --repeats fresh copies after an untimed one, the response's
        bytes_copied, and what slot-by-slot hole filling would copy for the same kept sets."""
        times, commits, copied, hole_filling, layer0 = [], [], None, None, None
        for i in range(args.repeats + 1):
            seq = session.create_sequence(policy=specs[name]).sequence_id
            r = session.reserve(seq, T)
            for layer in range(L):
                ids = np.asarray(r.slots(layer).blocks[:T // B])
                session.arena.blocks[ids] = blocks[layer]
            t0 = time.perf_counter()
            session.commit(r)  # checks every written row (and takes KNorm's key norms with it)
            commit_ms = (time.perf_counter() - t0) * 1e3
            first = i == 0
            t0 = time.perf_counter()
            response = session.compress(seq, budget_tokens=budget,
                                        attention=attention_of.get(name),
                                        return_positions=first)
            elapsed = (time.perf_counter() - t0) * 1e3
            if first:
                # Positions are slots before the compress (written in order), so a kept token
                # at position >= kept would have moved into a hole of its layer.
                hole_filling = 0
                for layer in response.layers:
                    pos = np.asarray(layer.positions).reshape(H, layer.kept)
                    hole_filling += int((pos >= layer.kept).sum()) * 2 * row_bytes
                copied = getattr(response, "bytes_copied", None)
                layer0 = np.asarray(response.layers[0].positions).reshape(H, -1)
            else:
                times.append(elapsed)
                commits.append(commit_ms)
            session.release_sequence(seq)
        return (statistics.median(times), statistics.median(commits), copied, hole_filling,
                layer0)

    def kvpress_kept(press):
        """kvpress's kept positions of layer 0, [H][n], from its own score and top-k."""
        with torch.no_grad():
            scores = press.score(modules[0], hidden[0], keys[0], values[0], None,
                                 {"position_embeddings": rope})
        n = press.get_layer_budget(modules[0], T) if hasattr(press, "get_layer_budget") \
            else budget
        return scores[0].topk(n, dim=-1).indices.numpy()

    rows = []
    with LocalServer(binary, extra_args=[
            f"--threads={args.threads}", f"--arena_capacity_bytes={2 * seq_bytes + (256 << 20)}"
    ]) as server, kvs.Client(server.address, timeout=600) as client, \
            client.attach(layout, num_blocks=L * (T // B) + 4 * L) as session:
        for name in [p for p in args.policies.split(",") if p]:
            row = {"policy": name}
            ms, commit_ms, copied, hole_filling, layer0 = sidecar_compress(session, name)
            row["kvsidecar_ms"] = round(ms, 1)
            row["kvsidecar_commit_ms"] = round(commit_ms, 1)
            row["bytes_copied"] = copied
            row["bytes_copied_hole_filling"] = hole_filling
            if not args.sidecar_only:
                press = presses[name]
                kvpress_compress(press)  # warm-up
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    kvpress_compress(press)
                    times.append((time.perf_counter() - t0) * 1e3)
                row["kvpress_ms"] = round(statistics.median(times), 1)
                row["speedup"] = round(row["kvpress_ms"] / row["kvsidecar_ms"], 2)
                # Same kept sets? Layer 0, per head: the share of kvpress's kept positions the
                # sidecar keeps too (ties among equal scores may break differently).
                theirs = kvpress_kept(press)
                row["layer0_kept_agreement"] = round(float(np.mean(
                    [np.isin(theirs[h], layer0[h]).mean() for h in range(H)])), 4)
            if name in ("snapkv", "pyramidkv") and fma_rate:
                flop = 2.0 * L * HQ * W * T * D  # the window's Q.K^T
                row["fma_fraction"] = round(flop / (ms / 1e3) / (fma_rate * 1e9), 3)
                row["fma_isa"] = kernel_isa
            print(json.dumps(row), flush=True)
            rows.append(row)
    # kvpress has no __version__; the installed distribution's metadata names it.
    try:
        kvpress_version = importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        kvpress_version = getattr(kvpress, "__version__", "?")
    result = {"torch": torch.__version__, "kvpress": kvpress_version,
              "threads": args.threads, "fma_peak_gflops": peak, "kernel_isa": kernel_isa,
              "shape": {"layers": L, "tokens": T, "budget": budget, "kv_heads": H,
                        "q_heads": HQ, "head_dim": D, "window": W, "dtype": "fp16"},
              "repeats": args.repeats, "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(f"{'policy':<14} {'kvpress':>10} {'kvsidecar':>10} {'ratio':>7} "
          f"{'copied':>10} {'hole-fill':>10} {'commit':>9}")
    for row in rows:
        copied = row["bytes_copied"]
        print(f"{row['policy']:<14} {row.get('kvpress_ms', float('nan')):>8.0f}ms "
              f"{row['kvsidecar_ms']:>8.1f}ms {row.get('speedup', float('nan')):>6.1f}x "
              f"{'?' if copied is None else f'{copied / 2**20:.2f}':>8}MB "
              f"{row['bytes_copied_hole_filling'] / 2**20:>8.2f}MB "
              f"{row['kvsidecar_commit_ms']:>7.1f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
