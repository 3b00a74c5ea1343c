"""Runs one vLLM engine (CPU backend) on a job and prints its results: the vLLM side of the
connector's tests and benchmarks, in a process of its own (each engine is a separate process, as
two replicas would be).

    python tests/vllm/engine_job.py JOB.json OUT.json

JOB: {"model": dir, "connector": extra_config or null, "max_model_len": n, "rounds": [[prompt,
...], ...], "max_tokens": n, "reset_prefix_cache": bool, "prefix_tokens": n (optional),
"block_size": n}. Each round is one ``generate`` call; with reset_prefix_cache vLLM's own prefix
cache is emptied before each round, so that a hit can only come from the connector. OUT: per round
and prompt the generated token ids and ``num_cached_tokens``, and each round's wall time.
"""

import json
import os
import sys
import time


def main() -> None:
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_RPC_BASE_PATH", job.get("rpc_dir") or "/tmp")
    from vllm import LLM, SamplingParams

    kwargs = dict(model=job["model"], enforce_eager=True, dtype=job.get("dtype", "float32"),
                  max_model_len=job.get("max_model_len", 2048), skip_tokenizer_init=True,
                  enable_prefix_caching=True, block_size=job.get("block_size", 128),
                  max_num_seqs=job.get("max_num_seqs", 8), seed=0)
    if job.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    # The CPU backend reserves a share of the machine's memory by default; a fixed, small KV
    # cache lets several engines and the sidecar share one machine.
    kwargs["kv_cache_memory_bytes"] = int(job.get("kv_cache_gib", 0.25) * (1 << 30))
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "SidecarConnector", "kv_connector_module_path": "kvsidecar.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": job["connector"]}
    llm = LLM(**kwargs)
    rounds = []
    for spec in job["rounds"]:
        # A round is a list of prompts, or {"prompts": [...], "max_tokens": n, "reset": bool,
        # "prefix_tokens": n}.
        if not isinstance(spec, dict):
            spec = {"prompts": spec}
        if spec.get("reset", job.get("reset_prefix_cache")):
            llm.reset_prefix_cache()
        # prefix_tokens: one for the round, or one per prompt.
        prefix = spec.get("prefix_tokens", job.get("prefix_tokens"))
        prefixes = prefix if isinstance(prefix, list) else [prefix] * len(spec["prompts"])
        params = []
        for n in prefixes:
            extra = {"kv_transfer_params": {"kvsidecar": {"prefix_tokens": n}}} if n else None
            params.append(SamplingParams(
                temperature=0.0, max_tokens=spec.get("max_tokens", job.get("max_tokens", 8)),
                ignore_eos=job.get("ignore_eos", True), extra_args=extra))
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": x} for x in spec["prompts"]], params,
                            use_tqdm=False)
        wall = time.perf_counter() - start
        rounds.append({"wall_s": wall, "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
            for o in outs]})
    json.dump({"rounds": rounds}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
