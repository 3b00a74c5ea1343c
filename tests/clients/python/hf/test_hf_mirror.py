"""SidecarCache's slot mirror (kvsidecar.hf_mirror) against the arena, on tiny transformers
models and a real kvsidecar server on loopback.

After every decode step, for every budgeted policy, the mirror holds exactly what the sidecar
holds: the same count per (row, layer), the same positions per (head, slot) and the same K/V
bits, slot for slot. It reads each (row, layer) from the arena once after the prefill and then
follows the DecodeStep answers (D2O's merges excepted: those layers are read again). With and
without the mirror the model computes the same tokens and logits."""

import numpy as np
import pytest
import torch

import kvsidecar as kvs
from kvsidecar.hf import SidecarCache, blocks_for, layout_for

from test_hf_cache import CACHE, _left_padded, make_model, prompts

torch.set_num_threads(1)
POLICIES = ["streaming_llm", "keydiff", "knorm", "h2o", "tova", "snapkv", "cake", "d2o", "caote"]


@pytest.fixture
def session(server):
    model = make_model()
    with kvs.Client(server.address, timeout=60, worker_name="pytest-hf-mirror") as client, \
            client.attach(layout_for(model, "fp32"),
                          num_blocks=blocks_for(model, 128, batch_size=8)) as s:
        yield s


def check_mirror(session, cache):
    """The mirror equals the arena, slot for slot, in every clean (layer, row)."""
    cache.sync()
    mirror = cache._mirror
    assert mirror is not None
    for row, seq in enumerate(cache.sequence_ids):
        layout = session.get_layout(seq)
        for entry in layout.layers:
            layer = entry.layer
            if not mirror.clean[layer, row]:
                continue
            kv = session.read_layer(layout, layer)
            n = int(mirror.count[layer, row])
            assert n == entry.count, (row, layer)
            assert np.array_equal(mirror.pos[layer, row, :, :n], kv.positions), (row, layer)
            assert np.array_equal(mirror.k[layer, row, :, :n].numpy(), kv.k), (row, layer)
            assert np.array_equal(mirror.v[layer, row, :, :n].numpy(), kv.v), (row, layer)


def _decode(model, cache, ids, steps, mask=None, each=None):
    """Greedy steps in a plain loop; returns the logits of every step."""
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True).logits
        for _ in range(steps):
            tok = logits[:, -1:].argmax(-1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
            logits = model(tok, attention_mask=mask, **{CACHE: cache}, use_cache=True).logits
            out.append(logits[:, -1])
            if each is not None:
                each()
    return torch.stack(out, 1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", POLICIES + ["pyramidkv"])
def test_mirror_holds_what_the_arena_holds_after_every_step(session, family, name):
    model = make_model(family)
    if name == "pyramidkv":
        spec = kvs.policy("snapkv", allocator=kvs.common_pb2.LayerAllocator(
            kind=kvs.common_pb2.LAYER_ALLOCATOR_PYRAMIDKV))
    else:
        spec = kvs.policy(name)
    cache = SidecarCache(session, model, policy=spec, budget=0.25)
    _decode(model, cache, prompts(2), 8, each=lambda: check_mirror(session, cache))
    if name != "d2o":
        # Read once after the prefill (every layer of every row), then followed step by step.
        assert cache._mirror.refills == 3 * 2
    cache.release()


def test_mirror_rows_of_unequal_counts(session):
    """Left-padded rows hold different counts until the budget caps them: each row's decode
    token goes into its own slot count, the rest of the row masked."""
    model = make_model()
    ids, mask = _left_padded()
    cache = SidecarCache(session, model, policy="snapkv", budget=20)
    _decode(model, cache, ids, 6, mask=mask, each=lambda: check_mirror(session, cache))
    assert cache.counts[0] == [20] * 3 and cache.counts[2] == [20] * 3
    cache.release()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name,budget", [("snapkv", 0.25), ("h2o", 0.5), ("d2o", 0.25),
                                         ("streaming_llm", None)])
def test_with_and_without_the_mirror_the_model_computes_the_same(session, family, name, budget):
    model = make_model(family)
    ids = prompts(2)
    with_mirror = SidecarCache(session, model, policy=name, budget=budget)
    a = _decode(model, with_mirror, ids, 8)
    without = SidecarCache(session, model, policy=name, budget=budget, mirror=False)
    b = _decode(model, without, ids, 8)
    assert without._mirror is None
    assert torch.equal(a, b)
    assert with_mirror.counts == without.counts
    with_mirror.release()
    without.release()


def test_padded_rows_with_and_without_the_mirror(session):
    model = make_model()
    ids, mask = _left_padded()
    with_mirror = SidecarCache(session, model, policy="snapkv", budget=20)
    a = _decode(model, with_mirror, ids, 6, mask=mask)
    without = SidecarCache(session, model, policy="snapkv", budget=20, mirror=False)
    b = _decode(model, without, ids, 6, mask=mask)
    # The decode token sits at another slot (each row's count, not after the widest row's):
    # the same numbers attended, summed in another order.
    assert float((a - b).abs().max()) <= 1e-5
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    with_mirror.release()
    without.release()


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "keydiff", "cake", "d2o"])
def test_hold_budget_false_compresses_the_prompt_once_as_kvpress_does(session, name):
    """hold_budget=False keeps what hold_budget=True keeps of the prompt, then every decoded
    token (kvpress's protocol); its decode steps send no query, so the sidecar only appends."""
    model = make_model()
    ids = prompts(2)
    held, kept = {}, {}
    for hold in (True, False):
        cache = SidecarCache(session, model, policy=name, budget=0.25, hold_budget=hold)
        with torch.no_grad():
            logits = model(ids, **{CACHE: cache}, use_cache=True).logits
        cache.sync()
        kept[hold] = [[sorted(session.read_layer(session.get_layout(seq), layer).positions[0])
                       for layer in range(3)] for seq in cache.sequence_ids]
        _decode(model, cache, logits[:, -1:].argmax(-1), 4, each=lambda: check_mirror(session,
                                                                                      cache))
        held[hold] = cache.counts
        if not hold:
            assert all(a is None for a in cache.last_attention)
            assert all(session.get_layout(seq).budget.tokens_per_layer == 0
                       for seq in cache.sequence_ids)
        cache.release()
    assert kept[True] == kept[False]
    budget = int(np.ceil(0.25 * len(ids[0])))
    if name not in ("cake", "d2o"):  # their allocators split the budget unevenly
        assert held[True] == [[budget] * 3] * 2
        assert held[False] == [[budget + 5] * 3] * 2  # 4 steps + the one that ended the prefill
