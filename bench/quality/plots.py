"""The quality harness's plots (report.py writes them beside results.md): small multiples.

One PNG per model, protocol and context; in it one panel per task (a row; fidelity's KL last) and
policy group (a column: the policies that score alike), so that a panel holds a few series and
none hides another. Every policy has its own colour and marker in every panel and every figure;
kvpress's press for a policy takes the sidecar policy's colour, dashed with hollow markers. Each
point is a cell's mean with its 95 % bootstrap CI as a band (scoring.bootstrap_ci); the full
cache's accuracy is a dotted black line.
"""

import os
import sys
from typing import Dict, List, Tuple

import scoring

TASK_ORDER = ["niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe"]
# Columns: policies that rank tokens the same way (kvpress's presses go with the sidecar's).
GROUPS = [
    ("accumulated attention", ["h2o", "h2o_plain", "h2o_observed", "observed_attention", "caote",
                               "d2o"]),
    ("observation window", ["snapkv", "snapkv_kvpress", "snapkv_default", "pyramidkv",
                            "pyramidkv_kvpress", "pyramidkv_default", "cake"]),
    ("last query", ["tova", "tova_allheads", "tova_kvpress"]),
    ("keys only", ["streaming_llm", "keydiff", "knorm"]),
    ("OmniKV (selects, evicts nothing)", ["omnikv"]),
]
# kvpress's press -> the sidecar policy whose colour it takes.
KVPRESS_MATCH = {"observed_attention": "h2o_observed", "snapkv_default": "snapkv_kvpress",
                 "pyramidkv_default": "pyramidkv_kvpress"}
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939"]
MARKERS = ["o", "s", "D", "^", "v", "P", "X", "*", "<", ">", "h", "d"]


def _base(label: str) -> str:
    return label.split(":", 1)[1] if label.startswith("kvpress:") else label


def _group(label: str) -> str:
    base = _base(label)
    for name, members in GROUPS:
        if base in members:
            return name
    return "other"


def style(label: str) -> Dict:
    """Colour, marker and line of a series: the same for the label in every panel."""
    base = _base(label)
    key = KVPRESS_MATCH.get(base, base) if label.startswith("kvpress:") else base
    members = next((m for _, m in GROUPS if key in m), [key])
    i = members.index(key) if key in members else abs(hash(key)) % len(PALETTE)
    kvpress = label.startswith("kvpress:")
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)],
            "linestyle": "--" if kvpress else "-",
            "markerfacecolor": "none" if kvpress else PALETTE[i % len(PALETTE)]}


def _series(cells, model, task, context, proto, label) -> List[Tuple[float, float, float, float]]:
    """[(budget %, mean, CI low, CI high)] of one label in one panel, by budget."""
    pts = []
    for (m, t, c, p, lab, b), cell in cells.items():
        if (m, t, c, p, lab) != (model, task, context, proto, label) or cell["error"]:
            continue
        vals = cell["kl"] if task == "fidelity" else cell["correct"]
        if vals:
            mean, lo, hi = scoring.bootstrap_ci(list(vals.values()), n_boot=2000)
            pts.append((100 * b, mean, lo, hi))
    return sorted(pts)


def _panel(ax, cells, model, task, context, proto, labels) -> None:
    for label in labels:
        pts = _series(cells, model, task, context, proto, label)
        if not pts:
            continue
        s = style(label)
        x = [p[0] for p in pts]
        ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], color=s["color"],
                        alpha=0.12, linewidth=0)
        ax.plot(x, [p[1] for p in pts], label=label, markersize=5, linewidth=1.3, **s)
    full = cells.get((model, task, context, "prefill", "full", 1.0))
    if full and task != "fidelity" and full["correct"]:
        ax.axhline(sum(full["correct"].values()) / len(full["correct"]), color="black",
                   linestyle=":", linewidth=1, label="full cache")
    if task == "fidelity":
        ax.set_yscale("log")
    else:
        ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)


def plot(cells, out_dir: str) -> List[str]:
    """Writes the PNGs; returns their paths (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    written = []
    for model in sorted({k[0] for k in cells}):
        contexts = sorted({k[2] for k in cells if k[0] == model and k[1] != "fidelity"})
        fid = sorted({k[2] for k in cells if k[0] == model and k[1] == "fidelity"})
        for proto in sorted({k[3] for k in cells if k[0] == model and k[4] != "full"}):
            for context in contexts:
                path = _figure(plt, cells, model, proto, context, fid, out_dir)
                if path:
                    written.append(path)
    return written


def _figure(plt, cells, model, proto, context, fid, out_dir):
    # A row per task that some configuration ran in this protocol (a task the full cache alone
    # ran on says nothing here: the headline names it), fidelity last.
    rows = [(t, context) for t in TASK_ORDER if any(
        k[:4] == (model, t, context, proto) and k[4] != "full" for k in cells)]
    if fid and any(k[:4] == (model, "fidelity", fid[-1], proto) for k in cells):
        rows.append(("fidelity", fid[-1]))
    if not rows:
        return None
    labels = sorted({k[4] for k in cells if k[0] == model and k[3] == proto and k[4] != "full"},
                    key=lambda x: (x.startswith("kvpress"), x))
    groups = [g for g, _ in GROUPS + [("other", [])]
              if any(_group(lab) == g for lab in labels)]
    fig, axes = plt.subplots(len(rows), len(groups), figsize=(3.4 * len(groups), 2.7 * len(rows)),
                             squeeze=False, sharex=True)
    for r, (task, ctx) in enumerate(rows):
        for c, group in enumerate(groups):
            ax = axes[r][c]
            _panel(ax, cells, model, task, ctx, proto,
                   [lab for lab in labels if _group(lab) == group])
            if r == 0:
                ax.set_title(group, fontsize=9)
            if c == 0:
                ax.set_ylabel(f"{task}\n{'KL (nats)' if task == 'fidelity' else 'accuracy'}",
                              fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("budget (% kept)", fontsize=8)
            ax.tick_params(labelsize=7)
    # One legend per column, below it: each column's series once.
    for c, group in enumerate(groups):
        handles, names = {}, []
        for r in range(len(rows)):
            for h, name in zip(*axes[r][c].get_legend_handles_labels()):
                if name not in handles:
                    handles[name] = h
                    names.append(name)
        axes[-1][c].legend([handles[n] for n in names], names, loc="upper center",
                           bbox_to_anchor=(0.5, -0.28), fontsize=7, ncol=2, frameon=False)
    fig.suptitle(f"{model}, protocol {proto}, {context}-token prompts "
                 "(mean and 95 % CI per budget)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{model}_{proto}_{context}.png")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path
