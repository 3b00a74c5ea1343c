"""The quality harness's tasks answered by vLLM (CPU backend) through kvsidecar.vllm: each
prompt's document (everything before its question) stored compressed by the sidecar, then the
question answered from the compressed prefix, beside vLLM with its whole cache.

    build/vllmenv/bin/python bench/quality/vllm_run.py --kvsidecar build/service/kvsidecar \\
        [--tasks niah_single,niah_multikey] [--context 2048] [--samples 50] \\
        [--policies full,streaming_llm,keydiff,knorm,snapkv] [--budgets 0.1,0.25,0.5]

Same prompts as run.py (tasks.py, the same seed, SmolLM2's chat template) and the same scoring
(scoring.exact_match). Per configuration one vLLM engine (tests/vllm/engine_job.py, fp32,
enforce_eager, prefix caching on) runs every prompt twice: the first pass computes it and the
connector publishes its document compressed (``prefix_tokens`` = the document's length, so the
question is never part of what is compressed); vLLM's own cache is then emptied, and the second
pass loads the compressed document (its kept keys re-rotated to positions 0..C-1) and computes
the question after it. Only the second pass is scored. ``full`` is vLLM without the connector.
SnapKV's window (``--window``, 32) is the document's last 32 tokens: their queries, not the
question's, choose what it keeps (the compressed copy serves any question after that document).

Rows go to --out (bench/quality/results/vllm/, its own report: ``report.py --out`` on that
folder), one CSV per task and context, resumable: done samples are skipped. Cells run --chunk
samples at a time, every cell before the next chunk.
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "vllm"))

import scoring  # noqa: E402
import tasks as task_gen  # noqa: E402


def chat_template(tok):
    mark = "\x00USER\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                   add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


def document_tokens(tok, sample, template) -> int:
    """Tokens before the question: tasks.py appends encode(question) + encode(turn end + answer
    prefix) to the document."""
    target = sample.meta["key"]
    if sample.task == "niah_multivalue":
        question = (f"\nWhat are all the special magic numbers for {target} mentioned in the "
                    "provided text?")
        prefix = f"The special magic numbers for {target} mentioned in the provided text are"
    else:
        question = (f"\nWhat is the special magic number for {target} mentioned in the provided "
                    "text?")
        prefix = f"The special magic number for {target} mentioned in the provided text is"
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    tail = enc(question) + enc(template[1] + prefix)
    assert sample.ids[-len(tail):] == tail, "the prompt does not end with its question"
    return len(sample.ids) - len(tail)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvsidecar", default=os.path.join(HERE, "..", "..", "build", "service",
                                                         "kvsidecar"))
    ap.add_argument("--tasks", default="niah_single,niah_multikey")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="full,keydiff,snapkv,streaming_llm,knorm")
    ap.add_argument("--budgets", default="0.25,0.1,0.5")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=10, help="samples per engine run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vllm"))
    args = ap.parse_args()
    os.environ["KVSIDECAR_BIN"] = os.path.abspath(args.kvsidecar)
    import vllm_model
    import vllm_util as vu
    from transformers import AutoTokenizer

    model = vllm_model.convert(os.path.join(os.path.expanduser("~/.cache/kvsidecar/models"),
                                            "smollm2-vllm"))
    tok = AutoTokenizer.from_pretrained(model)
    template = chat_template(tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvs-vllm-quality-")
    os.makedirs(os.path.join(tmp, "sidecar"))
    server = vu.sidecar(os.path.join(tmp, "sidecar"), extra=["--host_tier_bytes=4Gi"])
    samples = {t: task_gen.make_samples(t, args.context, args.samples, args.seed, enc, template)
               for t in args.tasks.split(",")}
    stores = {t: scoring.ResultStore(os.path.join(
        args.out, f"smollm2_vllm_{t}_{args.context // 1024}k.csv")) for t in samples}
    # Cells in the order they run (a run stopped early has the first ones): the full cache,
    # then every policy at one budget before the next budget.
    cells = [("full", 1.0)] + [(p, float(b)) for b in args.budgets.split(",")
                               for p in args.policies.split(",") if p != "full"]
    if "full" not in args.policies.split(","):
        cells = cells[1:]
    try:
        # --chunk samples of every cell before the next ones: rows are stored as each engine
        # finishes, so a run stopped early has every cell at the same number of samples.
        for start in range(0, args.samples, args.chunk):
            part = {t: ss[start:start + args.chunk] for t, ss in samples.items()}
            for policy, budget in cells:
                run_cell(args, tok, model, server, part, stores, policy, budget, tmp)
    finally:
        server.close()


def _row(task, context, policy, budget, params):
    return {"model": "smollm2", "task": task, "context": context, "protocol": "prefill",
            "method": "vllm", "policy": policy, "budget": budget, "params": params}


def run_cell(args, tok, model, server, samples, stores, policy, budget, tmp):
    import vllm_util as vu

    token = vu.token_file(tmp, "team-a")
    params = ("vLLM, whole cache" if policy == "full" else
              f"vLLM from a compressed prefix (the document); window {args.window}"
              if policy == "snapkv" else "vLLM from a compressed prefix (the document)")
    todo = {t: [s for s in ss if s.index not in stores[t].samples_done(
        scoring.cell_key(_row(t, args.context, policy, budget, params)))]
        for t, ss in samples.items()}
    if not any(todo.values()):
        return
    cfg = None
    if policy != "full":
        cfg = vu.connector(server, token, tier="host", policy=policy, budget=f"{budget * 100:g}%")
        if policy == "snapkv":
            cfg["window"] = args.window
    t0 = time.time()
    template = chat_template(tok)
    rounds, plan = [], []
    for task, batch in todo.items():
        if not batch:
            continue
        docs = [document_tokens(tok, s, template) for s in batch]
        prompts = [s.ids for s in batch]
        # With the connector: every prompt once (its document published compressed), vLLM's
        # cache emptied, then every prompt again from the compressed documents.
        if cfg:
            rounds.append({"prompts": prompts, "max_tokens": 1, "reset": True,
                           "prefix_tokens": docs})
        rounds.append({"prompts": prompts, "max_tokens": task_gen.MAX_NEW_TOKENS[task],
                       "reset": True, "prefix_tokens": docs})
        plan.append((task, batch, docs, len(rounds) - 1))
    # One engine for the cell's tasks.
    out = vu.run(tmp, model, rounds, cfg, max_model_len=args.context + 256,
                 max_num_batched_tokens=args.context + 256, kv_cache_gib=1.0,
                 ignore_eos=False, max_num_seqs=8, timeout=4 * 3600)
    for task, batch, docs, index in plan:
        scored = out[index]
        rows = []
        per_prompt = scored["wall_s"] / len(batch)
        for s, o, doc in zip(batch, scored["outputs"], docs):
            text = tok.decode(o["tokens"], skip_special_tokens=True)
            kept = (o["num_cached_tokens"] / doc) if cfg else 1.0
            rows.append(dict(_row(task, args.context, policy, budget, params), sample=s.index,
                             correct=scoring.exact_match(text, s.answers),
                             kept_fraction=round(kept, 4), truncated=False,
                             answer=scoring.answer_line(text).strip()[:120],
                             expected=" ".join(s.answers), seconds=round(per_prompt, 3)))
        stores[task].add(rows)
        acc = sum(r["correct"] for r in rows) / max(1, len(rows))
        print(f"  vllm {task} {args.context} {policy:14s} {budget:<5} acc {acc:.2f} "
              f"({len(rows)} prompts, {time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
