#!/usr/bin/env python3
"""Each policy's whole compress in kvsidecar's CUDA backend against an idiomatic PyTorch one on the
same tensors and the same GPU (issue 16; run by deploy/gpu/check.sh).

Shape (bench/README.md, issue 3's): one sequence of --tokens tokens (8192) in --layers layers (32),
8 kv heads, 32 query heads, head dim 128, fp16, block 16, compressed to --budget (2048) tokens per
layer; the attention policies get the queries of a 32-token window at the end.

- kvsidecar: `kvsidecar --backend=cuda` ($KVSIDECAR_BIN) owns the arena; this process writes the
  K/V into it through the CudaArena's torch views (device to device), commits, and times the
  Compress call (scores, top-k, compaction in place, every layer; the response arrives when the
  device work is done), wall clock around the RPC. The queries travel inline in the request.
- PyTorch: the same K/V as contiguous [L][H][T][D] tensors (the layout kvpress works on), per layer
  as kvpress's presses do: scores with tensor ops, `topk`, `gather` into a new [H][budget][D] cache.
  Timed with CUDA events around the whole loop over layers.
Medians of --repeats after one warm-up each. The figure is torch time / kvsidecar time (target
>= 2). Policies without a PyTorch version here (cake, caote, d2o) report the kvsidecar time only.

  torch_compress_bench.py [--kvsidecar BIN] [--policies a,b] [--json FILE] [--server-log FILE]
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

H, HQ, D, B, W = 8, 32, 128, 16, 32
GROUP = HQ // H


# --- PyTorch reference implementations (kvpress style) --------------------------------------------

def window_attention(keys, queries, scale):
    """softmax(q . k * scale) of the window queries over every key, causal within the window:
    [Hq][W][T] in fp32. keys [H][T][D], queries [Hq][W][D]."""
    t = keys.shape[1]
    k = keys.repeat_interleave(GROUP, dim=0)  # [Hq][T][D]
    logits = torch.matmul(queries, k.transpose(1, 2)).float() * scale  # [Hq][W][T]
    q_pos = torch.arange(t - W, t, device=keys.device)
    k_pos = torch.arange(t, device=keys.device)
    logits.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def scores_streaming_llm(keys, queries, scale, budget, n_sink=4):
    t = keys.shape[1]
    scores = torch.zeros(H, t, device=keys.device)
    scores[:, :n_sink] = 1.0
    scores[:, t - (budget - n_sink):] = 1.0
    return scores


def scores_keydiff(keys, queries, scale, budget):
    anchor = F.normalize(keys.float(), p=2, dim=-1).mean(dim=1, keepdim=True)  # [H][1][D]
    return -F.cosine_similarity(keys.float(), anchor, dim=-1)  # [H][T]


def scores_h2o(keys, queries, scale, budget, n_recent=None):
    attn = window_attention(keys, queries, scale)  # [Hq][W][T]
    scores = attn.sum(dim=1).view(H, GROUP, -1).sum(dim=1)  # accumulated attention per kv head
    recent = n_recent if n_recent is not None else budget // 2
    scores[:, -recent:] = float("inf")
    return scores


def scores_tova(keys, queries, scale, budget):
    t = keys.shape[1]
    k = keys.repeat_interleave(GROUP, dim=0)
    logits = torch.matmul(queries[:, -1:], k.transpose(1, 2)).float() * scale  # [Hq][1][T]
    attn = torch.softmax(logits, dim=-1)
    return attn[:, 0].view(H, GROUP, t).mean(dim=1)


def scores_snapkv(keys, queries, scale, budget, kernel=7):
    attn = window_attention(keys, queries, scale)[..., :-W]  # [Hq][W][T-W]
    scores = attn.mean(dim=1).view(H, GROUP, -1).mean(dim=1)  # [H][T-W]
    scores = F.avg_pool1d(scores[:, None], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0]
    return F.pad(scores, (0, W), value=float("inf"))  # the window is always kept


TORCH_POLICIES = {
    "streaming_llm": scores_streaming_llm,
    "keydiff": scores_keydiff,
    "h2o": scores_h2o,
    "tova": scores_tova,
    "snapkv": scores_snapkv,
}
ATTENTION_POLICIES = {"h2o", "tova", "snapkv", "cake", "caote", "d2o"}


def torch_compress(keys, values, queries, scale, budget, score_fn):
    """kvpress's compress for every layer: scores, top-k, gather into a new cache."""
    out = []
    for layer in range(keys.shape[0]):
        k, v = keys[layer], values[layer]
        scores = score_fn(k, queries[layer], scale, budget)
        idx = scores.topk(budget, dim=-1).indices.sort(dim=-1).values  # [H][budget], in order
        idx = idx.unsqueeze(-1).expand(-1, -1, D)
        out.append((k.gather(1, idx), v.gather(1, idx)))
    return out


def time_torch(fn, repeats):
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# --- kvsidecar -------------------------------------------------------------------------------------

