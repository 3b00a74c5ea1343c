"""What each full-attention layer holds after a sidecar policy compressed a needle prompt.

For every sample and configuration: per full-attention layer (the layers without a sliding
window), the tokens it holds after the prefill Compress (what `GetLayout` reports), the budget
the layer allocator gave it, and how many of the needle's answer tokens it still holds; with
`--decode`, also the greedy answer. A summary per configuration and layer follows: the mean
count and the samples in which the layer holds every needle token. `--cake-preferences` prints
CAKE's layer preferences computed here from the recorded prefill (cake.md step 2, fp64), the
one-shot split they give, and so checks the sidecar's CAKE allocation independently.

    KVSIDECAR_BIN=build/service/kvsidecar build/pyenv/bin/python bench/quality/inspect_layers.py \
        --model gemma3 --task niah_single --context 2048 --samples 10 --budgets 0.1 \
        --policies cake,snapkv --uniform cake --decode --cake-preferences

`--uniform P` adds policy P with the uniform layer allocator (`P+uniform`): its own scorer, the
budget split evenly; so a policy's allocation can be told from its scoring.
"""

import argparse
import collections
import math
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import engine  # noqa: E402
import run  # noqa: E402
import tasks as task_gen  # noqa: E402
from kvsidecar.client import common_pb2  # noqa: E402

