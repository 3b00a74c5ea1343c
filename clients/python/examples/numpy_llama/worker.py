"""A real LLM worker with its KV cache in the sidecar.

    python -m numpy_llama.worker --prompt-file bench/quality/data/alice_ch1.txt \\
        --question "What was the name of Alice's cat?" --budget 25% --policy snapkv \\
        --kvsidecar-bin build/service/kvsidecar

Runs SmolLM2-135M-Instruct (numpy, CPU) twice on the same prompt: once with the full cache in
this process (the reference), once with the cache in the sidecar under --budget with --policy
(prefill in blocks, then greedy decode through DecodeStep). Prints the sidecar run's text, the KV
memory the sidecar kept vs a full cache, and the agreement with the full-cache run: the greedy
tokens in common, and with the reference tokens forced into a third (sidecar) run, the top-1
agreement and the mean KL(full || compressed) of the next-token distributions.

The sidecar is --server ADDRESS, or a private one started from --kvsidecar-bin (or
$KVSIDECAR_BIN) on loopback for the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np


def _parse_budget(text: str, prompt_len: int) -> int:
    text = text.strip()
    if text.endswith("%"):
        frac = float(text[:-1]) / 100.0
        if not 0 < frac <= 1:
            raise ValueError(f"--budget {text}: a percentage must be in (0, 100]")
        return max(1, int(round(frac * prompt_len)))
    n = int(text)
    if n < 0:
        raise ValueError(f"--budget {text} must be >= 0 (0 = unbounded)")
    return n


def kl_and_top1(ref_logits: List[np.ndarray], logits: List[np.ndarray]) -> Tuple[float, float]:
    """Mean KL(ref || other) in nats and the top-1 agreement over aligned steps."""
    from .llama import log_softmax

    n = min(len(ref_logits), len(logits))
    if n == 0:
        return float("nan"), float("nan")
    a = log_softmax(np.stack(ref_logits[:n]))
    b = log_softmax(np.stack(logits[:n]))
    kl = float(np.mean(np.sum(np.exp(a) * (a - b), axis=-1)))
    top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    return kl, top1


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_prompt(tok: Any, text: str, question: Optional[str], chat: bool) -> List[int]:
    if question:
        user = f"{text.strip()}\n\nQuestion: {question}"
    else:
        user = text
    ids: List[int] = tok.encode(tok.chat_prompt(user) if chat else user)
    return ids


@contextlib.contextmanager
def _server(address: Optional[str], binary: Optional[str], max_tokens: int) -> Iterator[str]:
    if address:
        yield address
        return
    from kvsidecar.server import LocalServer

    with LocalServer(binary, extra_args=["--arena_capacity_bytes=2G"]) as srv:
        yield srv.address


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import kvsidecar as kvs

    from . import load_model
    from .llama import LocalKVCache
    from .sidecar_cache import (SidecarKVCache, blocks_needed, layout_for, policy_spec)

    model, tok = load_model(args.model)
    text = open(args.prompt_file, encoding="utf-8").read() if args.prompt_file else args.prompt
    if not text:
        raise SystemExit("give --prompt-file or --prompt")
    prompt = build_prompt(tok, text, args.question, not args.no_chat)
    if args.max_prompt_tokens and len(prompt) > args.max_prompt_tokens:
        raise SystemExit(f"the prompt has {len(prompt)} tokens, over --max-prompt-tokens "
                         f"{args.max_prompt_tokens}")
    budget = _parse_budget(args.budget, len(prompt))
    stops = [tok.im_end_id, tok.eos_id]
    n_new = args.max_new_tokens

    # Reference: the full cache in this process.
    ref = model.generate(prompt, LocalKVCache(model.cfg, len(prompt) + n_new), n_new,
                         args.block_size, stop_ids=stops)

    spec = policy_spec(args.policy, budget)
    max_tokens = len(prompt) + n_new + args.block_size
    result = {"prompt_tokens": len(prompt), "budget_tokens": budget, "policy": args.policy,
              "prefill_mode": args.prefill_mode, "dtype": args.dtype}
    with _server(args.server, args.kvsidecar_bin, max_tokens) as address, \
            kvs.Client(address, timeout=120, worker_name="numpy_llama.worker") as client:
        nblocks = blocks_needed(model.cfg, max_tokens) * (1 if args.no_forced else 2)
        with client.attach(layout_for(model.cfg, args.dtype), num_blocks=nblocks) as session:
            cache = SidecarKVCache(session, model.cfg, spec, budget, args.prefill_mode)
            gen = model.generate(prompt, cache, n_new, args.block_size, stop_ids=stops)
            result.update({
                "text": tok.decode(gen.tokens),
                "reference_text": tok.decode(ref.tokens),
                "generated_tokens": len(gen.tokens),
                "kv_bytes_kept": cache.kv_bytes(),
                "kv_bytes_full": cache.full_kv_bytes(),
                "kv_tokens_per_layer": max(cache.counts),
                "peak_kv_bytes": cache.peak_tokens * 2 * model.cfg.n_kv_heads
                * model.cfg.head_dim * kvs.dtype_bytes(session.layout.dtype),
                "greedy_common_prefix": common_prefix(ref.tokens, gen.tokens),
                "reference_tokens": len(ref.tokens),
                "decode_tokens_per_s_sidecar": gen.decode_tokens_per_s,
                "decode_tokens_per_s_local": ref.decode_tokens_per_s,
                "prefill_tokens_per_s_sidecar": gen.prefill_tokens_per_s,
                "prefill_tokens_per_s_local": ref.prefill_tokens_per_s,
            })
            cache.release()
            if not args.no_forced and ref.tokens:
                forced_cache = SidecarKVCache(session, model.cfg, spec, budget, args.prefill_mode)
                forced = model.generate(prompt, forced_cache, len(ref.tokens), args.block_size,
                                        forced=ref.tokens)
                kl, top1 = kl_and_top1(ref.logits, forced.logits)
                result.update({"forced_top1_agreement": top1, "forced_mean_kl": kl})
                forced_cache.release()
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from .sidecar_cache import POLICIES

    ap = argparse.ArgumentParser(
        prog="python -m numpy_llama.worker",
        description="SmolLM2 on the CPU with its KV cache in the sidecar, vs a full cache.")
    ap.add_argument("--prompt-file", help="text file with the (long) prompt")
    ap.add_argument("--prompt", help="the prompt text (instead of --prompt-file)")
    ap.add_argument("--question", help="appended after the text as 'Question: ...'")
    ap.add_argument("--no-chat", action="store_true", help="raw text, no chat template")
    ap.add_argument("--budget", default="25%",
                    help="KV tokens kept per layer: N, or P%% of the prompt (default 25%%)")
    ap.add_argument("--policy", default="snapkv", choices=POLICIES)
    ap.add_argument("--prefill-mode", default="full", choices=["full", "blockwise"],
                    help="compress once after the prompt (full) or at every prefill block")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=0, help="refuse longer prompts")
    ap.add_argument("--block-size", type=int, default=64, help="prefill block, tokens")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                    help="K/V storage dtype in the sidecar")
    ap.add_argument("--server", help="address of a running sidecar (host:port)")
    ap.add_argument("--kvsidecar-bin", help="start a private sidecar from this binary "
                    "(default $KVSIDECAR_BIN)")
    ap.add_argument("--model", help="GGUF path (default: deploy/fetch_model.sh's cache)")
    ap.add_argument("--no-forced", action="store_true",
                    help="skip the teacher-forced run (top-1 agreement, KL)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    r = run(args)
    r["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(r))
        return 0
    mib = 1 << 20
    print(f"policy {r['policy']} ({r['prefill_mode']} prefill), budget {r['budget_tokens']} "
          f"tokens/layer, prompt {r['prompt_tokens']} tokens")
    print(f"--- generated with the sidecar cache ---\n{r['text']}")
    print(f"--- generated with the full cache ---\n{r['reference_text']}")
    kept_pct = 100.0 * r["kv_bytes_kept"] / max(r["kv_bytes_full"], 1)
    print(f"KV memory kept: {r['kv_bytes_kept'] / mib:.2f} MiB vs full "
          f"{r['kv_bytes_full'] / mib:.2f} MiB ({kept_pct:.1f}%), "
          f"{r['kv_tokens_per_layer']} tokens/layer; peak {r['peak_kv_bytes'] / mib:.2f} MiB")
    print(f"agreement: greedy tokens identical for the first {r['greedy_common_prefix']} of "
          f"{r['reference_tokens']}", end="")
    if "forced_top1_agreement" in r:
        print(f"; teacher-forced top-1 {100 * r['forced_top1_agreement']:.1f}%, "
              f"mean KL {r['forced_mean_kl']:.4f} nats")
    else:
        print()
    print(f"decode: {r['decode_tokens_per_s_sidecar']:.2f} tokens/s with the sidecar, "
          f"{r['decode_tokens_per_s_local']:.2f} with the local cache; wall {r['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
