#!/usr/bin/env python3
"""Decode speed and memory of transformers with kvsidecar.hf.SidecarCache against DynamicCache
and kvpress, on SmolLM2-135M-Instruct and Gemma 3 270M (the GGUFs of deploy/fetch_model.sh and
deploy/fetch_gemma.sh, dequantised to fp32 by transformers) on the CPU.

    KVSIDECAR_BIN=build/service/kvsidecar nice build/pyenv/bin/python bench/hf_cache_bench.py \\
        --models smollm2,gemma3 --contexts 2048,4096 --batches 1,8 --budgets 0.1,0.25,0.5

Per (model, context, batch): the prompt rows (different slices of bench/quality/data/
alice_ch1.txt, equal length) are prefilled ONCE with DynamicCache, recording what every
configuration needs (bench/quality/engine.py: compressing after the prefill does not change the
prefill); then, per repeat, every configuration in turn decodes --new-tokens greedy tokens from
that prefill through the model's own forward, one token per call, as `generate` does:

  full              DynamicCache holding the whole prompt (the limit every ratio is taken to);
  kvpress:<press>   kvpress's press applied to the recorded prefill (its `compress`, as its hook
                    calls it), then DynamicCache with what it kept (kvpress's own decoding);
  <policy>          SidecarCache with the policy and budget (the fraction kept), the prompt
                    compressed once as kvpress does (hold_budget=False: the same Commit and
                    Compress calls), through its own prefill path fed with the recorded tensors;
                    sidecar_100 = SidecarCache, no budget;
  <policy>/hold     the budget held while decoding (hold_budget=True, the default: every
                    DecodeStep scores the new token and evicts back to the budget; SnapKV);
  snapkv_gather     the same with mirror=False (each layer gathered from the arena per step).

Timed: the decode steps only (from the first forward after the prefill to the last), tokens/s =
rows x steps / that time. The order of the configurations alternates between repeats (forward,
then backward), so each repeat's full-cache run sits beside the others; each ratio is a
configuration's tokens/s over the full cache's of the SAME repeat, and the figures are the median
and range over the repeats (the machine is shared: absolute figures move, ratios less).

`--report FILE...` prints the markdown tables of bench/README.md from the JSON lines of runs.

--breakdown also times, for one sidecar configuration per (model, context, batch), where a
decode step's time goes (in the cache's update, waiting for the DecodeStep answer, the masks,
the rest of the model) against the full cache's step.

Memory (--rss): the K/V bytes each cache holds at the end and the worker's peak RSS (VmHWM) in a
fresh process per cache: DynamicCache at 100 % against SidecarCache at 25 %. The mapped arena is
shared memory: pages of it the worker touched count in its RSS as RssShmem, reported apart from
RssAnon (the worker's own memory, which holds the slot mirror).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALICE = os.path.join(HERE, "quality", "data", "alice_ch1.txt")
FETCH = {"smollm2": "fetch_model.sh", "gemma3": "fetch_gemma.sh"}
sys.path.insert(0, os.path.join(HERE, "quality"))

# The sidecar's budgeted policies (bench/quality/engine.py's rows of them, one setting each).
POLICIES = ["streaming_llm", "keydiff", "knorm", "h2o", "tova", "snapkv", "pyramidkv", "cake",
            "d2o", "caote"]


def _status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def model_path(name):
    return subprocess.run([os.path.join(REPO, "deploy", FETCH[name])], check=True,
                          capture_output=True, text=True).stdout.strip()


def load(path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval(), tok


def rows(tok, batch, length):
    import torch
    with open(ALICE, encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False)
    while len(ids) < length + batch * 64:
        ids = ids + ids  # the chapter is ~1300 tokens: longer prompts repeat it
    step = max(1, (len(ids) - length) // max(1, batch))
    return torch.tensor([ids[i * step:i * step + length] for i in range(batch)])


def configs(budgets, policies, kvpress_presses, gather=True, hold=("snapkv",)):
    import engine
    out = [engine.Config("full", "full", 1.0, "prefill", "DynamicCache, whole prompt"),
           engine.Config("sidecar", "sidecar_100", 1.0, "decode", "SidecarCache, no budget",
                         lambda n: engine.make_policy("snapkv"))]
    wanted = set(policies)
    # kvpress's protocol (SidecarCache(hold_budget=False)): the prompt compressed once.
    out += [c for c in engine.sidecar_configs(budgets, ["prefill"]) if c.policy in wanted]
    # The budget held while decoding (hold_budget=True, the default): the sidecar scores every
    # new token; and the same reading every layer out of the arena at every step (mirror=False),
    # the decode path before the slot mirror.
    out += [c for c in engine.sidecar_configs(budgets, ["decode"]) if c.policy in hold]
    out += [engine.Config("sidecar", "snapkv_gather", b, "decode", "SnapKV, mirror=False",
                          lambda n: engine.make_policy("snapkv")) for b in budgets if gather]
    if kvpress_presses:
        out += [c for c in engine.kvpress_configs(budgets) if c.policy in kvpress_presses]
    return out


def label(cfg):
    if cfg.policy in ("full", "sidecar_100"):
        return cfg.policy
    held = "/hold" if cfg.method == "sidecar" and cfg.protocol == "decode" else ""
    return f"{cfg.name}{held}@{cfg.budget:g}"


def _runner(model, session, pre, cfg):
    import engine
    if cfg.method == "full":
        # As `generate` builds it: sliding-window layers (Gemma 3) keep their window only.
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
        for layer in range(len(pre.cache.layers)):
            cache.update(*engine._layer_kv(pre.cache, layer), layer)
        return engine.DynamicRunner(model, cache, pre.length, int(pre.ids.shape[0]))
    if cfg.policy == "sidecar_100":
        from kvsidecar.hf import SidecarCache
        runner = engine.SidecarRunner.__new__(engine.SidecarRunner)
        runner.model, runner.kw, runner.omnikv = model, engine._cache_kwarg(model), False
        runner.cache = SidecarCache(session, model, policy="snapkv", budget=None)
        cache = runner.cache
        b, t = pre.ids.shape
        cache._begin_step(int(b), int(t))
        for layer in range(cache.num_layers):
            k, v = engine._layer_kv(pre.cache, layer)
            cache._store(layer, k, 0)
            cache._store(layer, v, 1)
        cache._step.queries = {}
        cache._end_step()
        return runner
    runner = engine.make_runner(model, session, pre, cfg)
    if cfg.policy.endswith("_gather"):
        runner.cache.use_mirror = False  # before the first decode step makes the mirror
    return runner


def decode(runner, pre, steps):
    """Times `steps` greedy decode steps from the prefill's logits; returns (seconds, tokens)."""
    import torch
    tok = pre.logits.argmax(-1)[:, None]
    out = []
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = runner.forward(tok)[:, -1]
        tok = logits.argmax(-1)[:, None]
        out.append(tok)
    wall = time.perf_counter() - t0
    return wall, torch.cat(out, 1)


