#!/usr/bin/env python3
"""Quality of the sidecar's KV-compression policies on a real model (SmolLM2-135M-Instruct).

For every policy x budget (a fraction of the prompt, in tokens per layer), with the full cache as
the reference:
  1. retrieval: a pass key hidden at several depths of a filler text; accuracy of the greedy
     answer;
  2. fidelity: teacher-forced continuation of natural English text (data/alice_ch1.txt): mean
     KL(full || compressed) of the next-token distributions and top-1 agreement;
  3. memory: KV bytes the sidecar holds per sequence vs a full cache.
The prompt is prefilled once per input with the full cache (recorded), then replayed into one
sidecar sequence per configuration (Reserve / zero-copy write / Commit with the queries, as the
worker does), compressed to the budget by the sidecar, and decoded through DecodeStep.

Writes results.csv, results.md and PNG plots (matplotlib, if installed) to --out, with the
command line in results.md. `--small` is the quick configuration the test suite runs.

    python bench/quality/run.py --kvsidecar-bin build/service/kvsidecar
"""

import argparse
import csv
import math
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
PASSKEYS = ["71432", "29514", "86037", "40968", "13579"]


def passkey_prompt(tok, n_filler: int, depth: float, key: str):
    parts = [FILLER] * n_filler
    parts.insert(int(round(depth * n_filler)),
                 f"The pass key is {key}. Remember it. {key} is the pass key. ")
    body = ("There is important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. " + "".join(parts))
    return tok.encode(tok.chat_prompt(body + "\nWhat is the pass key?")) + tok.encode(
        "The pass key is")


