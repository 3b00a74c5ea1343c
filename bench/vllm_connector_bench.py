"""The vLLM connector on vLLM's CPU backend with SmolLM2-135M-Instruct (fp32, enforce_eager,
vLLM's own prefix caching on): time to first token for a shared 2K-token document on a miss, a
whole-prefix hit and a compressed hit (KeyDiff, 25 %); generation throughput with the connector
against without it; bytes the sidecar holds per prefix, whole and compressed.

    build/vllmenv/bin/python bench/vllm_connector_bench.py --kvsidecar build/service/kvsidecar

Each engine is a process of its own (tests/vllm/engine_job.py). Every TTFT is the wall time of a
``generate`` of one prompt with max_tokens=1, vLLM's cache emptied before it (so that a hit can
only come from the connector), the median of ``--repeats``; the document is the same in every
prompt of a measurement and the question after it differs. Throughput: ``--batch`` distinct
prompts of ``--gen-prompt`` tokens, ``--gen-tokens`` generated each, engines without and with
the connector run alternately ``--gen-rounds`` times; their tokens/s are compared per pair. Prints
a JSON summary (and writes it to ``--out``).
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))

import vllm_util as vu  # noqa: E402


def words(tok, n, seed):
    import random

    rng = random.Random(seed)
    vocab = [w for w in ("the a of river stone quiet market north winter letter garden paper "
                         "bridge lamp window orange silver morning travel story number "
                         "mountain valley harbor").split()]
    ids = []
    while len(ids) < n:
        ids += tok.encode(" " + " ".join(rng.choice(vocab) for _ in range(64)),
                          add_special_tokens=False)
    return ids[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvsidecar", default=os.path.join(HERE, "..", "build", "service",
                                                         "kvsidecar"))
    ap.add_argument("--model", default="")
    ap.add_argument("--doc", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-prompt", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--gen-rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["KVSIDECAR_BIN"] = os.path.abspath(args.kvsidecar)
    import vllm_model
    from transformers import AutoTokenizer

    model = args.model or vllm_model.convert(os.path.join(
        os.path.expanduser("~/.cache/kvsidecar/models"), "smollm2-vllm"))
    tok = AutoTokenizer.from_pretrained(model)
    tmp = tempfile.mkdtemp(prefix="kvs-vllm-bench-")
    doc = words(tok, args.doc, 1)
    questions = [tok.encode(f"\nQuestion {i}: what is the story about, in {i + 3} words?",
                            add_special_tokens=False) for i in range(args.repeats + 1)]
    fresh_docs = [words(tok, args.doc, 100 + i) for i in range(args.repeats)]
    common = dict(max_model_len=args.doc + 256, max_tokens=1, max_num_seqs=args.batch,
                  kv_cache_gib=1.0, dtype="float32")
    os.makedirs(os.path.join(tmp, "sidecar"))
    server = vu.sidecar(os.path.join(tmp, "sidecar"), extra=["--host_tier_bytes=4Gi"])
    token = vu.token_file(tmp, "team-a")
    result = {"doc_tokens": args.doc, "model": "SmolLM2-135M-Instruct fp32"}
    gen = [words(tok, args.gen_prompt, 1000 + i) for i in range(args.batch * args.gen_rounds)]
    gen_round = lambda r: {"prompts": gen[r * args.batch:(r + 1) * args.batch],  # noqa: E731
                           "max_tokens": args.gen_tokens, "reset": True}
    try:
        # Without the connector: misses, and throughput.
        base = vu.Engine(tmp, model, [[d + questions[0]] for d in fresh_docs], None, **common)
        r_base = base.wait()
        result["ttft_miss_no_connector_s"] = _median(r_base)
        # Whole prefixes: a miss (computed, then published), then hits on the same document.
        whole_cfg = vu.connector(server, token, tier="host")
        rounds = [[doc + questions[0]]] + [[doc + q] for q in questions[1:]] + \
            [[d + questions[0]] for d in words_docs(tok, args)]
        whole = vu.Engine(tmp, model, rounds, whole_cfg, **common)
        r_whole = whole.wait()
        hits = r_whole[1:1 + args.repeats]
        result["ttft_whole_hit_s"] = _median(hits)
        result["whole_hit_cached_tokens"] = hits[0]["outputs"][0]["num_cached_tokens"]
        result["ttft_miss_with_connector_s"] = _median(r_whole[1 + args.repeats:])
        result["bytes_whole_prefix"] = _bytes(whole.log(), "blocks published", args.doc)
        # Compressed prefixes (KeyDiff, 25 % of the document).
        comp_cfg = vu.connector(server, token, tier="host", policy="keydiff", budget="25%")
        comp = vu.Engine(tmp, model, [[doc + questions[0]]] + [[doc + q] for q in questions[1:]],
                         comp_cfg, prefix_tokens=args.doc, **common)
        r_comp = comp.wait()
        result["ttft_miss_compressing_s"] = r_comp[0]["wall_s"]
        result["ttft_compressed_hit_s"] = _median(r_comp[1:])
        result["compressed_hit_cached_tokens"] = r_comp[1]["outputs"][0]["num_cached_tokens"]
        result["bytes_compressed_prefix"] = _bytes(comp.log(), "published compressed", args.doc)
        # Generation throughput, alternating engines without and with the connector.
        pairs = []
        for r in range(args.gen_rounds):
            a = vu.run(tmp, model, [gen_round(r)], None, **common)
            b = vu.run(tmp, model, [gen_round(r)], vu.connector(server, token, tier="host"),
                       **common)
            ta, tb = _tps(a[0]), _tps(b[0])
            pairs.append({"without_tok_s": ta, "with_tok_s": tb, "ratio": tb / ta})
        result["generation"] = pairs
        result["generation_ratio_median"] = statistics.median(p["ratio"] for p in pairs)
    finally:
        server.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def words_docs(tok, args):
    return [words(tok, args.doc, 200 + i) for i in range(args.repeats)]


def _median(rounds):
    return statistics.median(r["wall_s"] for r in rounds)


def _tps(round_):
    return sum(len(o["tokens"]) for o in round_["outputs"]) / round_["wall_s"]


def _bytes(log, what, doc_tokens):
    """Bytes of the first publish logged (the document's prefix)."""
    m = re.search(what + r".*?\((\d+) bytes\)", log)
    return int(m.group(1)) if m else None


if __name__ == "__main__":
    main()