class Breakdown:
    """Wall time per decode step spent in SidecarCache's parts (monkeypatched timers; a part's
    time excludes the other parts it calls, e.g. the step setup inside layer 0's update)."""

    PARTS = {"update (store + mirror/gather)": "update", "attention mask": "_layer_mask",
             "DecodeStep: send": "_end_step", "DecodeStep: wait + apply": "sync",
             "step setup (layouts, refills)": "_begin_step"}

    def __init__(self):
        from kvsidecar.hf import SidecarCache
        self.cls = SidecarCache
        self.spent = {part: 0.0 for part in self.PARTS}
        self.saved = {}
        self.stack = []

    def __enter__(self):
        for part, name in self.PARTS.items():
            original = getattr(self.cls, name)
            self.saved[name] = original

            def timed(*args, _original=original, _part=part, **kwargs):
                self.stack.append(0.0)
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    total = time.perf_counter() - t0
                    nested = self.stack.pop()
                    self.spent[_part] += total - nested
                    if self.stack:
                        self.stack[-1] += total
            setattr(self.cls, name, timed)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.cls, name, original)


def measure(args, model, tok, session, name, context, batch, cfgs):
    import engine
    import torch
    ids = rows(tok, batch, context)
    t0 = time.perf_counter()
    pre = engine.prefill(model, ids)
    print(f"# {name} {context} x{batch}: prefill {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    runs = {label(c): [] for c in cfgs}
    ratios = {label(c): [] for c in cfgs}
    held = {}
    ref_tokens = None
    same = True
    for rep in range(args.repeats):
        order = cfgs if rep % 2 == 0 else list(reversed(cfgs))
        speed = {}
        for cfg in order:
            runner = _runner(model, session, pre, cfg)
            try:
                wall, out = decode(runner, pre, args.new_tokens)
                if cfg.method == "full":
                    ref_tokens = out if ref_tokens is None else ref_tokens
                elif cfg.policy == "sidecar_100" and ref_tokens is not None:
                    same = same and bool(torch.equal(out, ref_tokens))
                held[label(cfg)] = round(runner.kept_fraction(context), 4)
            finally:
                runner.close()
            speed[label(cfg)] = batch * args.new_tokens / wall
            runs[label(cfg)].append(speed[label(cfg)])
            print(f"  {name} {context} x{batch} rep {rep} {label(cfg):28s} "
                  f"{speed[label(cfg)]:7.2f} tok/s", file=sys.stderr, flush=True)
        for key, value in speed.items():
            ratios[key].append(value / speed["full"])
    out = []
    for cfg in cfgs:
        key = label(cfg)
        r = ratios[key]
        out.append({"model": name, "context": context, "batch": batch, "config": key,
                    "budget": cfg.budget, "kept": held.get(key),
                    "tok_s_median": round(statistics.median(runs[key]), 2),
                    "tok_s_range": [round(min(runs[key]), 2), round(max(runs[key]), 2)],
                    "ratio_median": round(statistics.median(r), 3),
                    "ratio_range": [round(min(r), 3), round(max(r), 3)],
                    "repeats": len(r)})
    out.append({"model": name, "context": context, "batch": batch,
                "same_tokens_sidecar_100": same})
    if args.breakdown:
        out.append(breakdown(args, model, session, pre, cfgs, name, context, batch))
    return out


def breakdown(args, model, session, pre, cfgs, name, context, batch):
    steps = args.new_tokens
    full = next(c for c in cfgs if c.method == "full")
    target = next((c for c in cfgs if c.method == "sidecar" and c.policy == args.breakdown
                   and c.protocol == "prefill" and abs(c.budget - 0.25) < 1e-9), None)
    if target is None:
        return {"breakdown": f"no {args.breakdown}@0.25 configuration"}
    runner = _runner(model, session, pre, full)
    full_wall, _ = decode(runner, pre, steps)
    runner.close()
    runner = _runner(model, session, pre, target)
    with Breakdown() as timers:
        wall, _ = decode(runner, pre, steps)
    refills = runner.cache._mirror.refills if runner.cache._mirror is not None else None
    runner.close()
    spent = timers.spent
    row = {"model": name, "context": context, "batch": batch,
           "breakdown": label(target), "full_ms_per_step": round(full_wall / steps * 1e3, 2),
           "sidecar_ms_per_step": round(wall / steps * 1e3, 2), "mirror_refills": refills}
    for part, seconds in spent.items():
        row[part] = round(seconds / steps * 1e3, 3)
    row["rest of the model (ms/step)"] = round((wall - sum(spent.values())) / steps * 1e3, 2)
    return row


def rss_child(args):
    """One fresh process: load, run one cache kind through `generate`, print its memory."""
    import torch
    from transformers import DynamicCache

    import kvsidecar as kvs
    from kvsidecar.hf import SidecarCache, blocks_for, layout_for
    torch.set_num_threads(args.threads)
    model, tok = load(model_path(args.rss_model))
    ids = rows(tok, args.rss_batch, args.rss_prompt_tokens)
    loaded = _status()
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": args.rss_new_tokens,
          "min_new_tokens": args.rss_new_tokens, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        if args.rss_child == "dynamic":
            cache = DynamicCache(config=model.config)
            model.generate(ids, cache=cache, **kw)
            held = sum(lay.keys.nbytes + lay.values.nbytes for lay in cache.layers)
            end = _status()
        else:
            with kvs.Client(args.server, timeout=600) as client, client.attach(
                    layout_for(model, "fp32"),
                    num_blocks=blocks_for(model, args.rss_prompt_tokens + args.rss_new_tokens,
                                          args.rss_batch)) as session:
                cache = SidecarCache(session, model, policy="snapkv", budget=0.25)
                model.generate(ids, cache=cache, **kw)
                held = cache.kv_bytes()
                end = _status()
                cache.release()
    print(json.dumps({"cache": args.rss_child, "kv_bytes_held": held,
                      "rss_after_load": loaded["VmRSS"], "peak_rss": end["VmHWM"],
                      "rss_anon_end": end["RssAnon"], "rss_shmem_end": end["RssShmem"]}))


def report(paths):
    """Markdown tables of the JSON lines these runs printed: per model, context and batch, each
    configuration's decode tokens/s over the full cache's, median (range) over the repeats."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    out = []
    keys = sorted({(r["model"], r["context"], r["batch"]) for r in rows if "config" in r},
                  key=lambda k: (k[0], k[2], k[1]))
    for model, context, batch in keys:
        cell = {r["config"]: r for r in rows if "config" in r and
                (r["model"], r["context"], r["batch"]) == (model, context, batch)}
        full = cell.get("full")
        out.append(f"\n{model}, {context}-token prompts, batch {batch}: DynamicCache "
                   f"{full['tok_s_median']} tok/s ({full['tok_s_range'][0]}-"
                   f"{full['tok_s_range'][1]}), {full['repeats']} repeats\n")
        budgets = sorted({r["budget"] for r in cell.values() if r["budget"] < 1})
        out.append("| configuration | " + " | ".join(f"{100 * b:g} %" for b in budgets) + " |")
        out.append("|---|" + "---:|" * len(budgets))
        names = []
        for key in cell:
            name = key.split("@")[0]
            if "@" in key and name not in names:
                names.append(name)
        names.sort(key=lambda n: (n.startswith("kvpress"), n))
        if "sidecar_100" in cell:
            r = cell["sidecar_100"]
            out.append(f"| SidecarCache, no budget | {r['ratio_median']:.2f} "
                       f"({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})"
                       + " |" * len(budgets))
        for name in names:
            vals = []
            for b in budgets:
                r = cell.get(f"{name}@{b:g}")
                vals.append("–" if r is None else f"{r['ratio_median']:.2f} "
                            f"({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})")
            out.append(f"| {name} | " + " | ".join(vals) + " |")
        for r in rows:
            if r.get("breakdown") and (r["model"], r["context"], r["batch"]) == (model, context,
                                                                                  batch):
                parts = ", ".join(f"{k} {v}" for k, v in r.items() if k not in (
                    "model", "context", "batch", "breakdown"))
                out.append(f"\nper step, {r['breakdown']}: {parts}")
    return "\n".join(out)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2", help="smollm2,gemma3")
    ap.add_argument("--server", default=None, help="a running sidecar (default: start one "
                    "from $KVSIDECAR_BIN)")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--kvpress", default="snapkv", help="kvpress presses to run beside "
                    "(engine.kvpress_configs names; empty: none)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--breakdown", default="snapkv", help="policy timed part by part at 25 %% "
                    "(empty: none)")
    ap.add_argument("--rss", action="store_true", help="also the memory of a fresh process")
    ap.add_argument("--rss-model", default="smollm2")
    ap.add_argument("--rss-batch", type=int, default=4)
    ap.add_argument("--rss-prompt-tokens", type=int, default=1024)
    ap.add_argument("--rss-new-tokens", type=int, default=16)
    ap.add_argument("--rss-child", choices=["dynamic", "sidecar_25"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(args)
    policies = [p for p in args.policies.split(",") if p]
    presses = [p for p in args.kvpress.split(",") if p]
    budgets = [float(b) for b in args.budgets.split(",")]

    import torch

    import kvsidecar as kvs
    from kvsidecar.hf import blocks_for, layout_for
    from kvsidecar.server import LocalServer
    torch.set_num_threads(args.threads)
    server = None
    if args.server is None:
        server = LocalServer(lease_ms=600000)
        server.__enter__()
        args.server = server.address
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    try:
        for name in args.models.split(","):
            model, tok = load(model_path(name))
            cfgs = configs(budgets, policies, presses)
            # Room for the widest batch at the longest context held whole twice (the sidecar
            # 100 % run and one budgeted run are never alive together, but the arena is cheap).
            need = blocks_for(model, max(contexts) + args.new_tokens + 64, max(batches))
            with kvs.Client(args.server, timeout=600) as client, \
                    client.attach(layout_for(model, "fp32"), num_blocks=need) as session:
                for context in contexts:
                    for batch in batches:
                        for row in measure(args, model, tok, session, name, context, batch,
                                           cfgs):
                            print(json.dumps(row), flush=True)
            del model
        if args.rss:
            for kind in ("dynamic", "sidecar_25"):
                out = subprocess.run(
                    [sys.executable, __file__, "--rss-child", kind, "--server", args.server,
                     "--rss-model", args.rss_model, "--threads", str(args.threads),
                     "--rss-batch", str(args.rss_batch),
                     "--rss-prompt-tokens", str(args.rss_prompt_tokens),
                     "--rss-new-tokens", str(args.rss_new_tokens)],
                    check=True, capture_output=True, text=True)
                print(out.stdout.strip().splitlines()[-1], flush=True)
    finally:
        if server is not None:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