def n_filler_for(tok, context: int) -> int:
    base = len(passkey_prompt(tok, 0, 0.0, PASSKEYS[0]))
    per = len(tok.encode(FILLER))
    return max(1, (context - base) // per)


def main(argv=None):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="streaming_llm,keydiff,h2o,tova,snapkv,cake,d2o,caote")
    ap.add_argument("--budgets", default="0.1,0.25,0.5", help="fractions of the prompt")
    ap.add_argument("--context", type=int, default=1024, help="passkey prompt tokens (about)")
    ap.add_argument("--depths", default="0.1,0.5,0.9", help="passkey depths")
    ap.add_argument("--fidelity-prompt", type=int, default=768, help="tokens of text as prompt")
    ap.add_argument("--fidelity-continuation", type=int, default=64, help="tokens scored")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtype", default="fp16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--server", help="address of a running sidecar")
    ap.add_argument("--kvsidecar-bin", help="start a private sidecar (default $KVSIDECAR_BIN)")
    ap.add_argument("--small", action="store_true",
                    help="quick: 2 policies, budget 25%%, 256-token prompts, 1 depth")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if args.small:
        args.policies, args.budgets, args.context, args.depths = "streaming_llm,snapkv", "0.25", \
            256, "0.5"
        args.fidelity_prompt, args.fidelity_continuation = 256, 16

    import kvsidecar as kvs
    from kvsidecar.model import load_model
    from kvsidecar.model.replay import RecordingCache, replay
    from kvsidecar.model.sidecar_cache import (SidecarKVCache, blocks_needed, layout_for,
                                               policy_spec)
    from kvsidecar.model.worker import kl_and_top1

    policies = [p for p in args.policies.split(",") if p]
    budgets = [float(b) for b in args.budgets.split(",") if b]
    depths = [float(d) for d in args.depths.split(",") if d]
    model, tok = load_model()
    cfg = model.cfg
    stops = [tok.im_end_id, tok.eos_id]
    t_start = time.perf_counter()

    # Inputs, recorded once with the full cache.
    inputs = []  # (task, depth, key, prompt, blocks, last_logits, reference)
    nf = n_filler_for(tok, args.context)
    for i, depth in enumerate(depths):
        key = PASSKEYS[i % len(PASSKEYS)]
        prompt = passkey_prompt(tok, nf, depth, key)
        rec = RecordingCache(cfg, len(prompt) + 16)
        logits = model.prefill(prompt, rec, args.block_size, align_last=True)
        blocks = list(rec.blocks)
        ref = model.decode(rec, logits, len(prompt), len(key) + 2, stops)
        inputs.append(("passkey", depth, key, prompt, blocks, logits, ref))
    text = open(os.path.join(HERE, "data", "alice_ch1.txt"), encoding="utf-8").read()
    ids = tok.encode(text)
    need = args.fidelity_prompt + args.fidelity_continuation
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {need}")
    prompt, cont = ids[: args.fidelity_prompt], ids[args.fidelity_prompt: need]
    rec = RecordingCache(cfg, need)
    logits = model.prefill(prompt, rec, args.block_size, align_last=True)
    blocks = list(rec.blocks)
    ref = model.decode(rec, logits, len(prompt), len(cont), forced=cont)
    inputs.append(("fidelity", float("nan"), "", prompt, blocks, logits, ref))

    rows = []
    for task, depth, key, prompt, _, _, ref in inputs:  # the full-cache reference rows
        full_bytes = len(prompt) * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * \
            kvs.dtype_bytes(layout_for(cfg, args.dtype).dtype)
        row = dict(task=task, policy="full", budget_frac=1.0, budget_tokens=len(prompt),
                   depth=depth, prompt_tokens=len(prompt), kv_bytes_kept=full_bytes,
                   kv_bytes_full=full_bytes, error="")
        if task == "passkey":
            answer = tok.decode(ref.tokens)
            row.update(correct=int(key in answer), answer=answer.strip())
        else:
            row.update(mean_kl=0.0, top1=1.0)
        rows.append(row)

    from kvsidecar.server import LocalServer
    server = None
    address = args.server
    if not address:
        server = LocalServer(args.kvsidecar_bin, extra_args=["--arena_capacity_bytes=2G"])
        address = server.address
    try:
        max_prompt = max(len(x[3]) for x in inputs)
        nblocks = blocks_needed(cfg, max_prompt + args.fidelity_continuation + args.block_size)
        with kvs.Client(address, timeout=120, worker_name="bench/quality") as client, \
                client.attach(layout_for(cfg, args.dtype), num_blocks=nblocks) as session:
            for pol in policies:
                for frac in budgets:
                    for task, depth, key, prompt, blocks, logits, ref in inputs:
                        budget = max(1, int(round(frac * len(prompt))))
                        spec = policy_spec(pol, budget)
                        row = dict(task=task, policy=pol, budget_frac=frac, budget_tokens=budget,
                                   depth=depth, prompt_tokens=len(prompt), error="")
                        cache = None
                        try:
                            cache = SidecarKVCache(session, cfg, spec, budget, "full")
                            replay(blocks, cache)
                            cache.finish_prefill()
                            row["kv_bytes_kept"] = cache.kv_bytes()
                            row["kv_bytes_full"] = cache.full_kv_bytes()
                            if task == "passkey":
                                gen = model.decode(cache, logits, len(prompt), len(key) + 2, stops)
                                answer = tok.decode(gen.tokens)
                                row.update(correct=int(key in answer), answer=answer.strip())
                            else:
                                gen = model.decode(cache, logits, len(prompt), len(ref.tokens),
                                                   forced=ref.tokens)
                                # Step 0 comes from the (full) prefill itself: score 1.. only.
                                kl, top1 = kl_and_top1(ref.logits[1:], gen.logits[1:])
                                row.update(mean_kl=kl, top1=top1)
                        except kvs.KvsError as e:
                            row["error"] = f"{type(e).__name__}: {e}"[:300]
                        finally:
                            if cache is not None:
                                try:
                                    cache.release()
                                except kvs.KvsError:
                                    pass
                        rows.append(row)
                        print(_row_line(row), flush=True)
    finally:
        if server is not None:
            server.close()
    elapsed = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    command = "python bench/quality/run.py " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:]))
    write_csv(rows, os.path.join(args.out, "results.csv"))
    table = summarize(rows, policies, budgets)
    write_markdown(table, rows, os.path.join(args.out, "results.md"), command, elapsed, args,
                   inputs)
    if not args.no_plots:
        plot(table, policies, args.out)
    print(f"wrote {args.out}/results.csv, results.md in {elapsed:.0f} s")
    return 0


