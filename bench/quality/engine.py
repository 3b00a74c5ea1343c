"""The model side of the quality harness: one full prefill per batch of prompts, then every
configuration (full cache, a sidecar policy through kvsidecar.hf.SidecarCache, a kvpress press)
decoded from it.

One prefill serves every configuration because compressing after prefill does not change the
prefill itself: kvpress compresses a layer's cache in a hook after that layer's attention ran over
the whole prompt, and SidecarCache's prefill attends over the whole new block and compresses at
the Commit after the last layer. So the prefill runs once with DynamicCache, recording per layer
the post-RoPE K/V, the post-RoPE queries (what SidecarCache sends the sidecar), and the attention
input of the last positions with its rotary embeddings (what kvpress presses recompute their
window queries from); then:

  sidecar  the recorded K/V go into the reserved arena slots and the queries to the Commit
           through SidecarCache's own prefill path (the same BatchReserve, zero-copy writes and
           BatchCommit a model prefill makes), then the model decodes through the cache;
  kvpress  the press's own `compress(module, hidden_states, keys, values, attentions, kwargs)`
           runs per layer on the recorded tensors (what its forward hook calls), the compressed
           layers go into a DynamicCache, and the model decodes with the true position ids (as
           kvpress's pipeline does);
  full     the recorded DynamicCache as it is.

Protocols (shared/design EVALUATION.md): "prefill" compresses once after the prefill and decodes
without evicting (kvpress's protocol; the sidecar sequence has no budget and is compressed with
Compress(budget_tokens=N): a window policy's Compress carries its window's queries, the
every-query policies' evicts from what the Commit folded in); "decode" holds the budget while
decoding (a budgeted sidecar sequence: compressed after the prefill's Commit, every DecodeStep
evicts back to the budget; sidecar only).
"""

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kvsidecar.client import common_pb2
from kvsidecar.client import policy as make_policy
from kvsidecar.hf import SidecarCache, layer_windows

CAPTURE = "kvs_eval_capture"
# What kvpress's window presses may read of the attention input: the last HIDDEN_TAIL positions.
HIDDEN_TAIL = 128


@dataclass
class Config:
    """One row family: a method ("full", "sidecar", "kvpress"), its policy and budget."""
    method: str
    policy: str
    budget: float                      # fraction of the prompt kept per layer (1.0 = full)
    protocol: str                      # "prefill" or "decode" (see the module comment)
    params: str = ""                   # the parameters, as stated in the tables
    make: Optional[Callable[..., Any]] = None  # sidecar: (budget_tokens) -> PolicySpec;
    #                                            kvpress: (compression_ratio) -> press
    error: str = ""                    # set when the configuration cannot run (stated, not run)

    @property
    def name(self) -> str:
        return self.policy if self.method != "kvpress" else f"kvpress:{self.policy}"


def _capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
    rec = getattr(module, "_kvs_eval_rec", None)
    if rec is not None:
        rec.queries[module.layer_idx] = query.detach().float()
        rec.scale = float(kwargs.get("scaling") or module.scaling)
    # *args: kvpress wraps every registered attention function and passes dropout positionally.
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, *args,
                                           **kwargs)


if CAPTURE not in ALL_ATTENTION_FUNCTIONS._global_mapping:
    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)


@dataclass
class Prefill:
    """What one full prefill of B equal-length prompts recorded."""
    ids: torch.Tensor                                        # [B][T]
    cache: Any                                               # DynamicCache, the whole prompt
    logits: torch.Tensor                                     # [B][V] at the last position
    queries: Dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [B][Hq][T][D]
    hidden: Dict[int, torch.Tensor] = field(default_factory=dict)    # layer -> [B][tail][C]
    rope: Dict[int, Any] = field(default_factory=dict)               # layer -> (cos, sin) tail
    scale: float = 1.0

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _attentions(model) -> List[Any]:
    return [layer.self_attn for layer in model.model.layers]


