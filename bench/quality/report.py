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


def load_dir(out_dir: str) -> List[Dict[str, str]]:
    """Every row of every CSV directly in out_dir (results.csv and the per-run files kept beside
    it; not subfolders, where rows set aside are kept), one row per cell and sample.

    Runs are often kept one file per task and context, and a later run may repeat a sample an
    earlier file holds (the full cache of a task measured again with new tasks, say): such a
    repeat must agree with the first, since the harness is deterministic; a disagreement is an
    error, not a silent choice of one file."""
    rows: List[Dict[str, str]] = []
    seen: Dict[Tuple, Tuple[str, Tuple[str, ...]]] = {}
    names = sorted(n for n in os.listdir(out_dir) if n.endswith(".csv")) \
        if os.path.isdir(out_dir) else []
    for name in names:
        for r in scoring.ResultStore(os.path.join(out_dir, name)).rows:
            key = scoring.cell_key(r) + (r["sample"],)
            value = (r["correct"], r["kl"], r["top1"], r["error"])
            if key in seen:
                if seen[key][1] != value:
                    raise ValueError(f"{name} and {seen[key][0]} disagree on {key}: "
                                     f"{value} vs {seen[key][1]}")
                continue
            seen[key] = (name, value)
            rows.append(r)
    return rows


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
    cells = aggregate(load_dir(out_dir))
    models = sorted({k[0] for k in cells})
    lines = ["# KV-cache compression quality: sidecar policies and kvpress", ""]
    if command:
        lines += [f"Command: `{command}`" + (f" ({elapsed:.0f} s)" if elapsed else ""), ""]
    lines += [
        "Accuracy: exact match of the greedy answer line (mean over samples, 95 % bootstrap CI). "
        "Fidelity: teacher-forced continuation of each text after a compressed prompt, mean "
        "KL(full || compressed) in nats and top-1 agreement with the full cache (mean over the "
        "texts). kept: mean K/V held per layer at the end of decoding, as a fraction of the "
        "prompt (the decoded tokens included; the full cache is above 1). Protocol "
        "`prefill`: compressed once after the prefill, no eviction while decoding (kvpress's "
        "protocol); `decode`: the "
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


def matched(cells) -> List[Dict]:
    """For every policy both have, per model, measure, context and budget (protocol `prefill`,
    the only one kvpress runs): the sidecar's best setting of it against kvpress's press on the
    same prompts or texts, with the paired bootstrap CI of the difference and whether the sidecar
    is worse beyond the noise (the CI excludes 0 on the wrong side)."""
    out = []
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
            out.append({"model": model, "task": task, "context": ctx, "press": press,
                        "budget": b, "kvpress": kv, "side": side, "sidecar": mean, "d": d,
                        "lo": lo, "hi": hi, "n": len(common), "metric": metric,
                        "same": all(sc[metric][i] == kc[metric][i] for i in common),
                        "worse": lo > 0 if metric == "kl" else hi < 0})
    return out


def never_worse(cells) -> List[str]:
    """matched() as a table."""
    out = ["## Never worse than kvpress (same model, prompts, budget, protocol `prefill`)", "",
           "Sidecar: its best setting of the policy in that cell. d: sidecar minus kvpress "
           "(KL: negative is better; accuracy: positive is better), paired over the same texts "
           "or prompts, 95 % bootstrap CI. Verdict: `ok` when the sidecar is better or the CI "
           "contains 0, `WORSE` when the CI excludes 0 on the wrong side.", "",
           "| model | measure | context | policy | budget | kvpress | sidecar best | d [95 % CI] "
           "| verdict |", "|---|---|---:|---|---:|---:|---|---|---|"]
    for m in matched(cells):
        measure = "KL" if m["metric"] == "kl" else f"{m['task']} acc"
        out.append(f"| {m['model']} | {measure} | {m['context']} | {m['press']} | "
                   f"{m['budget']:.0%} | {m['kvpress']:.4f} | {m['side']} {m['sidecar']:.4f} | "
                   f"{m['d']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}] (n={m['n']}) | "
                   f"{'WORSE' if m['worse'] else 'ok'} |")
    out.append("")
    return out


# Configurations that hold every token and bound only what is attended to (OmniKV): shown apart
# from the evicting ones in the headline, since their budget does not bound memory.
NON_EVICTING = {"omnikv"}


def _mean(values: Dict[int, float]) -> float:
    return sum(values.values()) / len(values)


def _best(means: Dict[str, float]) -> str:
    """'name 0.94', or the tied names (two at most, then how many more) with their score."""
    if not means:
        return "–"
    top = max(means.values())
    if top == 0:
        return "all 0.00"
    names = sorted(lab.replace("kvpress:", "") for lab, v in means.items() if v == top)
    shown = ", ".join(names[:2]) + (f" +{len(names) - 2}" if len(names) > 2 else "")
    return f"{shown} {top:.2f}"


def headline(cells, min_full: float = 0.1) -> List[str]:
    """The README's table (protocol `prefill`): per model, task and context where the full cache
    answers at least min_full, the best evicting sidecar configuration and the best kvpress press
    at each budget, how many of each were run there, and OmniKV apart. Tasks the full cache
    cannot do are named below the table: no policy can be told from another on them."""
    budgets = sorted({k[5] for k in cells if k[3] == "prefill" and k[4] != "full"})
    head = (["model", "task", "tokens", "full cache"]
            + [f"{b:.0%}: best sidecar / best kvpress" for b in budgets]
            + ["OmniKV " + " / ".join(f"{b:.0%}" for b in budgets), "run (sidecar / kvpress)"])
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|" + "---|" * (len(head) - 4)]
    hopeless, alone, ns = [], [], []
    ran = defaultdict(list)   # (model, task, context, budget) -> [(label, mean)], prefill
    for (m, t, c, p, lab, b), cell in cells.items():
        if p == "prefill" and lab != "full" and cell["correct"] and not cell["error"]:
            ran[(m, t, c, b)].append((lab, _mean(cell["correct"])))
            ns.append(len(cell["correct"]))
    rows = sorted({(k[0], k[1], k[2]) for k in cells if k[1] != "fidelity"},
                  key=lambda x: (x[0], TASK_ORDER.index(x[1]) if x[1] in TASK_ORDER else 99,
                                 x[2]))
    for model, task, ctx in rows:
        full = cells.get((model, task, ctx, "prefill", "full", 1.0))
        if not full or not full["correct"]:
            continue
        fm = _mean(full["correct"])
        if fm < min_full:
            hopeless.append(f"{model} {task} {ctx} ({fm:.2f}, n={len(full['correct'])})")
            continue
        cols = [model, task, str(ctx), f"{fm:.2f}"]
        run_side, run_press, omni = set(), set(), []
        for b in budgets:
            side, press = {}, {}
            for lab, mean in ran[(model, task, ctx, b)]:
                if lab not in NON_EVICTING:
                    (press if lab.startswith("kvpress:") else side)[lab] = mean
            run_side |= set(side)
            run_press |= set(press)
            cols.append(f"{_best(side)} / {_best(press)}")
            o = cells.get((model, task, ctx, "decode", "omnikv", b)) or \
                cells.get((model, task, ctx, "prefill", "omnikv", b))
            omni.append(f"{_mean(o['correct']):.2f}" if o and o["correct"] and not o["error"]
                        else "–")
        if not run_side and not run_press and all(o == "–" for o in omni):
            alone.append(f"{model} {task} {ctx} ({fm:.2f})")
            continue
        cols += [" / ".join(omni), f"{len(run_side)} / {len(run_press)}"]
        lines.append("| " + " | ".join(cols) + " |")
    m = matched(cells)
    tasks_m = [x for x in m if x["metric"] == "correct"]
    lines += ["", f"Samples per cell: {min(ns) if ns else 0} or more. Matched policies "
              f"(the sidecar's best setting of a policy against kvpress's press, same prompts): "
              f"{len(tasks_m)} task cells, {sum(x['same'] for x in tasks_m)} with the same "
              f"outcome (right or wrong) on every prompt, {sum(x['worse'] for x in tasks_m)} "
              f"worse beyond the 95 % CI; fidelity: {len(m) - len(tasks_m)} cells, "
              f"{sum(x['worse'] for x in m if x['metric'] == 'kl')} worse beyond the CI."]
    if alone:
        lines += ["", "Measured for the full cache alone so far: " + "; ".join(alone) + "."]
    if hopeless:
        lines += ["", "The full cache answers (almost) none, so no policy can be told apart: "
                  + "; ".join(hopeless) + "."]
    return lines


# 21 markers that look unlike one another (no '8' beside 'o', no 'h' beside 'p') against 10
# colours: 21 and 10 share no factor, so labels up to the 210th differ in marker or colour.
def plot(cells, out_dir: str) -> None:
    """The small-multiple plots (plots.py)."""
    import plots
    plots.plot(cells, out_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--headline", action="store_true",
                    help="print the README's headline table of every CSV in --out and exit")
    args = ap.parse_args()
    if args.headline:
        print("\n".join(headline(aggregate(load_dir(args.out)))))
        return
    write(args.out, plots=not args.no_plots)


if __name__ == "__main__":
    main()
