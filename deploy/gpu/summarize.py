#!/usr/bin/env python3
"""The figures table of deploy/gpu/check.sh: reads the JSON the steps left in WORK_DIR
(cuda_bench.json, torch_bench.json, decode_cuda.json, decode_cpu.json, spill.json, arena.json) and prints
markdown. A missing file prints a line saying the step left no figures.

  summarize.py WORK_DIR
"""

import json
import sys
from pathlib import Path

TARGETS = {  # cuda_bench counter -> (what, target)
    "BM_Gather": ("of_memcpy", 0.7, "gather (CopyRows) / device-to-device copy"),
    "BM_KeyDiffScores": ("of_memcpy", 0.7, "KeyDiff scoring / device-to-device copy"),
    "BM_AttentionWindow": ("of_gemm", 0.5, "attention window / cuBLAS GEMM of the same shape"),
    "BM_TopK": ("us_per_row", None, "top-k 32K -> 4K, us per (sequence, layer, head) row"),
}


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def benchmarks(data):
    return {b["name"].split("/")[0]: b for b in (data or {}).get("benchmarks", [])}


def main():
    work = Path(sys.argv[1])
    print("## cuda_bench (figures are ratios to a limit measured in the same run)\n")
    bench = benchmarks(load(work / "cuda_bench.json"))
    if not bench:
        print("cuda_bench left no figures (see cuda_bench.log)\n")
    else:
        print("| benchmark | what | time | figure | target | met |")
        print("|---|---|---|---|---|---|")
        for name, (counter, target, what) in TARGETS.items():
            b = bench.get(name)
            if b is None:
                print(f"| {name} | {what} | — | not run | {target or '—'} | |")
                continue
            if b.get("error_occurred"):
                print(f"| {name} | {what} | — | error: {b.get('error_message')} | "
                      f"{target or '—'} | ✘ |")
                continue
            value = b.get(counter)
            met = "" if target is None or value is None else ("✔" if value >= target else "✘")
            shown = f"{value:.3f}" if isinstance(value, (int, float)) else "—"
            print(f"| {name} | {what} | {b['real_time']:.3f} {b['time_unit']} | {counter} "
                  f"{shown} | {('≥ ' + str(target)) if target else '—'} | {met} |")
        print()

    print("## Each policy's whole compress: kvsidecar (CUDA) vs PyTorch on the same GPU\n")
    torch_bench = load(work / "torch_bench.json")
    if not torch_bench:
        print("torch_compress_bench left no figures (see torch_bench.log)\n")
    else:
        s = torch_bench["shape"]
        print(f"{s['layers']} layers x {s['tokens']} tokens -> {s['budget']}, H={s['kv_heads']}, "
              f"Hq={s['q_heads']}, D={s['head_dim']}, {s['dtype']}; median of "
              f"{torch_bench['repeats']}; torch {torch_bench['torch']}\n")
        print("| policy | kvsidecar compress | PyTorch | PyTorch / kvsidecar | target ≥ 2 |")
        print("|---|---|---|---|---|")
        for r in torch_bench["rows"]:
            side = (f"{r['kvsidecar_ms']:.2f} ms" if "kvsidecar_ms" in r
                    else r.get("kvsidecar_error", "—"))
            ref = f"{r['torch_ms']:.2f} ms" if "torch_ms" in r else r.get("torch_error", "—")
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "—"
            met = "" if "speedup" not in r else ("✔" if r["speedup"] >= 2 else "✘")
            print(f"| {r['policy']} | {side} | {ref} | {speed} | {met} |")
        print()

    print("## DecodeStep, 64 sequences x 32 layers (H2O at budget 512, K/V + query inline)\n")
    rows = []
    for backend in ("cuda", "cpu"):
        b = benchmarks(load(work / f"decode_{backend}.json")).get("BM_DecodeStep")
        if b is None:
            rows.append(f"| {backend} | — | — | — | no figures |")
        elif b.get("error_occurred"):
            rows.append(f"| {backend} | — | — | — | error: {b.get('error_message')} |")
        else:
            rows.append(f"| {backend} | {b['step_p50_us'] / 1e3:.2f} ms | "
                        f"{b['step_p99_us'] / 1e3:.2f} ms | {b['request_MiB']:.1f} MiB | |")
    print("| backend | p50 | p99 | request | note |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print()

    print("## Spill and restore of 256 MiB, CUDA arena <-> host tier (storage_bench)\n")
    spill = benchmarks(load(work / "spill.json"))
    if not spill:
        print("storage_bench left no figures (see decode.log)\n")
    else:
        def seconds(name):
            b = spill.get(name)
            if b is None or b.get("error_occurred"):
                return None
            scale = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}[b["time_unit"]]
            return b["real_time"] * scale

        print("| operation | time | GB/s | limit (same run) | of limit |")
        print("|---|---|---|---|---|")
        for name, limit in (("BM_SpillHost", "BM_ArenaRead256MiB"),
                            ("BM_RestoreHost", "BM_ArenaWrite256MiB"),
                            ("BM_ArenaRead256MiB_Pageable", "BM_ArenaRead256MiB"),
                            ("BM_ArenaWrite256MiB_Pageable", "BM_ArenaWrite256MiB")):
            t, lim = seconds(name), seconds(limit)
            if t is None:
                print(f"| {name} | — | — | {limit} | |")
                continue
            ratio = f"{lim / t:.2f}" if lim else "—"
            print(f"| {name} | {t * 1e3:.2f} ms | {(256 << 20) / t / 1e9:.1f} | {limit} "
                  f"({(256 << 20) / lim / 1e9:.1f} GB/s) | {ratio} |" if lim else
                  f"| {name} | {t * 1e3:.2f} ms | {(256 << 20) / t / 1e9:.1f} | — | — |")
        print()

    arena = load(work / "arena.json")
    print("## Python CudaArena (torch views over CUDA IPC)\n")
    if not arena:
        print("cuda_arena_check left no figures (see python.log)")
    else:
        print(f"failures: {arena.get('failures') or 'none'}; compress "
              f"keydiff {arena.get('keydiff_compress_ms', float('nan')):.2f} ms, "
              f"h2o {arena.get('h2o_compress_ms', float('nan')):.2f} ms (4 layers x 1024 -> 256); "
              f"sidecar device memory {arena.get('server_mib_before')} -> "
              f"{arena.get('server_mib_attached')} -> {arena.get('server_mib_after_detach')} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
