#!/usr/bin/env python3
"""Tables, summary and plots of the quality harness, from its results.csv alone.

    python bench/quality/report.py --out bench/quality/results

results.md: per model, protocol and context, a table of accuracy per task (exact match, mean
with its 95 % bootstrap CI over the samples) and fidelity (mean KL and top-1 agreement against
the full cache) for every configuration; then which configuration wins at each budget and by how
much (the paired bootstrap CI of the difference to the runner-up, over the same prompts).
Plots: one PNG per model and context, one panel per task, accuracy against budget, a line per
configuration (sidecar solid, kvpress dashed, each with its own marker), the full cache as a
horizontal line.
"""

import argparse
import os
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scoring  # noqa: E402

TASK_ORDER = ["niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe"]


def _load(path: str) -> List[Dict[str, str]]:
    return scoring.ResultStore(path).rows


def _label(r) -> str:
    return r["policy"] if r["method"] != "kvpress" else "kvpress:" + r["policy"]


def aggregate(rows):
    """(model, task, context, protocol, label, budget) -> dict of per-sample values."""
    cells: Dict[Tuple, Dict] = {}
    for r in rows:
        key = (r["model"], r["task"], int(r["context"]), r["protocol"], _label(r),
               float(r["budget"]))
        c = cells.setdefault(key, {"correct": {}, "kl": {}, "top1": {}, "kept": [],
                                   "error": "", "truncated": 0, "params": r["params"]})
        if r["error"]:
            c["error"] = r["error"]
            continue
        s = int(r["sample"])
        if r["correct"] != "":
            c["correct"][s] = float(r["correct"])
        if r["kl"] != "":
            c["kl"][s] = float(r["kl"])
            c["top1"][s] = float(r["top1"])
        if r["kept_fraction"] != "":
            c["kept"].append(float(r["kept_fraction"]))
        c["truncated"] += r["truncated"] == "1"
    return cells


def _acc(c) -> str:
    if c["error"]:
        return "n/a"
    vals = list(c["correct"].values())
    if not vals:
        return ""
    m, lo, hi = scoring.bootstrap_ci(vals)
    return f"{m:.2f} [{lo:.2f}, {hi:.2f}]"


def _with_full(cells, model, task, context, protocol):
    """Rows of one table: the full cache is computed once (protocol "prefill") and shown in
    every protocol's table."""
    out = {}
    for (m, t, ctx, proto, label, b), c in cells.items():
        if (m, t, ctx) != (model, task, context):
            continue
        if proto == protocol or label == "full":
            out[(label, b)] = c
    return out