def block_major(keys, values):
    """Per layer, K/V as the arena's blocks hold them: [T/B][2][H][B][D]."""
    L, _, T, _ = keys.shape
    return [torch.stack((keys[layer], values[layer])).view(2, H, T // B, B, D)
            .permute(2, 0, 1, 3, 4).contiguous() for layer in range(L)]


def sidecar_compress_ms(kvs, session, name, blocks, attention, budget, repeats):
    """Median wall time of the Compress RPC over `repeats` fresh copies of the sequence."""
    arena = session.arena
    stream = torch.cuda.Stream(device=arena.device)
    tokens = blocks[0].shape[0] * B
    times = []
    for i in range(repeats + 1):
        seq = session.create_sequence(policy=kvs.policy(name)).sequence_id
        r = session.reserve(seq, tokens)
        with torch.cuda.stream(stream):
            # One index_copy_ per layer into the arena's block view (device to device).
            for layer, src in enumerate(blocks):
                slots = r.slots(layer)
                if slots.first_slot != 0:
                    raise RuntimeError(f"layer {layer}: a fresh sequence starts at slot 0")
                ids = torch.tensor(list(slots.blocks[:src.shape[0]]), device=src.device)
                arena.blocks.index_copy_(0, ids, src)
        stream.synchronize()
        session.commit(r)
        t0 = time.perf_counter()
        response = session.compress(seq, budget_tokens=budget, attention=attention)
        elapsed = (time.perf_counter() - t0) * 1e3
        if i > 0:  # the first warms up
            times.append(elapsed)
        kept = [layer.kept for layer in response.layers] if response.layers else [budget]
        # CAKE and D2O split the budget between layers: no one count per layer to check.
        if name not in ("cake", "d2o") and set(kept) != {budget}:
            raise RuntimeError(f"{name}: kept {sorted(set(kept))} tokens per layer, not {budget}")
        session.release_sequence(seq)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvsidecar", default=os.environ.get("KVSIDECAR_BIN"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies",
                        default="streaming_llm,keydiff,tova,snapkv,h2o,cake,caote,d2o")
    parser.add_argument("--json")
    parser.add_argument("--server-log",
                        help="append the sidecar's stderr here at the end (with KVS_STAGING_TRACE=1 "
                             "in the environment: one line per staged backend call)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch")
        return 1
    import kvsidecar as kvs
    from kvsidecar.server import LocalServer

    L, T = args.layers, args.tokens
    gen = torch.Generator(device="cuda").manual_seed(3)
    keys = torch.randn(L, H, T, D, device="cuda", dtype=torch.float16, generator=gen)
    values = torch.randn(L, H, T, D, device="cuda", dtype=torch.float16, generator=gen)
    queries = torch.randn(L, HQ, W, D, device="cuda", dtype=torch.float16, generator=gen)
    scale = 1.0 / math.sqrt(D)
    blocks = block_major(keys, values)
    attention = kvs.attention(queries.cpu().numpy(), query_positions=list(range(T - W, T)),
                              softmax_scale=scale)
    layout = kvs.model_layout(num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                              dtype="fp16", block_tokens=B)
    seq_bytes = L * (T // B) * 2 * H * B * D * 2
    rows = []
    with LocalServer(args.kvsidecar, extra_args=[
            "--backend=cuda", f"--arena_capacity_bytes={2 * seq_bytes + (256 << 20)}"]) as server, \
            kvs.Client(server.address, timeout=300) as client, \
            client.attach(layout, num_blocks=L * (T // B) + 4 * L) as session:
        logged = 0  # characters of the sidecar's stderr already in --server-log
        for name in [p for p in args.policies.split(",") if p]:
            row = {"policy": name}
            try:
                row["kvsidecar_ms"] = sidecar_compress_ms(
                    kvs, session, name, blocks,
                    attention if name in ATTENTION_POLICIES else None, args.budget, args.repeats)
            except Exception as e:  # noqa: BLE001 (recorded, the next policy runs)
                row["kvsidecar_error"] = f"{type(e).__name__}: {e}"
            fn = TORCH_POLICIES.get(name)
            if fn is not None:
                try:
                    row["torch_ms"] = time_torch(
                        lambda: torch_compress(keys, values, queries, scale, args.budget, fn),
                        args.repeats)
                except Exception as e:  # noqa: BLE001
                    row["torch_error"] = f"{type(e).__name__}: {e}"
            if "kvsidecar_ms" in row and "torch_ms" in row:
                row["speedup"] = row["torch_ms"] / row["kvsidecar_ms"]  # target >= 2
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.server_log:  # what the sidecar wrote while this policy ran
                text = server.stderr()
                with open(args.server_log, "a") as f:
                    f.write(f"## kvsidecar stderr, policy {name}\n{text[logged:]}")
                logged = len(text)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "shape": {"layers": L, "tokens": T, "budget": args.budget, "kv_heads": H,
                        "q_heads": HQ, "head_dim": D, "window": W, "dtype": "fp16"},
              "repeats": args.repeats, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all("kvsidecar_error" not in r and "torch_error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