def prefill(model, ids: torch.Tensor) -> Prefill:
    """The full-cache prefill of `ids` [B][T], recording what every configuration needs."""
    rec = Prefill(ids=ids, cache=DynamicCache(), logits=None)
    hooks = []

    def pre_hook(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        rec.hidden[module.layer_idx] = hs[:, -HIDDEN_TAIL:].detach()
        cos, sin = kwargs["position_embeddings"]
        rec.rope[module.layer_idx] = (cos[:, -HIDDEN_TAIL:], sin[:, -HIDDEN_TAIL:])

    for attn in _attentions(model):
        attn._kvs_eval_rec = rec
        hooks.append(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
    saved = model.config._attn_implementation
    model.config._attn_implementation = CAPTURE
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                        **{_cache_kwarg(model): rec.cache})
    finally:
        model.config._attn_implementation = saved
        for h in hooks:
            h.remove()
        for attn in _attentions(model):
            attn._kvs_eval_rec = None
    rec.logits = out.logits[:, -1].float()
    return rec


def _layer_kv(cache, layer: int):
    lay = cache.layers[layer]
    return lay.keys, lay.values


# -- runners: one per configuration, decoding from a prefill ----------------------------------------


class DynamicRunner:
    """Decodes with a DynamicCache holding (possibly compressed) prefill K/V, with true
    positions: the next token's position is the prompt length plus the tokens decoded."""

    def __init__(self, model, cache, position: int, batch: int) -> None:
        self.model, self.cache, self.position, self.batch = model, cache, position, batch
        self.kw = _cache_kwarg(model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B][t] tokens -> [B][t][V] logits."""
        t = ids.shape[1]
        pos = torch.arange(self.position, self.position + t)[None].expand(self.batch, t)
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                             **{self.kw: self.cache})
        self.position += t
        return out.logits.float()

    def kept_fraction(self, prompt: int) -> float:
        lens = [lay.keys.shape[2] for lay in self.cache.layers]
        return float(np.mean(lens)) / prompt

    def close(self) -> None:
        self.cache = None


class SidecarRunner:
    """Decodes through a SidecarCache whose prefill was fed from the recorded prefill."""

    def __init__(self, model, session, pre: Prefill, cfg: Config) -> None:
        self.model = model
        self.kw = _cache_kwarg(model)
        t = pre.length
        b = int(pre.ids.shape[0])
        self.budget_tokens = max(1, math.ceil(cfg.budget * t))
        spec = cfg.make(self.budget_tokens)
        self.omnikv = spec.name == "omnikv"
        if self.omnikv:
            self._omnikv_prefill(model, session, pre, spec)
            return
        hold = cfg.protocol == "decode"
        self.cache = SidecarCache(session, model, policy=spec,
                                  budget=self.budget_tokens if hold else None)
        cache = self.cache
        try:
            # SidecarCache's own prefill path, fed with the recorded tensors instead of a forward:
            # one BatchReserve of the block, zero-copy writes per layer, one BatchCommit.
            cache._begin_step(b, t)
            step = cache._step
            for layer in range(cache.num_layers):
                k, v = _layer_kv(pre.cache, layer)
                cache._store(layer, k, 0)
                cache._store(layer, v, 1)
                cache._take_queries(layer, pre.queries[layer], pre.scale)
            # A policy that reads every prompt query (H2O, D2O, CAOTE) has them folded into its
            # state by the commit (a few layers per message when they pass the message limit:
            # SidecarCache's long-prompt path), and Compress then evicts from that state. A
            # window policy (SnapKV, TOVA, CAKE) reads this step's window only: the Commit stores
            # the block and the Compress carries the window.
            every = cache._query_window is None
            attn = [None if every else cache._attention_of(step, row, range(cache.num_layers))
                    for row in range(b)]
            if not every:
                step.queries = {}
            saved, cache.budget_tokens = cache.budget_tokens, 0
            cache._end_step()
            cache.budget_tokens = saved
            for row, seq in enumerate(cache.sequence_ids):
                session.compress(seq, budget_tokens=self.budget_tokens, attention=attn[row])
            counts = [[e.count for e in sorted(session.get_layout(
                seq, omit_positions=True).layers, key=lambda e: e.layer)]
                for seq in cache.sequence_ids]
            cache._counts = np.asarray(counts, np.int64)
        except Exception:
            cache.release()
            raise

    def _omnikv_prefill(self, model, session, pre: Prefill, spec) -> None:
        """OmniKV: the whole prompt committed (nothing is evicted; k is the policy's
        selected_tokens), the filter layers' prompt queries kept for the window selectors; every
        decode step then Selects through the cache."""
        layers = int(model.config.num_hidden_layers)
        if not spec.omnikv.filter_layers:
            spec.omnikv.filter_layers.extend(omnikv_filter_layers(layers, layer_windows(model)))
        b = int(pre.ids.shape[0])
        self.cache = cache = SidecarCache(session, model, policy=spec)
        try:
            cache._begin_step(b, pre.length)
            for layer in range(cache.num_layers):
                k, v = _layer_kv(pre.cache, layer)
                cache._store(layer, k, 0)
                cache._store(layer, v, 1)
                cache._omni.filter_query(cache, layer, pre.queries[layer], pre.scale)
            cache._end_step()
        except Exception:
            cache.release()
            raise

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True, **{self.kw: self.cache})
        return out.logits.float()

    def kept_fraction(self, prompt: int) -> float:
        if self.omnikv:
            # Every token stays (the sparse layers' prompt in the host tier when offloaded);
            # the selection bounds what is attended to, not what is held.
            return float(self.cache.get_seq_length()) / prompt
        return float(np.mean(self.cache.counts)) / prompt

    def close(self) -> None:
        self.cache.release()


def kvpress_cache(model, pre: Prefill, press) -> Any:
    """A DynamicCache of the prefill compressed by `press` layer by layer, as its hook does.

    On a model with sliding-window layers the press compresses the full-attention layers alone
    and each sliding layer keeps its window (transformers' DynamicSlidingWindowLayer): kvpress's
    own rule for Gemma 3 (BasePress.__call__ skips `self_attn.is_sliding` layers). kvpress 0.5.5
    applies that rule to Gemma3ForConditionalGeneration only; on Gemma3ForCausalLM, the class
    transformers builds from a GGUF, its hook compresses every layer and its generation raises
    (bench/quality/README.md). The rule is applied here to every model with sliding layers."""
    windows = layer_windows(model)
    cache = DynamicCache(config=model.config) if any(windows) else DynamicCache()
    attns = _attentions(model)
    needs_attn = type(press).__name__ == "ObservedAttentionPress"
    for layer, module in enumerate(attns):
        k, v = _layer_kv(pre.cache, layer)
        if windows[layer]:
            cache.update(k, v, layer)
            continue
        attentions = column_sums(pre, layer, module) if needs_attn else None
        kwargs = {"position_embeddings": pre.rope[layer]}
        with torch.no_grad():
            k2, v2 = press.compress(module, pre.hidden[layer], k, v, attentions, kwargs)
        cache.update(k2.contiguous(), v2.contiguous(), layer)
    return cache


def column_sums(pre: Prefill, layer: int, module, chunk: int = 256) -> torch.Tensor:
    """[B][Hq][1][T]: each key's attention summed over every query of the prompt (causal), in the
    shape of an attention matrix with one row, so that a press summing `attentions` over the
    query axis (ObservedAttention) gets exactly these sums without a [T][T] matrix in memory."""
    q = pre.queries[layer]                         # [B][Hq][T][D]
    k, _ = _layer_kv(pre.cache, layer)
    b, hq, t, d = q.shape
    kk = k.float().repeat_interleave(hq // k.shape[1], dim=1)
    out = torch.zeros(b, hq, t)
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        w = torch.matmul(q[:, :, s:e], kk.transpose(2, 3)) * pre.scale
        mask = torch.arange(t)[None, :] > torch.arange(s, e)[:, None]
        w = w.masked_fill(mask, float("-inf")).softmax(-1)
        out += w.sum(2)
    return out[:, :, None]


def make_runner(model, session, pre: Prefill, cfg: Config):
    b = int(pre.ids.shape[0])
    if cfg.method == "full":
        cache = DynamicCache()
        for layer in range(len(pre.cache.layers)):
            k, v = _layer_kv(pre.cache, layer)
            cache.update(k, v, layer)
        return DynamicRunner(model, cache, pre.length, b)
    if cfg.method == "kvpress":
        press = cfg.make(1.0 - cfg.budget)
        return DynamicRunner(model, kvpress_cache(model, pre, press), pre.length, b)
    return SidecarRunner(model, session, pre, cfg)


# -- decoding --------------------------------------------------------------------------------------


def greedy(runner, first_logits: torch.Tensor, max_new: int,
           is_stop: Callable[[int, List[int]], bool]) -> List[Dict[str, Any]]:
    """Greedy decoding of every row until its answer ends (`is_stop`: its line or its list, or
    EOS) or max_new tokens; the first token comes from the prefill's logits. Returns per row
    its tokens and whether it was cut at max_new."""
    b = first_logits.shape[0]
    tok = first_logits.argmax(-1)
    out = [[int(t)] for t in tok]
    done = [is_stop(r, o) for r, o in enumerate(out)]
    steps = 1
    while not all(done) and steps < max_new:
        steps += 1
        logits = runner.forward(tok[:, None])[:, -1]
        tok = logits.argmax(-1)
        for r in range(b):
            if not done[r]:
                out[r].append(int(tok[r]))
                done[r] = is_stop(r, out[r])
    return [{"tokens": o, "truncated": not d} for o, d in zip(out, done)]


def teacher_forced(runner, cont: torch.Tensor, one_by_one: bool) -> torch.Tensor:
    """Logits [B][n][V] after feeding the continuation `cont` [B][n]."""
    if not one_by_one:
        return runner.forward(cont)
    return torch.cat([runner.forward(cont[:, i:i + 1]) for i in range(cont.shape[1])], dim=1)


# -- the configurations ----------------------------------------------------------------------------


def sidecar_configs(budgets, protocols) -> List[Config]:
    """Every policy of the sidecar, with the parameters stated in the tables."""
    alloc = common_pb2.LayerAllocator

    def h2o_like(name):
        def make(n):
            return make_policy(name, n_sink=4, n_recent=n // 2)
        return make

    fams = [
        ("streaming_llm", "4 sinks + recent (sidecar default)", lambda n: make_policy(
            "streaming_llm")),
        ("keydiff", "cosine to the mean normalised key (default)", lambda n: make_policy(
            "keydiff")),
        ("knorm", "lowest key L2 norm kept (no parameters)", lambda n: make_policy("knorm")),
        ("h2o", "accumulated attention (plain sum) + 4 sinks + N/2 recent",
         h2o_like("h2o")),
        ("h2o_plain", "accumulated attention (plain sum), no sinks, no recent window "
         "(kvpress's ObservedAttention without its division)",
         lambda n: make_policy("h2o", n_sink=0, n_recent=0)),
        ("tova", "last query, per kv-head group mean (sidecar default)",
         lambda n: make_policy("tova")),
        ("tova_allheads", "last query, mean over all query heads (kvpress's TOVA)",
         lambda n: make_policy("tova", all_heads=True)),
        ("snapkv", "window 32, avg-pool kernel 7 (sidecar default, paper)",
         lambda n: make_policy("snapkv")),
        ("pyramidkv", "snapkv window 32 kernel 7 + PyramidKV allocator beta 20",
         lambda n: make_policy("snapkv", allocator=alloc(
             kind=common_pb2.LAYER_ALLOCATOR_PYRAMIDKV, pyramid_beta=20))),
        # kvpress's variants, as options of the same policies (docs/policies/kvpress_variants.md).
        ("h2o_observed", "accumulated attention / queries that see each key, no sinks, no recent "
         "(option normalize_by_queries: kvpress's ObservedAttention)",
         lambda n: make_policy("h2o", n_sink=0, n_recent=0, normalize_by_queries=True)),
        ("tova_kvpress", "last query, all-head mean, last token kept (options all_heads + "
         "keep_last_token: kvpress's TOVA)",
         lambda n: make_policy("tova", all_heads=True, keep_last_token=True)),
        ("snapkv_kvpress", "window 64, kernel 5 (option defaults = DEFAULTS_KVPRESS)",
         lambda n: make_policy("snapkv", defaults=common_pb2.SnapKvParams.DEFAULTS_KVPRESS)),
        ("pyramidkv_kvpress", "window 64, kernel 5, kvpress's PyramidKV budgets (DEFAULTS_KVPRESS "
         "+ PyramidKV allocator beta 20)",
         lambda n: make_policy("snapkv", defaults=common_pb2.SnapKvParams.DEFAULTS_KVPRESS,
                               allocator=alloc(kind=common_pb2.LAYER_ALLOCATOR_PYRAMIDKV,
                                               pyramid_beta=20))),
        ("cake", "CAKE defaults (window 32, kernel 5, cascading allocator)",
         lambda n: make_policy("cake")),
        ("d2o", "D2O defaults (4 sinks, recent 0.25, merging)", lambda n: make_policy("d2o")),
        ("caote", "CAOTE exact over H2O (4 sinks, N/2 recent)",
         lambda n: make_policy("caote", n_sink=4, n_recent=n // 2)),
    ]
    out = []
    for proto in protocols:
        for b in budgets:
            for name, params, make in fams:
                out.append(Config("sidecar", name, b, proto, params, make))
    # OmniKV never evicts: it selects what the sparse layers attend to at every decode step,
    # whichever protocol; its rows go with the protocol that acts while decoding.
    omni_proto = "decode" if "decode" in protocols else protocols[0] if protocols else None
    if omni_proto is not None:
        for b in budgets:
            out.append(Config(
                "sidecar", "omnikv", b, omni_proto,
                "Select per decode step, last selector, k = budget x prompt (as the other rows' "
                "budget), filter layers = the paper's Llama-3-8B {2,8,18} scaled to the depth "
                "(30 layers: 2, 8, 17; the paper's own at 32/48/80; with sliding layers the "
                "first full-attention layer: Gemma 3 270M 5, sparse 11, 17), 1 wait layer, sparse "
                "prompt offloaded to the host tier; never evicts (kept: every token held)",
                lambda n: make_policy("omnikv", selected_tokens=n, offload=True)))
    return out


def omnikv_filter_layers(num_layers: int, windows: Optional[List[int]] = None) -> List[int]:
    """OmniKV's filter layers for a depth: empty (the sidecar's paper defaults) at 32, 48 and 80
    layers, else Llama-3-8B's {2, 8, 18} scaled to the depth (distinct, ascending). A model with
    sliding-window layers (`windows`, one per layer, 0 = full attention) filters at its first
    full-attention layer alone: a windowed layer cannot filter and is never sparse, so the later
    full-attention layers are the sparse ones (Gemma 3 270M: filter 5, sparse 11 and 17; the
    paper's Llama-3-8B has three filters among 32 full-attention layers, this model has 3)."""
    if windows and any(windows):
        return [layer for layer, w in enumerate(windows) if w == 0][:1]
    if num_layers in (32, 48, 80):
        return []
    scaled = sorted({min(num_layers - 1, round(f * num_layers / 32)) for f in (2, 8, 18)})
    return scaled


def kvpress_configs(budgets, defaults: bool = False) -> List[Config]:
    """kvpress's presses for the policies the sidecar also has, with parameters matched to the
    sidecar's rows (kvpress's own defaults stated; `defaults` adds rows with them)."""
    import kvpress as kp

    fams = [
        ("streaming_llm", "4 sinks (= sidecar)", lambda r: kp.StreamingLLMPress(
            compression_ratio=r, n_sink=4)),
        ("keydiff", "cosine to the mean normalised key (= sidecar)",
         lambda r: kp.KeyDiffPress(compression_ratio=r)),
        ("knorm", "lowest key L2 norm kept (= sidecar)",
         lambda r: kp.KnormPress(compression_ratio=r)),
        ("snapkv", "window 32, kernel 7 (matched; kvpress default 64 / 5)",
         lambda r: kp.SnapKVPress(compression_ratio=r, window_size=32, kernel_size=7)),
        ("pyramidkv", "window 32, kernel 7, beta 20 (matched; kvpress default 64 / 5)",
         lambda r: kp.PyramidKVPress(compression_ratio=r, window_size=32, kernel_size=7,
                                     beta=20)),
        ("tova", "last query, mean over all heads, last token kept (no knob)",
         lambda r: kp.TOVAPress(compression_ratio=r)),
        ("observed_attention", "attention sum / queries seeing each key (H2O-like, no knob)",
         lambda r: kp.ObservedAttentionPress(compression_ratio=r)),
    ]
    if defaults:
        fams += [
            ("snapkv_default", "window 64, kernel 5 (kvpress default)",
             lambda r: kp.SnapKVPress(compression_ratio=r)),
            ("pyramidkv_default", "window 64, kernel 5, beta 20 (kvpress default)",
             lambda r: kp.PyramidKVPress(compression_ratio=r)),
        ]
    return [Config("kvpress", name, b, "prefill", params, make)
            for b in budgets for name, params, make in fams]