import kvsidecar as kvs  # noqa: E402
from kvsidecar.hf import blocks_for, layer_windows, layout_for  # noqa: E402
from kvsidecar.server import LocalServer  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--task", default="niah_single", help="a needle task (niah_*)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="0.1")
    ap.add_argument("--policies", default="cake,snapkv", help="sidecar policies of run.py")
    ap.add_argument("--uniform", default="", help="these policies again, uniform allocator")
    ap.add_argument("--decode", action="store_true", help="also decode the greedy answer")
    ap.add_argument("--cake-preferences", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    return ap.parse_args(argv)


def needle_tokens(tok, ids: List[int], answers: List[str]) -> List[int]:
    """Prompt positions whose text overlaps an answer's characters."""
    pieces = [tok.decode([t]) for t in ids]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = "".join(pieces)
    out = set()
    for answer in answers:
        at = text.find(answer)
        if at < 0:
            continue
        for i in range(len(pieces)):
            if starts[i + 1] > at and starts[i] < at + len(answer):
                out.add(i)
    return sorted(out)


def cake_preferences(pre, layers: List[int], budget_tokens: int, window: int = 32):
    """CAKE's P_l = H_l * V_l (tau1 = tau2 = 1) of `layers` over the last `window` queries, and
    the one-shot split of T = (C - W) * len(layers) in proportion (no cap binds here)."""
    s = pre.length
    n = s - window
    prefs = []
    for layer in layers:
        q = pre.queries[layer][0, :, -window:].double()
        k = pre.cache.layers[layer].keys[0].double()
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
        logits = pre.scale * q @ k.transpose(1, 2)
        masked = torch.arange(s)[None, :] > (n + torch.arange(window))[:, None]
        a = torch.softmax(logits.masked_fill(masked, -math.inf), -1)[:, :, :n]
        dispersion = float(-(a * torch.log(a + 1e-10)).sum())
        shift = float(a.var(dim=1, unbiased=True).sum())
        prefs.append((dispersion, shift, dispersion * shift))
    total = (budget_tokens - window) * len(layers)
    psum = sum(p[2] for p in prefs)
    return prefs, [p[2] / psum * total + window for p in prefs]


def configs(args) -> List[engine.Config]:
    picked = run.configs(run.parse_args(["--no-kvpress", "--policies", args.policies,
                                         "--budgets", args.budgets, "--protocols", "prefill"]))
    out = [c for c in picked if c.method == "sidecar"]
    uniform = common_pb2.LayerAllocator(kind=common_pb2.LAYER_ALLOCATOR_UNIFORM)
    for name in filter(None, args.uniform.split(",")):
        for c in run.configs(run.parse_args(["--no-kvpress", "--policies", name, "--budgets",
                                             args.budgets, "--protocols", "prefill"])):
            if c.method != "sidecar":
                continue

            def make(n, base=c.make):
                spec = base(n)
                spec.allocator.CopyFrom(uniform)
                return spec
            out.append(engine.Config("sidecar", f"{name}+uniform", c.budget, "prefill",
                                     f"{c.params}; uniform allocator", make))
    if not out:
        raise SystemExit(f"--policies {args.policies}: none of run.py's sidecar policies")
    return out


def held(session, seq: str, layers: List[int], needle: List[int]) -> Dict[int, tuple]:
    """layer -> (count, budget, needle tokens held by every kv head)."""
    out = {}
    for e in session.get_layout(seq).layers:
        if e.layer not in layers:
            continue
        heads = len(e.positions) // e.count if e.count else 0
        pos = [set(e.positions[h * e.count:(h + 1) * e.count]) for h in range(heads)]
        whole = sum(all(p in s for s in pos) for p in needle) if pos else 0
        out[e.layer] = (e.count, e.budget, whole)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = run.load(run.model_path(args.model))
    template = run.chat_template(tok)
    samples = task_gen.make_samples(args.task, args.context, args.samples, args.seed,
                                    lambda s: tok.encode(s, add_special_tokens=False), template)
    glob = [i for i, w in enumerate(layer_windows(model)) if w == 0]
    cfgs = configs(args)
    print(f"{args.model}: full-attention layers {glob}", flush=True)
    summary = collections.defaultdict(lambda: collections.defaultdict(list))
    correct = collections.Counter()
    binary = os.environ.get("KVSIDECAR_BIN",
                            os.path.join(run.REPO, "build", "service", "kvsidecar"))
    with LocalServer(binary, lease_ms=600000) as srv, \
            kvs.Client(srv.address, timeout=600) as client, \
            client.attach(layout_for(model, "fp32"),
                          num_blocks=blocks_for(model, args.context + 256, batch_size=1)) as s:
        for smp in samples:
            pre = engine.prefill(model, torch.tensor([smp.ids]))
            needle = needle_tokens(tok, smp.ids, smp.answers)
            print(f"sample {smp.index}: answer {smp.answers}, needle tokens at {needle}",
                  flush=True)
            if args.cake_preferences:
                for b in sorted({c.budget for c in cfgs}):
                    prefs, split = cake_preferences(pre, glob, max(1, math.ceil(b * pre.length)))
                    shares = [p[2] / sum(q[2] for q in prefs) for p in prefs]
                    print(f"  CAKE preferences at {b}: H {[round(p[0], 2) for p in prefs]}, "
                          f"V {[round(p[1], 4) for p in prefs]}, share "
                          f"{[round(x, 3) for x in shares]} -> tokens "
                          f"{[round(x, 1) for x in split]}", flush=True)
            for c in cfgs:
                runner = engine.make_runner(model, s, pre, c)
                try:
                    state = held(s, runner.cache.sequence_ids[0], glob, needle)
                    answer = ""
                    if args.decode:
                        outs = engine.greedy(runner, pre.logits, smp.max_new_tokens,
                                             lambda r, t: False)
                        answer = tok.decode(outs[0]["tokens"]).split("\n")[0]
                        ok = all(a in answer.lower() for a in smp.answers)
                        correct[(c.policy, c.budget)] += ok
                        answer = f"; answer {answer[:40]!r}" + (" (right)" if ok else "")
                finally:
                    runner.close()
                for layer, v in state.items():
                    summary[(c.policy, c.budget)][layer].append(v + (len(needle),))
                cells = ", ".join(f"{layer}: {v[0]} held (budget {v[1]}), needle {v[2]}/"
                                  f"{len(needle)}" for layer, v in state.items())
                print(f"  {c.policy:16s} {c.budget:<5} {cells}{answer}", flush=True)
    print("\nsummary: per layer, mean tokens held and the samples holding every needle token")
    for key, layers in summary.items():
        parts = []
        for layer, vs in sorted(layers.items()):
            whole = sum(v[2] == v[3] for v in vs)
            parts.append(f"layer {layer}: {np.mean([v[0] for v in vs]):.1f} held, whole "
                         f"needle in {whole}/{len(vs)}")
        tail = f"; right {correct[key]}/{len(samples)}" if args.decode else ""
        print(f"  {key[0]:16s} {key[1]:<5} " + "; ".join(parts) + tail)


if __name__ == "__main__":
    main()