def write(out_dir: str, command: str = "", elapsed: float = 0.0, plots: bool = True) -> str:
    rows = _load(os.path.join(out_dir, "results.csv"))
    cells = aggregate(rows)
    models = sorted({k[0] for k in cells})
    lines = ["# KV-cache compression quality: sidecar policies and kvpress", ""]
    if command:
        lines += [f"Command: `{command}`" + (f" ({elapsed:.0f} s)" if elapsed else ""), ""]
    lines += [
        "Accuracy: exact match of the greedy answer line (mean over samples, 95 % bootstrap CI). "
        "Fidelity: teacher-forced continuation of each text after a compressed prompt, mean "
        "KL(full || compressed) in nats and top-1 agreement with the full cache (mean over the "
        "texts). kept: mean K/V held per layer at the end of decoding, as a fraction of the "
        "prompt (the decoded tokens included; the full cache is above 1). Protocol `prefill`: compressed once "
        "after the prefill, no eviction while decoding (kvpress's protocol); `decode`: the "
        "budget is held at every decode step (the sidecar's DecodeStep). Never compare rows "
        "across protocols.", ""]
    params = {}
    for (m, t, ctx, proto, label, b), c in cells.items():
        params.setdefault((label, proto), c["params"])
    summary_lines: List[str] = []
    for model in models:
        protos = sorted({k[3] for k in cells if k[0] == model and k[4] != "full"}) or ["prefill"]
        contexts = sorted({k[2] for k in cells if k[0] == model and k[1] != "fidelity"})
        tasks = [t for t in TASK_ORDER if any(k[1] == t for k in cells if k[0] == model)]
        fid_ctx = sorted({k[2] for k in cells if k[0] == model and k[1] == "fidelity"})
        for proto in protos:
            for context in contexts:
                lines += [f"## {model}, protocol `{proto}`, {context}-token prompts", ""]
                head = ["configuration", "budget"] + tasks + ["mean acc"]
                if fid_ctx:
                    head += [f"KL ({fid_ctx[-1]} tok)", "top-1"]
                head += ["kept", "n"]
                lines += ["| " + " | ".join(head) + " |",
                          "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
                confs = set()
                for t in tasks:
                    confs |= set(_with_full(cells, model, t, context, proto))
                for label, b in sorted(confs, key=lambda x: (x[1] if x[0] != "full" else 2,
                                                             x[0].startswith("kvpress"),
                                                             x[0])):
                    cols = [label, "100%" if label == "full" else f"{b:.0%}"]
                    all_vals, kept, ns = [], [], []
                    for t in tasks:
                        c = _with_full(cells, model, t, context, proto).get((label, b))
                        cols.append(_acc(c) if c else "")
                        if c and not c["error"]:
                            all_vals += list(c["correct"].values())
                            kept += c["kept"]
                            ns.append(len(c["correct"]))
                    cols.append(f"{sum(all_vals) / len(all_vals):.3f}" if all_vals else "")
                    if fid_ctx:
                        f = _with_full(cells, model, "fidelity", fid_ctx[-1], proto).get(
                            (label, b))
                        if f and f["kl"] and not f["error"]:
                            kls = list(f["kl"].values())
                            cols += [f"{sum(kls) / len(kls):.4f}",
                                     f"{sum(f['top1'].values()) / len(f['top1']):.3f}"]
                        else:
                            cols += ["n/a" if f and f["error"] else "", ""]
                    cols.append(f"{sum(kept) / len(kept):.3f}" if kept else "")
                    cols.append(f"{min(ns)}" if ns else "")
                    lines.append("| " + " | ".join(cols) + " |")
                lines.append("")
                summary_lines += summarize(cells, model, proto, context, tasks)
    errors = sorted({(k[4], c["error"]) for k, c in cells.items() if c["error"]})
    if errors:
        lines += ["Not run (stated, not measured):", ""]
        lines += [f"- `{label}`: {err}" for label, err in errors]
        lines.append("")
    lines += ["## Which configuration wins", ""] + summary_lines
    lines += [""] + never_worse(cells)
    lines += ["## Parameters of each configuration", "",
              "| configuration | protocol | parameters |", "|---|---|---|"]
    lines += [f"| {label} | {proto} | {p} |" for (label, proto), p in sorted(params.items())]
    lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    if plots:
        plot(cells, out_dir)
    return text


def summarize(cells, model, proto, context, tasks) -> List[str]:
    """Per budget: the configuration with the best mean accuracy over every sample of every task
    (paired samples), and its lead over the runner-up with a paired bootstrap CI."""
    out = []
    budgets = sorted({k[5] for k in cells if k[0] == model and k[3] == proto and k[2] == context
                      and k[4] != "full"})
    for b in budgets:
        per: Dict[str, Dict[Tuple[str, int], float]] = defaultdict(dict)
        for (m, t, ctx, p, label, bb), c in cells.items():
            if (m, ctx, p, bb) == (model, context, proto, b) and t in tasks and not c["error"]:
                for s, v in c["correct"].items():
                    per[label][(t, s)] = v
        if len(per) < 2:
            continue
        common = set.intersection(*(set(v) for v in per.values()))
        if not common:
            continue
        keys = sorted(common)
        means = sorted(((sum(per[lab][k] for k in keys) / len(keys), lab) for lab in per),
                       reverse=True)
        (m1, best), (m2, second) = means[0], means[1]
        d, lo, hi = scoring.paired_bootstrap_diff([per[best][k] for k in keys],
                                                  [per[second][k] for k in keys])
        sig = "significant" if lo > 0 else "not significant (the CI contains 0)"
        out.append(f"- {model}, `{proto}`, {context} tokens, budget {b:.0%}: **{best}** "
                   f"{m1:.3f} vs {second} {m2:.3f} (+{d:.3f}, 95 % CI [{lo:+.3f}, {hi:+.3f}], "
                   f"{sig}; {len(keys)} paired samples over {len(tasks)} tasks)")
        for t in tasks:
            tk = [k for k in keys if k[0] == t]
            if not tk:
                continue
            tm = sorted(((sum(per[lab][k] for k in tk) / len(tk), lab) for lab in per),
                        reverse=True)
            (a1, w1), (a2, w2) = tm[0], tm[1]
            dd, l2, h2 = scoring.paired_bootstrap_diff([per[w1][k] for k in tk],
                                                       [per[w2][k] for k in tk])
            out.append(f"  - {t}: {w1} {a1:.2f} vs {w2} {a2:.2f} (+{dd:.2f}, CI "
                       f"[{l2:+.2f}, {h2:+.2f}])")
    return out


# kvpress's press -> the sidecar rows of the same policy (its settings, best first chosen per cell).
# The `_kvpress` / `_observed` rows are the sidecar's options that reproduce kvpress's variant
# (docs/policies/kvpress_variants.md).
SHARED = [("streaming_llm", ["streaming_llm"]), ("keydiff", ["keydiff"]), ("knorm", ["knorm"]),
          ("snapkv", ["snapkv"]),
          # kvpress's PyramidKV is uniform SnapKV when N / beta < window (10-25 % of 1K here):
          # the sidecar's uniform SnapKV is that setting, and its DEFAULTS_KVPRESS option
          # applies kvpress's budget rule itself.
          ("pyramidkv", ["pyramidkv", "snapkv", "pyramidkv_kvpress"]),
          ("snapkv_default", ["snapkv_kvpress", "snapkv"]),
          ("pyramidkv_default", ["pyramidkv_kvpress", "pyramidkv", "snapkv_kvpress"]),
          ("tova", ["tova", "tova_allheads", "tova_kvpress"]),
          ("observed_attention", ["h2o", "h2o_plain", "h2o_observed"])]


def never_worse(cells) -> List[str]:
    """For every policy both have, per budget (protocol `prefill`, the only one kvpress runs):
    the sidecar's best setting against kvpress's press on the same prompts, on fidelity (mean
    KL over the texts, lower is better) and on each task's accuracy; the paired bootstrap CI of
    the difference says whether the sidecar is worse beyond the noise."""
    out = ["## Never worse than kvpress (same model, prompts, budget, protocol `prefill`)", "",
           "Sidecar: its best setting of the policy in that cell. d: sidecar minus kvpress "
           "(KL: negative is better; accuracy: positive is better), paired over the same texts "
           "or prompts, 95 % bootstrap CI. Verdict: `ok` when the sidecar is better or the CI "
           "contains 0, `WORSE` when the CI excludes 0 on the wrong side.", "",
           "| model | measure | context | policy | budget | kvpress | sidecar best | d [95 % CI] "
           "| verdict |", "|---|---|---:|---|---:|---:|---|---|---|"]
    keys = sorted({(k[0], k[1], k[2], k[5]) for k in cells if k[3] == "prefill"})
    for model, task, ctx, b in keys:
        metric = "kl" if task == "fidelity" else "correct"
        sign = -1.0 if metric == "kl" else 1.0   # better = larger sign * value
        for press, sides in SHARED:
            kc = cells.get((model, task, ctx, "prefill", "kvpress:" + press, b))
            if not kc or kc["error"] or not kc[metric]:
                continue
            best = None
            for side in sides:
                sc = cells.get((model, task, ctx, "prefill", side, b))
                if not sc or sc["error"]:
                    continue
                common = sorted(set(sc[metric]) & set(kc[metric]))
                if not common:
                    continue
                mean = sum(sc[metric][i] for i in common) / len(common)
                if best is None or sign * mean > sign * best[0]:
                    best = (mean, side, common, sc)
            if best is None:
                continue
            mean, side, common, sc = best
            kv = sum(kc[metric][i] for i in common) / len(common)
            d, lo, hi = scoring.paired_bootstrap_diff([sc[metric][i] for i in common],
                                                      [kc[metric][i] for i in common])
            worse = lo > 0 if metric == "kl" else hi < 0
            measure = "KL" if metric == "kl" else f"{task} acc"
            out.append(f"| {model} | {measure} | {ctx} | {press} | {b:.0%} | {kv:.4f} | {side} "
                       f"{mean:.4f} | {d:+.4f} [{lo:+.4f}, {hi:+.4f}] (n={len(common)}) | "
                       f"{'WORSE' if worse else 'ok'} |")
    out.append("")
    return out


MARKERS = "osD^v<>ph*XP8d1234+x|_"
STYLES = {"sidecar": "-", "kvpress": "--"}


def plot(cells, out_dir: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return
    models = sorted({k[0] for k in cells})
    for model in models:
        contexts = sorted({k[2] for k in cells if k[0] == model and k[1] != "fidelity"})
        protos = sorted({k[3] for k in cells if k[0] == model and k[4] != "full"})
        for context in contexts:
            tasks = [t for t in TASK_ORDER if (model, t, context) in
                     {(k[0], k[1], k[2]) for k in cells}]
            fid = sorted({k[2] for k in cells if k[0] == model and k[1] == "fidelity"})
            panels = [(t, "accuracy") for t in tasks] + [("fidelity", "KL (nats)")] * bool(fid)
            for proto in protos:
                n = len(panels)
                cols = min(3, n)
                rows = (n + cols - 1) // cols
                fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4 * rows),
                                         squeeze=False)
                labels = sorted({k[4] for k in cells if k[0] == model and k[3] == proto
                                 and k[4] != "full"}, key=lambda x: (x.startswith("kvpress"), x))
                for ax, (t, ylabel) in zip(axes.flat, panels):
                    ctx = fid[0] if t == "fidelity" else context
                    for i, lab in enumerate(labels):
                        pts = []
                        for (m, tt, cc, p, l2, b), c in cells.items():
                            if (m, tt, cc, p, l2) == (model, t, ctx, proto, lab) and \
                                    not c["error"]:
                                vals = c["kl"] if t == "fidelity" else c["correct"]
                                if vals:
                                    pts.append((b, sum(vals.values()) / len(vals)))
                        if not pts:
                            continue
                        pts.sort()
                        ax.plot([100 * b for b, _ in pts], [v for _, v in pts],
                                marker=MARKERS[i % len(MARKERS)],
                                linestyle=STYLES["kvpress" if lab.startswith("kvpress")
                                                 else "sidecar"],
                                label=lab, markersize=6, linewidth=1.3)
                    full = cells.get((model, t, ctx, "prefill", "full", 1.0))
                    if full and t != "fidelity" and full["correct"]:
                        ax.axhline(sum(full["correct"].values()) / len(full["correct"]),
                                   color="black", linestyle=":", label="full cache")
                    ax.set_title(t if t != "fidelity" else f"fidelity ({ctx}-token prompts)")
                    ax.set_xlabel("budget (% of the prompt)")
                    ax.set_ylabel(ylabel)
                    if t == "fidelity":
                        ax.set_yscale("log")
                    ax.grid(alpha=0.3)
                for ax in list(axes.flat)[n:]:
                    ax.axis("off")
                handles, names = axes.flat[0].get_legend_handles_labels()
                fig.legend(handles, names, loc="lower center", ncol=6, fontsize=8,
                           bbox_to_anchor=(0.5, -0.02))
                fig.suptitle(f"{model}, protocol {proto}, {context}-token prompts")
                fig.tight_layout(rect=(0, 0.08, 1, 1))
                fig.savefig(os.path.join(out_dir, f"{model}_{proto}_{context}.png"), dpi=90,
                            bbox_inches="tight")
                plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    write(args.out, plots=not args.no_plots)


if __name__ == "__main__":
    main()