def _row_line(row):
    if row["error"]:
        return f"{row['task']:8s} {row['policy']:13s} {row['budget_frac']:.2f} ERROR {row['error']}"
    if row["task"] == "passkey":
        return (f"passkey  {row['policy']:13s} {row['budget_frac']:.2f} depth {row['depth']:.2f} "
                f"{'OK ' if row['correct'] else 'BAD'} {row['answer']!r}")
    return (f"fidelity {row['policy']:13s} {row['budget_frac']:.2f} KL {row['mean_kl']:.4f} "
            f"top1 {row['top1']:.3f} kept {row['kv_bytes_kept']}/{row['kv_bytes_full']}")


FIELDS = ["task", "policy", "budget_frac", "budget_tokens", "depth", "prompt_tokens", "correct",
          "answer", "mean_kl", "top1", "kv_bytes_kept", "kv_bytes_full", "error"]


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def summarize(rows, policies, budgets):
    """{(policy, frac): dict(passkey_acc, mean_kl, top1, mem_ratio, errors)}"""
    table = {}
    for pol in ["full"] + policies:
        for frac in ([1.0] if pol == "full" else budgets):
            rs = [r for r in rows if r["policy"] == pol and r["budget_frac"] == frac]
            ok = [r for r in rs if not r["error"]]
            pk = [r["correct"] for r in ok if r["task"] == "passkey"]
            fi = [r for r in ok if r["task"] == "fidelity"]
            mem = [r["kv_bytes_kept"] / r["kv_bytes_full"] for r in ok if r.get("kv_bytes_full")]
            table[(pol, frac)] = dict(
                passkey_acc=sum(pk) / len(pk) if pk else float("nan"),
                mean_kl=fi[0]["mean_kl"] if fi else float("nan"),
                top1=fi[0]["top1"] if fi else float("nan"),
                mem_ratio=sum(mem) / len(mem) if mem else float("nan"),
                errors=len(rs) - len(ok), error=next((r["error"] for r in rs if r["error"]), ""))
    return table


def _fmt(x, spec):
    return "n/a" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def write_markdown(table, rows, path, command, elapsed, args, inputs):
    lines = ["# KV compression quality on SmolLM2-135M-Instruct", "",
             f"Command: `{command}` ({elapsed:.0f} s). K/V dtype in the sidecar: {args.dtype}; "
             f"prefill in blocks of {args.block_size}, the whole prompt in, then one compression "
             "to the budget (\"full\" prefill mode), then greedy decode through DecodeStep.", ""]
    pk = [x for x in inputs if x[0] == "passkey"]
    fi = [x for x in inputs if x[0] == "fidelity"][0]
    lines += [f"- Retrieval: pass key at depths {', '.join(f'{x[1]:.2f}' for x in pk)} of a "
              f"{len(pk[0][3])}-token prompt; accuracy of the greedy answer.",
              f"- Fidelity: {len(fi[3])} tokens of data/alice_ch1.txt as prompt, the next "
              f"{len(fi[6].tokens)} teacher-forced; mean KL(full || compressed) in nats and top-1 "
              "agreement over steps 2.. (step 1 comes from the prefill itself).",
              "- Memory: KV bytes the sidecar holds per sequence after compression / full.", "",
              "| policy | budget | passkey acc | mean KL | top-1 | KV kept / full | errors |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (pol, frac), s in table.items():
        err = f"{s['errors']}: {s['error'][:80]}" if s["errors"] else ""
        lines.append(f"| {pol} | {frac:.0%} | {_fmt(s['passkey_acc'], '.2f')} | "
                     f"{_fmt(s['mean_kl'], '.4f')} | {_fmt(s['top1'], '.3f')} | "
                     f"{_fmt(s['mem_ratio'], '.3f')} | {err} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(table, policies, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return
    for metric, label, fname in (("passkey_acc", "pass-key accuracy", "passkey.png"),
                                 ("mean_kl", "mean KL(full || compressed), nats", "kl.png"),
                                 ("top1", "top-1 agreement with the full cache", "top1.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for pol in policies:
            pts = sorted((f, s[metric]) for (p, f), s in table.items() if p == pol)
            if pts:
                ax.plot([100 * f for f, _ in pts], [v for _, v in pts], marker="o", label=pol)
        full = table.get(("full", 1.0), {}).get(metric)
        if full is not None and not math.isnan(full):
            ax.axhline(full, color="gray", linestyle="--", label="full cache")
        ax.set_xlabel("budget, % of the prompt (tokens per layer)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
