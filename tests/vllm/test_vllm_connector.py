"""kvsidecar.vllm.SidecarConnector against a real vLLM engine (CPU backend) and real sidecars.

A random-weight Llama (head size 32) is built in the test; every engine is a process of its own
(tests/vllm/engine_job.py) with vLLM's own prefix caching on, emptied between rounds so that a
hit can only come from the connector. Greedy tokens are compared with an engine without the
connector. Two sidecars share one redis-server (the remote tier) as two replicas' sidecars would;
both know two tenants by their tokens.
"""

import os
import random
import re

import pytest

import vllm_util as vu

BLOCK = 128
PROMPT_TOKENS = 300        # two full blocks before the prompt's last token
HIT = 2 * BLOCK


def _prompt(seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(PROMPT_TOKENS)]


A, B = _prompt(1), _prompt(2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("vllm"))
    from tiny_llama import build

    model = build(os.path.join(tmp, "tiny-llama"))
    redis = vu.Redis()
    for name in ("s1", "s2"):
        os.makedirs(os.path.join(tmp, name))
    s1 = vu.sidecar(os.path.join(tmp, "s1"), redis)
    s2 = vu.sidecar(os.path.join(tmp, "s2"), redis)
    world = {"tmp": tmp, "model": model, "redis": redis, "s1": s1, "s2": s2,
             "a": vu.token_file(tmp, "team-a"), "b": vu.token_file(tmp, "team-b")}
    # The reference: the same prompts without the connector, started beside the first test's
    # engine (an engine spends most of its start waiting on one core).
    world["ref_engine"] = vu.Engine(tmp, model, [[A, B]], None)
    yield world
    for server in (s1, s2):
        server.close()
    redis.close()


def _ref(world, prompt):
    if "ref" not in world:
        ref = world.pop("ref_engine").wait()
        world["ref"] = {tuple(A): ref[0]["outputs"][0]["tokens"],
                        tuple(B): ref[0]["outputs"][1]["tokens"]}
    return world["ref"][tuple(prompt)]


def _check(out, prompt, world, cached=None):
    assert out["tokens"] == _ref(world, prompt)
    if cached is not None:  # (after a failed load vLLM still counts the tokens it planned)
        assert out["num_cached_tokens"] == cached, out


def test_repeated_prompt_skips_its_prefill_with_the_same_tokens(world):
    cfg = vu.connector(world["s1"], world["a"], tier="remote")
    engine = vu.Engine(world["tmp"], world["model"], [[A, B], [A]], cfg)
    rounds = engine.wait()
    for out, prompt in zip(rounds[0]["outputs"], (A, B)):
        _check(out, prompt, world, 0)            # first sight: computed, then published
    _check(rounds[1]["outputs"][0], A, world, HIT)  # vLLM's cache emptied: the sidecar's blocks
    assert "blocks published" in engine.log()
    keys = world["redis"].cli("--scan", "--pattern", "kvs:*").split()
    assert any(":m" in k for k in keys), keys      # the copies are in Redis


def test_second_engine_hits_the_first_ones_prefix_through_redis(world):
    # Another engine process on another sidecar: only Redis is shared.
    rounds = vu.run(world["tmp"], world["model"], [[A]],
                    vu.connector(world["s2"], world["a"], tier="remote"))
    _check(rounds[0]["outputs"][0], A, world, HIT)


def test_another_tenant_never_loads_the_prefix(world):
    engine = vu.Engine(world["tmp"], world["model"], [[A]],
                       vu.connector(world["s2"], world["b"], tier="remote"))
    rounds = engine.wait()
    _check(rounds[0]["outputs"][0], A, world, 0)
    log = engine.log()
    # Nothing loaded; team-b stores its own copy, apart from team-a's.
    assert "blocks published" in log and not re.search(r"kvsidecar: request \S+: loading", log)


def test_damaged_copy_is_recomputed(world):
    redis = world["redis"]
    team_a = "kvs:{" + "team-a".encode().hex()
    chunks = [k for k in redis.cli("--scan", "--pattern", "kvs:*:c:*").split()
              if k.startswith(team_a)]
    assert chunks
    for key in chunks:
        redis.cli("SETRANGE", key, "64", "damaged")
    engine = vu.Engine(world["tmp"], world["model"], [[A]],
                       vu.connector(world["s1"], world["a"], tier="remote"))
    rounds = engine.wait()
    _check(rounds[0]["outputs"][0], A, world)
    log = engine.log()
    assert "vLLM recomputes them" in log and "DataLoss" in log, log[-4000:]


def test_sidecar_killed_mid_load_recomputes(world):
    tmp = world["tmp"]
    os.makedirs(os.path.join(tmp, "s3"))
    s3 = vu.sidecar(os.path.join(tmp, "s3"))
    try:
        cfg = vu.connector(s3, world["a"], tier="host", load_delay_s=4)
        engine = vu.Engine(tmp, world["model"], [[A], [A]], cfg)
        engine.wait_log("blocks published")
        engine.wait_log("loading 2 blocks")
        s3.process.kill()
        rounds = engine.wait()
    finally:
        s3.close()
    _check(rounds[0]["outputs"][0], A, world, 0)
    _check(rounds[1]["outputs"][0], A, world)
    assert "vLLM recomputes them" in engine.log()


def test_compressed_prefixes_load_their_kept_tokens(world):
    # At 100 % nothing is evicted: exactly the uncompressed tokens. At 25 % the second prompt
    # starts from the 64 kept tokens (re-rotated to positions 0..63). Two engines side by side.
    full = vu.Engine(world["tmp"], world["model"], [[A], [A]],
                     vu.connector(world["s1"], world["a"], tier="host", policy="keydiff",
                                  budget="100%"))
    quarter = vu.Engine(world["tmp"], world["model"], [[B], [B]],
                        vu.connector(world["s1"], world["a"], tier="host",
                                     policy="streaming_llm", budget="25%"))
    rounds = full.wait()
    _check(rounds[0]["outputs"][0], A, world, 0)
    _check(rounds[1]["outputs"][0], A, world, HIT)
    assert "starts from a compressed prefix: 256 prompt tokens kept as 256" in full.log()
    rounds = quarter.wait()
    _check(rounds[0]["outputs"][0], B, world, 0)
    second = rounds[1]["outputs"][0]
    assert second["num_cached_tokens"] == 64, second   # 25 % of 256
    assert len(second["tokens"]) == len(_ref(world, B))
    assert "256 prompt tokens kept as 64" in quarter.log()
