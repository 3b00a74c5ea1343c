"""A `transformers` KV cache whose K/V live in the sidecar (optional extra ``kvsidecar[hf]``).

    import kvsidecar as kvs
    from kvsidecar.hf import SidecarCache, layout_for

    with kvs.Client(address) as client, client.attach(layout_for(model, "fp32"),
                                                      num_blocks=...) as session:
        cache = SidecarCache(session, model, policy="snapkv", budget=0.25)  # keeps 25 %
        out = model.generate(**inputs, cache=cache, max_new_tokens=32)
        cache.release()

`SidecarCache` is a `transformers.Cache`: `generate` and a plain forward loop
(``model(input_ids, cache=cache, use_cache=True)``; ``past_key_values=`` before transformers
5.24) use it as they use `DynamicCache`. Every row of the batch is one sidecar sequence with the
cache's policy and budget. The budget is what each layer keeps: a fraction of the prompt in
(0, 1] (kvpress's compression_ratio = 1 - budget) or tokens per layer; None keeps everything.

What happens in one forward of B rows and T new tokens:

  layer 0          the previous step's DecodeStep answer is applied (see "overlap"); a prefill
                   block (T > 1, or the first block) is reserved in every layer of every row
                   with ONE BatchReserve (a left-padded row: its real tokens only); the block
                   tables of what each row holds come with the previous DecodeStep's answer
                   (return_layout), or else from one GetLayout per row, asked together
                   (skipped while nothing is held).
  every layer      the model calls ``update(k, v, layer)`` with its post-RoPE K/V. A prefill
                   block is written into the reserved arena slots through torch views of the
                   mapped arena (``torch.from_numpy`` over the shared memory: zero copy); a
                   one-token decode step goes into a small [L][2][H][1][D] buffer sent inline.
                   ``update`` returns what the layer's attention reads: the K/V the sidecar
                   holds for the layer in the sidecar's slot order, followed by the new block
                   (rounded through the session dtype, as stored). A decode step reads them from
                   the slot mirror (kvsidecar.hf_mirror: a copy of what the sidecar keeps, read
                   from the arena once after a prefill block and then kept exact from each
                   DecodeStep's answer, with the token written into slot count); a prefill block
                   after held tokens, OmniKV's sparse layers and a cache made with mirror=False
                   gather them from the arena by block table, for that layer only.
  attention        the model's attention call goes through a wrapper of its own implementation
                   (sdpa or eager), installed on the model by the constructor: it takes the
                   post-RoPE queries (the window the policy reads, see below), builds the mask of
                   the compacted cache and calls the original function.
  after the last   prefill blocks: ONE BatchCommit with each row's queries, compressing to the
  layer            budget when over it; decode steps: ONE DecodeStep for the whole batch, which
                   appends each token, folds its query into the policy state and evicts each
                   layer back to its budget, and answers with each row's new layout.

Positions and RoPE after eviction. Keys are stored post-RoPE, so a kept key keeps the rotation of
its original position, and the sidecar records that position per (layer, head, slot). The cache
reports the number of tokens ever seen as its sequence length (``get_seq_length``): the model
gives new tokens their true position ids (and rotates their queries and keys by them), however
few tokens are held. The mask follows the slots, not the positions: every held slot is older than
any new token, so it is visible to all new queries; inside the new block slot j is visible to
query i iff j <= i. ``get_mask_sizes`` returns (held + T, seen - held), which makes the library's
own causal mask exactly that; the wrapper builds the same mask per layer itself (layers and rows
may hold different counts; a row holding fewer than another gets masked padding slots).

Sliding-window layers (Gemma 2/3, Mistral, Qwen2 with use_sliding_window). A layer whose config
type is 'sliding_attention' lets a token see itself and the W - 1 tokens before it (W =
``sliding_window``). Each row's sidecar sequence is created with ``layer_windows`` = W - 1 for
those layers (0 for 'full_attention' ones): the sidecar keeps exactly the last W - 1 tokens of a
sliding layer whatever the policy and budget (the policy and budget apply to the global layers),
so a decode step's window is the held slots plus the new token. The wrapper masks a new block of
T > 1 tokens by the window too (query i sees block slot j iff i - W < j <= i, and a held slot
iff its position, read with the layout, is > seen + i - W).

Padded batches. Rows of unequal length padded on the left (``tokenizer.padding_side = 'left'``,
with the ``attention_mask``) are served: the cache reads the call's 2D attention_mask (a forward
pre-hook on the model), places only each row's real tokens in its sequence, at the positions of
their columns (so every row's order, and the sliding windows, are those of the model's own mask),
sends the policy the queries of real tokens only, and masks the padding columns of the block.
The model's position ids (from the mask) decide RoPE; the sidecar's positions only order the
tokens. Padding after the first block, or on the right, is refused.

Queries sent per policy (as `AttentionInputs`, post-RoPE, fp32, with their positions and the
model's softmax scale): streaming_llm, keydiff and knorm none; tova the last query of the block;
snapkv and cake the last ``window`` (their spec's, default 32); h2o, d2o, caote and the d2o/cake
layer allocators every query of the block. A decode step always sends its one query.

Long prompts. Every query of a block is L x Hq x T x D x 4 bytes per row (SmolLM2 at 2K tokens:
70 MB), past gRPC's 64 MiB per message. When a block's queries would make the BatchCommit larger
than ``max_message_bytes`` (32 MiB by default), the BatchCommit carries the K/V alone, each row's
queries follow a few layers per message in Compress calls whose budget no layer reaches (they
evict nothing; the sidecar only folds the queries into the policy state), and a last Compress
without attention evicts to the budget from the state accumulated (the sidecar reuses attention
already folded in: common.proto AttentionInputs). The kept set is the one-message path's.

OmniKV (``policy="omnikv"`` or ``kvsidecar.policy("omnikv", filter_layers=[...], ...)``). OmniKV
never evicts: every token's K/V stays in the sidecar (the sequences have no budget), and the
cache's ``budget`` says how many prompt tokens the filter layers select at each decode step: an
int is k (``selected_tokens``), a fraction of the prompt ``selected_fraction`` (1.0 or more: all
of it); 0 or None leaves the policy's own (the sidecar's default 6.7 %; the filter layers default
to the paper's only for 32, 48 and 80 layers, so name them for other depths). The prefill is plain
full attention. At each decode step, at a filter layer's attention, the wrapper sends ONE Select
for the batch (one item per row: the current post-RoPE query of that layer, ``prompt_tokens`` N =
the tokens seen before the first decode step, ``step_id`` = the decode step); it runs while the
filter and wait layers compute. The first sparse layer of the segment waits for the answer; every
sparse layer then attends to its staging view, read from the arena by its block table as any held
layer is: the selected prompt tokens T_f (ascending), then the layer's generated tokens, then the
new token. Prefix, filter and wait layers attend to everything held. Positions/RoPE: staged keys
are copies of the stored post-RoPE keys, so each keeps the rotation of its position; the new
token's position is the tokens seen, as always; a subset is attended in position order with no
mask (all staged tokens are older than the new one). The window selectors (uniform, exp) start
from the prefill's last W - 1 filter queries, sent with their positions at the first Select, so
their tokens are forced in while they stay in the window (omnikv.md §4.5). With ``offload`` the
sparse layers' prompt K/V move to the sidecar's host tier at the first Select (``counts`` then
shows their generated tokens only). ``last_selection`` gives the last step's Select answer per
filter layer. Sliding-window layers (Gemma 3's local layers) keep their window as with any policy
and are dense wherever they sit: the filter layers must be full-attention layers (the sidecar
refuses a windowed one, naming it), and the sparse layers of a segment are its full-attention
layers past the wait layers. Not supported with OmniKV: a block of several tokens after decoding
began (the prompt the filters choose from is fixed). A left-padded row's candidates are its real
prompt tokens; a fractional k is taken of N, the padded length.

Overlap: the DecodeStep is sent without waiting; its answer is applied when the cache is next
used (the model computes its logits meanwhile). `sync()` waits for it.

Not supported, with an error naming it: chunked or linear-attention layers (any layer type but
'full_attention' and 'sliding_attention'), bidirectional attention, cross-attention and
encoder-decoder models, quantized KV caches, attention implementations other than sdpa and eager,
right or interior padding, beam search and other cache reordering or cropping.

Not thread-safe: one cache is used by one thread at a time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
except ImportError as e:  # pragma: no cover - only without the extra
    raise ImportError("kvsidecar.hf needs torch and transformers: pip install 'kvsidecar[hf]'"
                      ) from e

from kvsidecar.client import (CallFuture, DecodeItem, ReserveItem, Session, attention,
                              model_layout)
from kvsidecar.client import budget as make_budget
from kvsidecar.client import policy as make_policy
from kvsidecar.hf_mirror import SlotMirror
from kvsidecar.v1 import common_pb2, sidecar_pb2

__all__ = ["SidecarCache", "UnsupportedModelError", "layout_for", "blocks_for", "layer_windows"]

# Policies that score keys only: no queries are sent.
KEY_ONLY_POLICIES = {"streaming_llm", "keydiff", "knorm"}
# Policies that read only the last `window` queries of a prefill block (default 32).
WINDOW_POLICIES = {"snapkv", "cake"}
DEFAULT_WINDOW = 32
KVPRESS_WINDOW = 64  # SnapKV's window under DEFAULTS_KVPRESS
# A Compress budget above anything a layer can hold (the sidecar's largest, 2^24 tokens): the call
# evicts nothing and only observes its attention, under every allocator.
OBSERVE_ONLY_BUDGET = 1 << 24
# The queries of one message: gRPC refuses messages over 64 MiB; a step whose queries would make
# a larger BatchCommit sends them a few layers at a time (SidecarCache._observe_in_chunks).
MAX_QUERY_MESSAGE_BYTES = 32 << 20
_WRAPPED_PREFIX = "kvsidecar:"


class UnsupportedModelError(ValueError):
    """The model, its config or the way it is called cannot be served by SidecarCache."""


def check_budget(budget: Union[int, float, None]) -> None:
    """Refuses a budget SidecarCache cannot mean: the budget is what is KEPT, a fraction of the
    prompt in (0, 1] (float) or tokens per layer >= 1 (int); None keeps everything. kvpress's
    compression_ratio is the share evicted: budget = 1 - compression_ratio."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a fraction kept (float in (0, 1]), tokens per layer "
                        f"(int >= 1) or None, got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        ratio = 1.0 - budget
        raise ValueError(
            f"budget={budget!r} is not a fraction kept in (0, 1]: the budget is the share of the "
            f"prompt each layer keeps (kvpress's compression_ratio = 1 - budget = {ratio:g} is "
            "the share it evicts: compression_ratio=0.75 is budget=0.25); tokens per layer are "
            "an int, and None (or 1.0) keeps the whole cache")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(
            f"budget={budget} keeps no token: the budget is what each layer keeps, tokens per "
            "layer (int >= 1) or a fraction of the prompt in (0, 1] (kvpress's "
            "compression_ratio = 1 - budget); None (or 1.0, compression_ratio=0) keeps the "
            "whole cache")


def _check_tokens_budget(budget: Union[int, float, None], prompt: int) -> None:
    """An int budget above the first block (the prompt) would evict nothing from it."""
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > prompt:
        raise ValueError(
            f"budget={budget} tokens per layer is more than the {prompt}-token prompt: nothing "
            f"would be evicted from it (kvpress's compression_ratio would be 1 - {budget}/"
            f"{prompt} = {1 - budget / prompt:.3g} < 0); give at most {prompt} tokens, a "
            "fraction kept in (0, 1], or None (or 1.0) for the whole cache")


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def layout_for(model: Any, dtype: str = "fp32", block_tokens: int = 16
               ) -> common_pb2.ModelLayout:
    """The sidecar ModelLayout of a transformers decoder (L, kv heads, query heads, head dim)."""
    config = _text_config(model)
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    return model_layout(num_layers=config.num_hidden_layers, num_kv_heads=num_kv_heads,
                        num_q_heads=num_q_heads, head_dim=_head_dim(config), dtype=dtype,
                        block_tokens=block_tokens)


def blocks_for(model: Any, max_tokens: int, batch_size: int = 1, block_tokens: int = 16) -> int:
    """Arena blocks for `batch_size` sequences of up to `max_tokens` tokens held in full."""
    layers = int(_text_config(model).num_hidden_layers)
    return batch_size * layers * (math.ceil(max_tokens / block_tokens) + 2)


def layer_windows(model: Any) -> List[int]:
    """Per layer, the sliding window W of the model's attention (a token sees itself and the
    W - 1 tokens before it), 0 for a global layer. From the config's ``layer_types``
    ('sliding_attention' / 'full_attention', as Gemma 2/3 and Qwen2 give them) and
    ``sliding_window``; a config with a sliding window and no layer types (Mistral) slides in
    every layer. Raises UnsupportedModelError for any other layer type (chunked, linear...)."""
    config = _text_config(model)
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    uses = getattr(config, "use_sliding_window", True) is not False
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        kinds = ["sliding_attention" if window and uses else "full_attention"] * num_layers
    else:
        kinds = list(layer_types)
    odd = [(i, t) for i, t in enumerate(kinds)
           if t not in ("full_attention", "sliding_attention")]
    if odd:
        i, kind = odd[0]
        raise UnsupportedModelError(
            f"{type(config).__name__}: layer {i} is a '{kind}' layer ({len(odd)} of "
            f"{len(kinds)} layers are neither 'full_attention' nor 'sliding_attention'); "
            "chunked and linear-attention layers are not supported")
    size = int(window or 0)
    if "sliding_attention" in kinds and size < 2:
        raise UnsupportedModelError(
            f"{type(config).__name__}: sliding_attention layers with sliding_window={window}; "
            "a window of at least 2 tokens is needed")
    return [size if t == "sliding_attention" else 0 for t in kinds]


def check_supported(model: Any) -> None:
    """Raises UnsupportedModelError naming what the model has that SidecarCache cannot serve."""
    top = getattr(model, "config", model)
    if getattr(top, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(top).__name__}: encoder-decoder models are not supported (their decoder "
            "uses cross-attention over the encoder output); use a decoder-only model")
    config = _text_config(model)
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{type(config).__name__}: cross-attention layers (add_cross_attention=True) are not "
            "supported")
    layer_windows(model)  # raises for layer types other than full and sliding attention
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{type(config).__name__}: bidirectional attention (use_bidirectional_attention) "
            "is not supported: the cache serves causal decoders")
    for name in ("attention_chunk_size",):
        if getattr(config, name, None):
            raise UnsupportedModelError(
                f"{type(config).__name__}: chunked attention ({name}) is not supported")
    quant = getattr(top, "quantization_config", None) or getattr(config, "quantization_config",
                                                                 None)
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else getattr(
        quant, "kv_cache_scheme", None)
    if scheme:
        raise UnsupportedModelError(
            f"quantized KV caches (quantization_config.kv_cache_scheme={scheme}) are not "
            "supported: the sidecar stores K/V in its session dtype (fp32, fp16 or bf16)")


# -- the attention wrapper -------------------------------------------------------------------------

# The (cache, layer, keys) of the last update() on this thread: the attention call of that layer
# with those keys belongs to it. Anything else (another cache class, no cache) goes through unchanged.
_pending = threading.local()


def _original_attention(name: str, module: Any) -> Any:
    if name == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise UnsupportedModelError(
                f"{type(module).__name__}: its module has no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def _make_wrapper(original: str) -> Any:
    # *args: wrappers of the registered functions (kvpress's) pass dropout positionally.
    def kvsidecar_attention(module: Any, query: Any, key: Any, value: Any,
                            attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        fn = _original_attention(original, module)
        call = getattr(_pending, "call", None)
        layer = getattr(module, "layer_idx", None)
        # Ours only if this layer's key is the very tensor the cache's update() returned.
        if call is None or call[1] != layer or call[2] is not key:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        _pending.call = None
        cache = call[0]
        mask = cache._layer_mask(layer, attention_mask, query, original)
        scale = kwargs.get("scaling", getattr(module, "scaling", None))
        cache._take_queries(layer, query, scale)
        if cache._omni is not None:
            cache._omni.filter_query(cache, layer, query, scale)
        out = fn(module, query, key, value, mask, *args, **kwargs)
        cache._attended(layer)
        return out

    kvsidecar_attention.__name__ = f"kvsidecar_{original}_attention"
    return kvsidecar_attention


def install(model: Any) -> str:
    """Routes the model's attention through the kvsidecar wrapper of its implementation (sdpa or
    eager); returns the original name. Calls without a SidecarCache are unchanged."""
    config: Any = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError("the model has no config")
    name = getattr(config, "_attn_implementation", None) or "eager"
    if name.startswith(_WRAPPED_PREFIX):
        return name[len(_WRAPPED_PREFIX):]
    if name not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"attention implementation '{name}' is not supported; load the model with "
            "attn_implementation='sdpa' or 'eager'")
    wrapped = _WRAPPED_PREFIX + name
    if wrapped not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(wrapped, _make_wrapper(name))
        # The library builds the same masks as for the original implementation.
        AttentionMaskInterface.register(wrapped, sdpa_mask if name == "sdpa" else eager_mask)
    config._attn_implementation = wrapped
    return name


def _capture_mask(module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Forward pre-hook of the model: hands the call's 2D attention_mask to its SidecarCache,
    which reads the padding of the new block from it (the attention layers only see the 4D
    mask, after the cache had to place the block)."""
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")
    if isinstance(cache, SidecarCache):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        cache._input_mask = mask


# -- the cache -------------------------------------------------------------------------------------


def _as_torch(array: Any, dtype: int) -> Any:
    """A torch view (no copy) of an arena array: numpy over the shared memory (CPU arena), or
    already a torch tensor (CUDA arena); bf16 is kept as uint16 bit patterns in numpy."""
    t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
    if dtype == common_pb2.DTYPE_BFLOAT16 and t.dtype != torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t


# transformers' own classes are not annotated: subclassing and initialising them are untyped calls
# (not in every release: transformers 5.2, which kvpress pins, types the subclassing).
class _SidecarLayer(CacheLayerMixin):  # type: ignore[no-untyped-call,unused-ignore]
    """One layer as the library's Cache bookkeeping sees it (the data is in the sidecar)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "SidecarCache", layer: int, sliding: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._cache = cache
        self._layer = layer
        # The library picks which layer sizes the sliding and the full masks by this flag.
        self.is_sliding = sliding

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self.is_initialized = True

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        return self._cache.update(key_states, value_states, self._layer)

    def get_mask_sizes(self, query_length: Any) -> Tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # abstract in transformers 5.2 (kvpress pins < 5.3)
        return -1


class _Step:
    """One forward in progress: its positions, reservations, inline K/V and queries."""

    def __init__(self, positions: np.ndarray, decode: bool) -> None:
        self.positions = positions
        self.decode = decode
        self.reservations: List[Any] = []           # per row (None: no real token to place)
        self.inline: List[np.ndarray] = []          # per row [L][2][H][1][D], session dtype
        self.inline_t: Any = None                    # the same, one torch [B][L][2][H][1][D]
        self.queries: Dict[int, np.ndarray] = {}     # layer -> [B][Hq][w][D] float32
        self.scale: Optional[float] = None
        self.held: List[List[int]] = []              # per row, per layer: tokens held
        self.tables: List[List[Sequence[int]]] = []  # per row, per layer: block table
        self.real: Optional[Any] = None              # [B][T] bool: not padding (None = all)
        # per row, per sliding layer: the position of each held slot (chunked prefill only)
        self.slot_positions: List[Dict[int, Any]] = []
        # per stale row of the mirror, per layer: positions [H][count] to read it back with
        self.refill: Dict[int, Dict[int, np.ndarray]] = {}
        self.next_layer = 0                          # layer whose update() comes next
        self.attended = -1                           # last layer whose attention ran


def _omnikv_spec(spec: common_pb2.PolicySpec, budget: Union[int, float, None]
                 ) -> common_pb2.PolicySpec:
    """The omnikv PolicySpec with the cache's budget as its selection: an int is k
    (selected_tokens), a float in (0, 1] the fraction of the prompt (selected_fraction, 1.0:
    every prompt token); None leaves the spec's own (the sidecar's default: 6.7 %)."""
    out = common_pb2.PolicySpec()
    out.CopyFrom(spec)
    out.omnikv.SetInParent()
    if not budget:
        return out
    params = out.omnikv
    if params.selected_tokens or params.selected_fraction:
        raise ValueError(
            f"omnikv: budget={budget!r} and the policy's selected_tokens="
            f"{params.selected_tokens} / selected_fraction={params.selected_fraction} both set "
            "how many prompt tokens Select picks; give one")
    if isinstance(budget, float):
        params.selected_fraction = budget
    else:
        params.selected_tokens = int(budget)
    return out


class _OmniKv:
    """OmniKV's side of a SidecarCache (see the module comment): the layer plan, and per decode
    step one Select per filter layer for the whole batch, whose staging views the sparse layers
    of its segment read."""

    def __init__(self) -> None:
        self.roles: List[str] = []      # per layer: "dense", "filter" or "sparse"
        self.feeding: List[int] = []    # per layer: the filter layer a sparse layer reads
        self.prompt_window = 0          # prompt queries a window selector starts from (W - 1)
        self.prompt_tokens = 0          # N: fixed at the first decode step
        self.step_id = 0
        self.pending: Dict[int, CallFuture] = {}
        # The last decode step's Select answer per filter layer, one item per row.
        self.selection: Dict[int, List[sidecar_pb2.SelectResponse.Item]] = {}
        # Window selectors: per filter layer the prefill's last W - 1 queries [B][Hq][w][D],
        # their positions [w] and which are real tokens ([B][w] bool).
        self.prompt_queries: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def plan(self, resolved: common_pb2.PolicySpec, windows: Sequence[int]) -> None:
        """Layer roles from the policy the sidecar resolved (omnikv.md §2, PlanOmniKvLayers):
        a sliding-window layer (`windows[layer]` > 0) is dense wherever it sits, attending to the
        window it holds; the sidecar refused it as a filter."""
        params = resolved.omnikv
        filters = list(params.filter_layers)
        wait = params.wait_layers or 1
        num_layers = len(windows)
        self.roles = ["dense"] * num_layers
        self.feeding = [-1] * num_layers
        for i, f in enumerate(filters):
            end = filters[i + 1] if i + 1 < len(filters) else num_layers
            self.roles[f] = "filter"
            for layer in range(min(end, f + wait + 1), end):
                if windows[layer] > 0:
                    continue
                self.roles[layer] = "sparse"
                self.feeding[layer] = f
        if params.selector in (common_pb2.OmniKvParams.SELECTOR_UNIFORM,
                               common_pb2.OmniKvParams.SELECTOR_EXP):
            self.prompt_window = max(0, (params.window or 16) - 1)

    def begin(self, step: "_Step", seen: int) -> None:
        self.pending = {}
        if step.decode:
            if self.prompt_tokens == 0:
                self.prompt_tokens = seen
            self.step_id += 1
            self.selection = {}
        elif self.prompt_tokens > 0:
            raise UnsupportedModelError(
                "the omnikv policy: a block of several tokens after decoding began is not "
                f"supported (the prompt Select chooses from, {self.prompt_tokens} tokens, was "
                "fixed at the first decode step); start a new cache")

    def filter_query(self, cache: "SidecarCache", layer: int, query: Any,
                     scale: Optional[float]) -> None:
        """At a filter layer's attention: a prefill block keeps the window selectors' prompt
        queries; a decode step sends the batch's Select for this layer (answered while the
        filter and wait layers run)."""
        step = cache._step
        if step is None or not self.roles or self.roles[layer] != "filter":
            return
        if not step.decode:
            if self.prompt_window:
                self._keep_prompt_queries(step, layer, query)
            return
        current = query.detach().to(device="cpu", dtype=torch.float32).numpy()  # [B][Hq][1][D]
        prompt = self.prompt_queries.pop(layer, None)
        items = []
        for row, seq in enumerate(cache.sequence_ids):
            q = current[row]
            positions: Optional[List[int]] = None
            if prompt is not None:
                # The first Select starts the window from the prompt's last queries, marked by
                # their positions (< N): their tokens are then always selected (§4.5).
                prompt_q, prompt_positions, prompt_real = prompt
                real = prompt_real[row]
                q = np.concatenate([prompt_q[row][:, real], q], axis=1)
                positions = prompt_positions[real].tolist() + [int(step.positions[0])]
            items.append(sidecar_pb2.SelectRequest.Item(
                session_id=cache.session.session_id, sequence_id=seq, step_id=self.step_id,
                prompt_tokens=self.prompt_tokens,
                attention=attention(q[None], query_positions=positions, softmax_scale=scale,
                                    layers=[layer])))
        request = sidecar_pb2.SelectRequest(items=items)
        self.pending[layer] = CallFuture(
            cache.session.stub.Select.future(request, timeout=cache.session.timeout))

    def _keep_prompt_queries(self, step: "_Step", layer: int, query: Any) -> None:
        w = self.prompt_window
        q = query.detach()[:, :, -w:].to(device="cpu", dtype=torch.float32).numpy().copy()
        positions = step.positions[-w:]
        real = (np.ones((q.shape[0], q.shape[2]), bool) if step.real is None
                else step.real[:, -w:].numpy())
        held = self.prompt_queries.get(layer)
        if held is not None:  # a chunked prefill: the window spans the blocks
            q = np.concatenate([held[0], q], axis=2)[:, :, -w:]
            positions = np.concatenate([held[1], positions])[-w:]
            real = np.concatenate([held[2], real], axis=1)[:, -w:]
        self.prompt_queries[layer] = (q, positions, real)

    def _answer(self, f: int) -> List[sidecar_pb2.SelectResponse.Item]:
        items = self.selection.get(f)
        if items is None:
            future = self.pending.pop(f, None)
            if future is None:
                raise RuntimeError(
                    f"no Select of filter layer {f} at this step (its attention did not go "
                    "through the kvsidecar wrapper)")
            items = list(future.result().items)
            self.selection[f] = items
        return items

    def stage(self, step: "_Step", layer: int) -> None:
        """Before a sparse layer's update: what it attends to is its filter's staging view
        (T_f, then the layer's generated tokens), read from the arena by block table."""
        if self.roles[layer] != "sparse":
            return
        for row, item in enumerate(self._answer(self.feeding[layer])):
            views = [v for v in item.sparse_layers if v.layer == layer]
            if not views:
                raise RuntimeError(f"Select of filter layer {self.feeding[layer]} staged no view "
                                   f"of its sparse layer {layer}")
            view = views[0]
            step.held[row][layer] = int(view.count)
            step.tables[row][layer] = view.block_table

    def finish(self) -> None:
        """End of a decode step: every Select answered (errors raised) before the DecodeStep
        appends the step's token."""
        for f in list(self.pending):
            self._answer(f)


class SidecarCache(Cache):
    """A transformers Cache backed by a sidecar session (see the module comment).

    Args:
        session: an attached `kvsidecar.Session` whose layout matches the model (`layout_for`).
        model: the transformers model that will use the cache; its attention is routed through
            the kvsidecar wrapper (queries for the policy, the mask of the compacted cache).
        policy: a policy name ("snapkv", "h2o", ...) or a `PolicySpec` (`kvsidecar.policy`).
        budget: what each layer KEEPS: a fraction in (0, 1] of the first block's length (the
            prompt), resolved when it arrives (kvpress's compression_ratio = 1 - budget: 0.25
            keeps what compression_ratio=0.75 keeps), or tokens per layer (int, 1 to the prompt
            length); None or 1.0: no budget, the full cache. Anything else (0, a fraction
            outside (0, 1], more tokens than the prompt) raises ValueError naming the kvpress
            equivalent. OmniKV evicts nothing: there the budget is the prompt tokens each filter
            layer selects per decode step (int: k; fraction: of the prompt; 1.0: all of them).
        overlap: send each DecodeStep without waiting for its answer (applied at the next use).
        hold_budget: True: every decode step evicts back to the budget (the sidecar scores the
            new token with the policy at each step); False: the prompt is compressed to the
            budget once, after its block, and the decoded tokens are all kept (kvpress's
            protocol: its presses compress during the prefill only). Decode steps that cannot
            evict send no query: they cost the sidecar an append.
        mirror: decode steps attend over a copy of the held K/V in slot order, kept exact from
            each DecodeStep's answer (kvsidecar.hf_mirror), instead of gathering every layer out
            of the arena at every step; False holds no copy in the worker (slower decoding).
    """

    def __init__(self, session: Session, model: Any, policy: Union[str, common_pb2.PolicySpec,
                                                                   None] = "streaming_llm",
                 budget: Union[int, float, None] = None, overlap: bool = True,
                 mirror: bool = True, hold_budget: bool = True) -> None:
        check_supported(model)
        lay = session.layout
        want = layout_for(model)
        if (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (
                want.num_layers, want.num_kv_heads, want.head_dim):
            raise UnsupportedModelError(
                f"session layout L={lay.num_layers} H={lay.num_kv_heads} D={lay.head_dim} does "
                f"not match the model's L={want.num_layers} H={want.num_kv_heads} "
                f"D={want.head_dim} (attach with kvsidecar.hf.layout_for(model))")
        spec = make_policy(policy) if isinstance(policy, str) else policy
        check_budget(budget)
        # OmniKV never evicts: the budget is how many prompt tokens Select picks per step.
        self._omni: Optional[_OmniKv] = None
        self._omni_budget: Union[int, float, None] = None
        if spec is not None and spec.name == "omnikv":
            spec = _omnikv_spec(spec, budget)
            self._omni = _OmniKv()
            self._omni_budget, budget = budget, None
        self._attn_original = install(model)
        if not getattr(model, "_kvsidecar_mask_hook", False):
            model.register_forward_pre_hook(_capture_mask, with_kwargs=True)
            model._kvsidecar_mask_hook = True
        self._input_mask: Any = None    # the 2D attention_mask of the forward in progress
        self._padded = False            # some row was left-padded: the library's mask over held
                                        # slots no longer lines up with them (not checked)
        self.session = session
        self.policy = spec
        self.budget = budget
        self.overlap = overlap
        self.use_mirror = mirror
        self.hold_budget = hold_budget
        self._mirror: Optional[SlotMirror] = None  # made at the first decode step
        self._sender: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.num_layers = lay.num_layers
        self.num_kv_heads = lay.num_kv_heads
        self.head_dim = lay.head_dim
        self.dtype = lay.dtype
        self.budget_tokens = 0          # resolved at the first block
        self.sequence_ids: List[str] = []
        self._seen = 0                  # tokens of every row ever appended
        self._counts: Any = None   # [B][L] tokens held (np.ndarray once a batch started)
        self._step: Optional[_Step] = None
        self._inflight: Optional[Tuple[Any, List[DecodeItem], np.ndarray]] = None
        # Every row's layers as the last DecodeStep answered them (return_layout), for the next
        # step only; None = ask with GetLayout.
        self._next_layouts: Optional[List[List[Any]]] = None
        self._arena_t: Any = None
        self._name = self.policy.name if self.policy is not None else ""
        self._query_window = self._window()
        self._mask_sizes: Dict[int, Tuple[int, int, int]] = {}
        self.last_attention: List[Optional[common_pb2.AttentionInputs]] = []
        # Query bytes one message may carry (see MAX_QUERY_MESSAGE_BYTES).
        self.max_message_bytes = MAX_QUERY_MESSAGE_BYTES
        # The model's sliding window per layer (0 = global). The sidecar keeps W - 1 tokens of a
        # sliding layer: with the new token that is all its attention can see.
        self.windows = layer_windows(model)
        self.sidecar_windows = [w - 1 if w > 0 else 0 for w in self.windows]
        super().__init__(layers=[_SidecarLayer(self, i, self.windows[i] > 0)
                                 for i in range(lay.num_layers)])

    # -- policy needs --------------------------------------------------------------------------

    def _window(self) -> Optional[int]:
        """Queries sent per prefill block: 0 = none at all (not even at decode steps), None =
        every query of the block, w = the last w."""
        if self.policy is None or self._name == "omnikv":
            return 0  # OmniKV's queries go to Select (_OmniKv), not to Commit or DecodeStep
        if self.policy.HasField("allocator") and self.policy.allocator.kind in (
                common_pb2.LAYER_ALLOCATOR_D2O, common_pb2.LAYER_ALLOCATOR_CAKE):
            return None  # the d2o / cake allocators read the prefill queries as d2o / cake do
        # (PyramidKV's and the uniform split read no attention: the scorer's window is enough.)
        if self._name in KEY_ONLY_POLICIES:
            return 0
        if self._name == "tova":
            return 1
        if self._name in WINDOW_POLICIES:
            params = getattr(self.policy, self._name)
            if params.window:
                return int(params.window)
            # An unset window is the policy's default: kvpress's 64 under SnapKV's
            # DEFAULTS_KVPRESS, the paper's 32 otherwise (as the sidecar resolves it).
            if self._name == "snapkv" and \
                    self.policy.snapkv.defaults == common_pb2.SnapKvParams.DEFAULTS_KVPRESS:
                return KVPRESS_WINDOW
            return DEFAULT_WINDOW
        return None

    # -- what transformers calls ----------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (every row): the position the next token gets, not the tokens held."""
        return self._seen

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> Tuple[int, int]:
        """(held + q, seen - held): with the library's causal mask every held slot is visible
        and the new block is causal by slot (see the module comment)."""
        if isinstance(query_length, torch.Tensor):  # older releases pass cache_position
            query_length = int(query_length.shape[0])
        self.sync()
        held = int(self._counts[:, layer_idx].max()) if self._counts is not None else 0
        sizes = (held + int(query_length), self._seen - held)
        self._mask_sizes[layer_idx] = (int(query_length),) + sizes
        return sizes

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any,
               **kwargs: Any) -> Tuple[Any, Any]:
        """Writes the block's K/V of one layer to the sidecar; returns what the layer attends
        to: the held K/V (arena, slot order) followed by the block."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise UnsupportedModelError(
                f"layer {layer_idx}: K/V of shape {tuple(key_states.shape)} / "
                f"{tuple(value_states.shape)}; expected [batch][kv heads][tokens][head dim]")
        if not key_states.is_floating_point():
            raise UnsupportedModelError(
                f"layer {layer_idx}: K/V of dtype {key_states.dtype}: quantized KV caches are "
                "not supported")
        b, h, t, d = key_states.shape
        if (h, d) != (self.num_kv_heads, self.head_dim):
            raise UnsupportedModelError(
                f"layer {layer_idx}: {h} kv heads of dim {d}; the session has "
                f"{self.num_kv_heads} of dim {self.head_dim}")
        if layer_idx == 0:
            self._begin_step(b, t)
        step = self._step
        if step is None or layer_idx != step.next_layer:
            raise RuntimeError(
                f"SidecarCache.update for layer {layer_idx} out of order (expected layer "
                f"{0 if step is None else step.next_layer}); layers must run 0..L-1 per forward")
        if layer_idx > 0 and step.attended != layer_idx - 1:
            raise UnsupportedModelError(
                f"the attention of layer {layer_idx - 1} did not go through the kvsidecar "
                "wrapper: the model must call its attention through transformers' "
                "ALL_ATTENTION_FUNCTIONS (config._attn_implementation)")
        if b != len(self.sequence_ids):
            raise UnsupportedModelError(
                f"batch of {b} rows; this cache holds {len(self.sequence_ids)} sequences")
        step.next_layer = layer_idx + 1
        if self._omni is not None and step.decode:
            self._omni.stage(step, layer_idx)
        new_k = self._store(layer_idx, key_states, 0)
        new_v = self._store(layer_idx, value_states, 1)
        if self._mirrors(step, layer_idx):
            keys, values = self._attend_mirror(layer_idx, new_k, new_v)
        else:
            keys, values = self._assemble(layer_idx, new_k, new_v)
        _pending.call = (self, layer_idx, keys)
        return keys, values

    # -- steps ---------------------------------------------------------------------------------

    def _arena(self) -> Any:
        if self._arena_t is None:
            self._arena_t = _as_torch(self.session.arena.blocks, self.dtype)
        return self._arena_t

    def _storage_torch_dtype(self) -> Any:
        return {common_pb2.DTYPE_FLOAT32: torch.float32, common_pb2.DTYPE_FLOAT16: torch.float16,
                common_pb2.DTYPE_BFLOAT16: torch.bfloat16}[self.dtype]

    def _create_sequences(self, batch: int, tokens: int) -> None:
        _check_tokens_budget(self.budget, tokens)
        if self._omni is not None:
            _check_tokens_budget(self._omni_budget, tokens)
        budget = self.budget or 0
        if isinstance(budget, float):
            budget = 0 if budget >= 1.0 else max(1, math.ceil(budget * tokens))
        self.budget_tokens = int(budget)
        made: List[str] = []
        try:
            for _ in range(batch):
                resp = self.session.create_sequence(
                    policy=self.policy,
                    budget=make_budget(self.budget_tokens)
                    if self.budget_tokens > 0 and self.hold_budget else None,
                    layer_windows=self.sidecar_windows if any(self.sidecar_windows) else None)
                made.append(resp.sequence_id)
                if self._omni is not None and len(made) == 1:
                    self._omni.plan(resp.policy, self.windows)
        except Exception:
            for seq in made:
                self.session.release_sequence(seq)
            raise
        self.sequence_ids = made
        self._counts = np.zeros((batch, self.num_layers), np.int64)

    def _begin_step(self, batch: int, tokens: int) -> None:
        self.sync()
        if self._step is not None:
            step, self._step = self._step, None
            self._abandon(step)
            raise UnsupportedModelError(
                f"the previous forward ended without the attention of layer "
                f"{step.attended + 1} going through the kvsidecar wrapper (the model must call "
                "its attention through transformers' ALL_ATTENTION_FUNCTIONS); it was dropped")
        if not self.sequence_ids:
            self._create_sequences(batch, tokens)
        elif batch != len(self.sequence_ids):
            raise UnsupportedModelError(
                f"batch of {batch} rows; this cache holds {len(self.sequence_ids)} sequences "
                "(changing the batch, as beam search or num_return_sequences > 1 do, is not "
                "supported)")
        positions = np.arange(self._seen, self._seen + tokens, dtype=np.int32)
        step = _Step(positions, decode=self._seen > 0 and tokens == 1)
        step.real = self._real_tokens(batch, tokens)
        if self._omni is not None:
            self._omni.begin(step, self._seen)
        self._input_mask = None
        answered, self._next_layouts = self._next_layouts, None
        if self._seen > 0:
            self._read_layouts(step, answered)
        else:
            step.held = [[0] * self.num_layers for _ in self.sequence_ids]
            step.tables = [[()] * self.num_layers for _ in self.sequence_ids]
        if step.decode:
            sdt = self.session.arena.storage_dtype
            inline = np.empty((batch, self.num_layers, 2, self.num_kv_heads, 1, self.head_dim), sdt)
            step.inline = list(inline)  # per row: the DecodeStep item's inline_kv
            step.inline_t = _as_torch(inline, self.dtype)  # one torch view: a layer's rows at once
        elif step.real is None:
            pos = positions.tolist()
            items = [ReserveItem(seq, tokens, positions=pos) for seq in self.sequence_ids]
            step.reservations = self.session.batch_reserve(items)
        else:
            # Padding never reaches the sidecar: each row places its real tokens only, at the
            # positions of their columns (the order the model's mask and window use).
            rows = [row for row in range(batch) if bool(step.real[row].any())]
            items = [ReserveItem(self.sequence_ids[row], int(step.real[row].sum()),
                                 positions=positions[step.real[row].numpy()].tolist())
                     for row in rows]
            step.reservations = [None] * batch
            for row, res in zip(rows, self.session.batch_reserve(items)):
                step.reservations[row] = res
        self._step = step

    def _read_layouts(self, step: _Step, answered: Optional[List[List[Any]]]) -> None:
        """Every row's held counts and block tables for the step: from the last DecodeStep's
        answer (return_layout) where it has them, else asked with GetLayout for the batch at once
        (one round trip, not one per row). Positions are asked for where they are needed: a
        block after held tokens masks a sliding layer's held slots by position, and a row whose
        mirror is stale is read back with its positions."""
        positions_needed = not step.decode and any(self.windows)
        mirror = self._mirror
        mirrored = step.decode and self.use_mirror
        if mirrored and mirror is not None and answered is not None:
            for row, layers in enumerate(answered):
                counts = np.asarray([e.count for e in sorted(layers, key=lambda e: e.layer)])
                mirror.clean[:, row] &= mirror.count[:, row] == counts
        stale = set(range(len(self.sequence_ids))) if mirrored else set()
        if mirrored and mirror is not None:
            stale = {row for row in stale if mirror.stale_layers(row).size}
        with_positions = set(range(len(self.sequence_ids))) if positions_needed else stale
        ask = [row for row in range(len(self.sequence_ids))
               if answered is None or row in with_positions]
        pending = {row: self.session.get_layout_future(
            self.sequence_ids[row], omit_positions=row not in with_positions) for row in ask}
        for row in range(len(self.sequence_ids)):
            if row in pending:
                layers = pending[row].result().layers
            else:
                assert answered is not None
                layers = answered[row]
            by_layer = sorted(layers, key=lambda e: e.layer)
            step.held.append([e.count for e in by_layer])
            step.tables.append([e.block_table for e in by_layer])
            if positions_needed:
                # Every head of a sliding layer holds the same tokens: head 0's positions.
                step.slot_positions.append({
                    e.layer: torch.as_tensor(list(e.positions[:e.count]))
                    for e in by_layer if self.windows[e.layer] > 0})
            if row in stale:
                # What a stale layer of the mirror is read back with (per head, slot order).
                step.refill[row] = {
                    e.layer: np.asarray(e.positions, np.int32).reshape(self.num_kv_heads,
                                                                       e.count)
                    for e in by_layer}
        if mirrored and mirror is not None and answered is None:
            # Without the answer's layouts the counts are checked once they arrive: a clean
            # layer holding another count than the sidecar's is read back (its positions asked).
            for row in range(len(self.sequence_ids)):
                mirror.clean[:, row] &= mirror.count[:, row] == np.asarray(step.held[row])
                if row not in step.refill and mirror.stale_layers(row).size:
                    layout = self.session.get_layout(self.sequence_ids[row])
                    step.refill[row] = {
                        e.layer: np.asarray(e.positions, np.int32).reshape(
                            self.num_kv_heads, e.count) for e in layout.layers}

    def _real_tokens(self, batch: int, tokens: int) -> Any:
        """[B][T] bool of the new block's real (unpadded) tokens from the call's 2D
        attention_mask; None when there is no padding (or no 2D mask: a 4D mask is checked
        by the attention wrapper)."""
        mask = self._input_mask
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return None
        if mask.shape[0] != batch or mask.shape[1] < tokens:
            raise UnsupportedModelError(
                f"attention_mask of shape {tuple(mask.shape)} for a block of {batch} x {tokens} "
                "tokens")
        real = mask[:, -tokens:].detach().to(device="cpu", dtype=torch.bool)
        if bool(real.all()):
            return None
        if self._seen > 0:
            raise UnsupportedModelError(
                "padding after the first block is not supported (the attention_mask masks a "
                "new token): pad the prompts on the left (tokenizer.padding_side='left')")
        as_int = real.to(torch.int8)
        if not bool((as_int.cummax(dim=1).values == as_int).all()):
            raise UnsupportedModelError(
                "right or interior padding is not supported: pad the prompts on the left "
                "(tokenizer.padding_side='left')")
        self._padded = True
        return real

    def _abandon(self, step: _Step) -> None:
        for res in step.reservations:
            if res is None:
                continue
            try:
                self.session.cancel_reservation(res)
            except Exception:  # pragma: no cover - best effort on a broken step
                pass

    def _store(self, layer: int, states: Any, kv: int) -> Any:
        """Writes one layer's new K (kv=0) or V (kv=1) of every row; returns them as stored."""
        step = self._step
        assert step is not None, "no forward pass in progress"
        states = states.detach()
        if step.decode:
            # Every row's token in one copy ([B][H][1][D], host), rounded to the session dtype.
            step.inline_t[:, layer, kv].copy_(states)
            if step.inline_t.dtype == states.dtype:
                return states
            return step.inline_t[:, layer, kv].to(states.device, states.dtype)
        stored = states.to(self._storage_torch_dtype())
        for row, res in enumerate(step.reservations):
            if res is None:
                continue
            # A padded row's real columns (a copy of those only), else the row as it is.
            src = stored[row] if step.real is None else stored[row][:, step.real[row]]
            for first, kview, vview in res.views(layer):
                view = _as_torch(kview if kv == 0 else vview, self.dtype)  # arena, no copy
                view.copy_(src[:, first:first + view.shape[1]])
        return stored.to(states.dtype)

    def _mirrors(self, step: _Step, layer: int) -> bool:
        """Whether the layer's attention reads the slot mirror at this step (decode steps;
        OmniKV's sparse layers read their staging views from the arena)."""
        return step.decode and self.use_mirror and (
            self._omni is None or self._omni.roles[layer] != "sparse")

    def _attend_mirror(self, layer: int, new_k: Any, new_v: Any) -> Tuple[Any, Any]:
        """[B][H][held_max + 1][D] views of the mirror: each row's held K/V in slot order with
        the decode token in slot held (rows holding fewer: masked slots after it). Stale rows
        of the layer are read from the arena first."""
        step = self._step
        assert step is not None, "no forward pass in progress"
        mirror = self._mirror
        if mirror is None:
            roles = self._omni.roles if self._omni is not None else []
            mirror = self._mirror = SlotMirror(
                self.num_layers, len(self.sequence_ids), self.num_kv_heads, self.head_dim,
                new_k.dtype, new_k.device,
                [not roles or roles[i] != "sparse" for i in range(self.num_layers)])
        for row, positions in step.refill.items():
            if not mirror.clean[layer, row]:
                table, n = step.tables[row][layer], step.held[row][layer]
                mirror.fill(layer, row, self._held_kv(table, n, new_k), positions[layer])
        if not mirror.clean[layer].all():
            raise RuntimeError(f"layer {layer}: the slot mirror of rows "
                               f"{np.flatnonzero(~mirror.clean[layer]).tolist()} was not read")
        keys, values = mirror.append(layer, new_k, new_v, [row[layer] for row in step.held])
        return keys, values

    def _held_kv(self, table: Sequence[int], n: int, like: Any) -> Any:
        """[2][H][n][D]: one row's held K/V of a layer, read from the arena by block table, in
        the dtype and on the device of `like`."""
        arena = self._arena()
        bt = self.session.arena.block_tokens
        nb = -(-n // bt)
        index = torch.as_tensor(np.asarray(table[:nb], np.int64), device=arena.device)
        blocks = arena.index_select(0, index)  # [nb][2][H][bt][D]
        kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, self.num_kv_heads, nb * bt,
                                                   self.head_dim)[:, :, :n]
        return kv.to(like.device, like.dtype)

    def _assemble(self, layer: int, new_k: Any, new_v: Any) -> Tuple[Any, Any]:
        """[B][H][held_max + T][D]: each row's held K/V in slot order (rows holding fewer are
        padded; the wrapper masks the padding), then the new block."""
        step = self._step
        assert step is not None, "no forward pass in progress"
        held = [row[layer] for row in step.held]
        width = max(held)
        if width == 0:
            return new_k, new_v
        b, h, t, d = new_k.shape
        arena = self._arena()
        bt = self.session.arena.block_tokens
        if min(held) == width:
            # Every row holds the same count (no padding, the usual batch): one gather of the
            # (row, K or V, head, block) runs of bt tokens in the order attention reads them,
            # [B][2][H][slots][D], with room after the held slots where the new block is written:
            # no second copy of the held K/V to append it. Runs past the table read the table's
            # last block as a stand-in; the new block and the slice below leave none of it seen.
            have = -(-width // bt)
            nb = -(-(width + t) // bt)
            tables = np.asarray([step.tables[row][layer][:have] for row in range(b)], np.int64)
            if nb > have:
                tables = np.concatenate((tables, np.repeat(tables[:, -1:], nb - have, 1)), 1)
            runs = ((tables * (2 * h))[:, None, None, :] + self._kv_head_runs(h)).reshape(-1)
            held_kv = arena.view(-1, bt, d).index_select(
                0, torch.as_tensor(runs, device=arena.device)).view(b, 2, h, nb * bt, d)
            if held_kv.device != new_k.device or held_kv.dtype != new_k.dtype:
                held_kv = held_kv.to(new_k.device, new_k.dtype)
            held_kv[:, 0, :, width:width + t] = new_k
            held_kv[:, 1, :, width:width + t] = new_v
            return held_kv[:, 0, :, :width + t], held_kv[:, 1, :, :width + t]
        # Not zeroed: every slot is written below (held rows, a shorter row's padding, the new
        # block), and the held rows go from the gathered blocks to their place in one copy.
        keys = new_k.new_empty((b, h, width + t, d))
        values = new_v.new_empty((b, h, width + t, d))
        for row in range(b):
            n = held[row]
            if n < width:
                keys[row, :, n:width].zero_()
                values[row, :, n:width].zero_()
            if n == 0:
                continue
            nb = -(-n // bt)
            table = torch.as_tensor(np.asarray(step.tables[row][layer][:nb], np.int64),
                                    device=arena.device)
            blocks = arena.index_select(0, table)  # [nb][2][H][bt][D]: the held tokens only
            full = n // bt
            for out, kv in ((keys, 0), (values, 1)):
                if full:
                    out[row, :, :full * bt].view(h, full, bt, d).copy_(
                        blocks[:full, kv].permute(1, 0, 2, 3))
                if n > full * bt:
                    out[row, :, full * bt:n].copy_(blocks[full, kv, :, :n - full * bt])
        keys[:, :, width:] = new_k
        values[:, :, width:] = new_v
        return keys, values

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _kv_head_runs(h: int) -> np.ndarray:
        """[1][2][H][1]: the offset of (K or V, head) among a block's 2 x H runs."""
        return (np.arange(2)[:, None] * h + np.arange(h)[None, :])[None, :, :, None]

    def _layer_mask(self, layer: int, given: Any, query: Any, original: str) -> Any:
        """The mask of one layer of the compacted cache (None when nothing needs masking)."""
        step = self._step
        assert step is not None, "no forward pass in progress"
        t = query.shape[2]
        counts = [row[layer] for row in step.held]
        width = max(counts)
        window = self.windows[layer]
        if layer == 0 and given is not None and not self._padded:
            self._check_no_padding(given, t, layer)
        if self._mirrors(step, layer):
            if min(counts) == width:
                return None  # one query over equal rows sees every slot
            # The decode token sits in slot held of each row: a row sees slots [0, held].
            visible = (torch.arange(width + 1)[None, :] <= torch.as_tensor(counts)[:, None])
            return self._as_mask(visible[:, None, None], query, original)
        if step.real is None and min(counts) == width and (
                t == 1 or (width == 0 and original == "sdpa" and (window == 0 or t <= window))):
            # One query over equal rows sees everything (a sliding layer holds W - 1 tokens);
            # a fresh block with no mask is causal in sdpa (is_causal), as long as it fits a
            # sliding layer's window; eager needs its causal mask spelled out.
            return None
        held = torch.as_tensor(counts)
        slots = torch.arange(width + t)
        q = torch.arange(t)
        new = (slots[None, :] >= width) & (slots[None, :] - width <= q[:, None])  # [T][S]
        if window > 0:
            new &= slots[None, :] - width > q[:, None] - window
        visible = (slots[None, None, :] < held[:, None, None]) | new[None]  # [B][T][S]
        if step.real is not None:
            # Padding columns are seen by no query; a padding query sees itself (its output is
            # never used, but a row with nothing visible would be NaN and spread through V).
            visible[:, :, width:] &= step.real[:, None, :]
            diagonal = torch.arange(t)
            visible[:, diagonal, width + diagonal] |= ~step.real
        if window > 0 and width > 0:
            # A held slot of a sliding layer is visible to query i (position seen + i) while its
            # position is inside the window: p > seen + i - W.
            for row, per_layer in enumerate(step.slot_positions):
                pos = per_layer[layer]
                inside = pos[None, :] > (self._seen + q)[:, None] - window  # [T][held]
                visible[row, :, :len(pos)] &= inside
        # Built on the CPU (small; the held counts and positions live there); attention runs where
        # the query is.
        return self._as_mask(visible[:, None], query, original)  # [B][1][T][S]

    @staticmethod
    def _as_mask(visible: Any, query: Any, original: str) -> Any:
        """A [B][1][T][S] visibility mask as the attention implementation takes it: bool for
        sdpa, additive for eager."""
        visible = visible.to(query.device)
        if original == "sdpa":
            return visible
        neg = torch.finfo(query.dtype).min
        return torch.zeros(visible.shape, dtype=query.dtype,
                           device=query.device).masked_fill(~visible, neg)

    def _check_no_padding(self, given: Any, t: int, layer: int) -> None:
        """The library's mask (sized by get_mask_sizes) must be plain causal (within the sliding
        window of a sliding layer): anything else is padding or a custom mask, which the
        compacted cache cannot honour."""
        sizes = self._mask_sizes.get(layer)
        if sizes is None or given.dim() != 4:
            raise UnsupportedModelError("custom attention masks are not supported")
        q, kv_len, kv_off = sizes
        visible = given if given.dtype == torch.bool else given > torch.finfo(given.dtype).min / 2
        if visible.shape[-2:] != (q, kv_len):
            raise UnsupportedModelError("custom attention masks are not supported")
        kv_pos = torch.arange(kv_len)[None, :] + kv_off
        q_pos = torch.arange(q)[:, None] + self._seen
        expect = kv_pos <= q_pos
        if self.windows[layer] > 0:
            expect &= kv_pos > q_pos - self.windows[layer]
        if not bool((visible == expect.to(visible.device)).all()):
            raise UnsupportedModelError(
                "the attention mask masks some tokens, and the cache was not given the call's "
                "2D attention_mask (padding is read from it: call the model the SidecarCache "
                "was built with, passing attention_mask); custom masks are not supported")

    def _decode_evicts(self) -> bool:
        """Whether a decode step can evict (and so needs its query): a budget held while
        decoding, or D2O's fraction budget (rho) on a sequence without a token budget. Without
        one the DecodeStep only appends, and the query would cost the sidecar its attention over
        every held key for nothing (the policy's state then lacks the decoded tokens' queries:
        a later block's compression scores them as the prefill left them)."""
        if self.budget_tokens > 0:
            return self.hold_budget
        return self._name == "d2o" and self.policy is not None and self.policy.d2o.rho > 0

    def _take_queries(self, layer: int, query: Any, scale: Optional[float]) -> None:
        if self._query_window == 0:
            return
        step = self._step
        assert step is not None, "no forward pass in progress"
        if step.decode and not self._decode_evicts():
            return
        w = 1 if step.decode else self._query_window
        if scale is not None:
            step.scale = float(scale)
        q = query.detach()
        if w is not None and w < q.shape[2]:
            q = q[:, :, -w:]
        # A copy of the window only: a view would keep the layer's whole query tensor alive
        # until the step ends (every layer's, for a long prompt: hundreds of MB).
        step.queries[layer] = q.to(device="cpu", dtype=torch.float32).numpy().copy()

    def _attended(self, layer: int) -> None:
        step = self._step
        assert step is not None, "no forward pass in progress"
        step.attended = layer
        if layer == self.num_layers - 1:
            self._end_step()

    @staticmethod
    def _attention_of(step: _Step, row: int, layers: Sequence[int], listed: bool = False
                      ) -> Optional[common_pb2.AttentionInputs]:
        """The row's queries of `layers` as AttentionInputs (`listed`: naming the layers)."""
        if not step.queries:
            return None
        q = np.stack([step.queries[layer][row] for layer in layers])
        w = q.shape[2]
        positions = step.positions[-w:]
        if step.real is not None:
            # A padded row's policy reads the queries of its real tokens only.
            real = step.real[row, -w:].numpy()
            if not real.any():
                return None
            q, positions = np.ascontiguousarray(q[:, :, real]), positions[real]
        return attention(q, query_positions=positions.tolist(), softmax_scale=step.scale,
                         layers=list(layers) if listed else None)

    def _query_bytes(self, step: _Step) -> int:
        """Bytes of queries one row sends for every layer of the step (fp32)."""
        return sum(int(q[0].nbytes) for q in step.queries.values())

    def _end_step(self) -> None:
        step = self._step
        assert step is not None, "no forward pass in progress"
        self._step = None
        t = len(step.positions)
        every = range(self.num_layers)
        rows_total = len(self.sequence_ids)
        if step.decode:
            if self._omni is not None:
                self._omni.finish()
            attns = [self._attention_of(step, row, every) for row in range(rows_total)]
            self.last_attention = attns
            items = [DecodeItem(seq, attention=attn, inline_kv=buf.tobytes(), return_layout=True)
                     for seq, attn, buf in zip(self.sequence_ids, attns, step.inline)]
            future = self._send(items)
            self._inflight = (future, items, step.positions)
            self._seen += t
            if not self.overlap:
                self.sync()
            return
        if self._arena().is_cuda:
            torch.cuda.synchronize()  # the K/V writes land before the Commit that publishes them
        compress = self.budget_tokens > 0
        if self._mirror is not None:
            self._mirror.invalidate()  # the Commit may compact every layer
        rows = [row for row, res in enumerate(step.reservations) if res is not None]
        if len(rows) * self._query_bytes(step) <= self.max_message_bytes:
            attns = [self._attention_of(step, row, every) for row in range(rows_total)]
            self.last_attention = attns
            if compress and not self.hold_budget:
                self._commit_then_compress(step, rows, attns)
            else:
                self._commit(step, rows, compress, attns)
        else:
            self.last_attention = []
            self._commit(step, rows, False, [None] * rows_total)
            for row in rows:
                self._observe_in_chunks(step, row, compress)
        self._seen += t

    def _send(self, items: List[DecodeItem]) -> Any:
        """Sends the step's DecodeStep from the cache's sender thread; returns its future. gRPC
        writes a request in the thread that starts the call, and a step's request (every layer's
        K/V and query: 115 KB for SmolLM2) took 2-7 ms of the model's thread to write on a loaded
        machine; the sender thread writes it while the model computes its logits."""
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvsidecar-decode-step")
        return self._sender.submit(self.session.decode_step, items)

    def _commit_then_compress(self, step: _Step, rows: List[int],
                              attns: List[Optional[common_pb2.AttentionInputs]]) -> None:
        """hold_budget=False (kvpress's protocol): the sequences have no budget; the block is
        committed, then each row compressed to budget_tokens in one BatchCompress. A policy that
        reads every query folds them in at the Commit and evicts from that state; a window
        policy's Compress carries its window (SnapKV, TOVA and CAKE remember nothing between
        calls)."""
        every = self._query_window is None
        self._commit(step, rows, False, attns if every else [None] * len(attns))
        if not rows:
            return
        items = []
        for row in rows:
            item: Dict[str, Any] = {"sequence_id": self.sequence_ids[row],
                                    "budget_tokens": self.budget_tokens}
            if not every and attns[row] is not None:
                item["attention"] = attns[row]
            items.append(item)
        resp = self.session.batch_compress(items)
        for row, out in zip(rows, resp.responses):
            self._counts[row] = [entry.kept for entry in sorted(out.layers,
                                                                key=lambda e: e.layer)]

    def _commit(self, step: _Step, rows: List[int], compress: bool,
                attns: List[Optional[common_pb2.AttentionInputs]]) -> None:
        """One BatchCommit of the block's reservations, each with its row's attention."""
        if not rows:
            return
        request = sidecar_pb2.BatchCommitRequest(requests=[
            self.session._commit_request(step.reservations[row], compress, attns[row])
            for row in rows])
        resp = self.session._call(self.session.stub.BatchCommit, request)
        for row, out in zip(rows, resp.responses):
            self._counts[row] = list(out.counts)

    def _observe_in_chunks(self, step: _Step, row: int, compress: bool) -> None:
        """A committed block whose queries do not fit one message (a long prompt under a policy
        that reads every query): the sidecar observes them a few layers per Compress whose budget
        exceeds what any layer holds (so it evicts nothing and only folds the queries into the
        policy state), then one Compress without attention evicts to the budget from the
        accumulated state (common.proto AttentionInputs: attention already folded in is
        reused). Each message stays under max_message_bytes."""
        seq = self.sequence_ids[row]
        per_layer = max(1, self._query_bytes(step) // max(1, self.num_layers))
        chunk = max(1, self.max_message_bytes // per_layer)
        for first in range(0, self.num_layers, chunk):
            layers = list(range(first, min(self.num_layers, first + chunk)))
            attn = self._attention_of(step, row, layers, listed=True)
            if attn is None:
                return  # a row of padding only: nothing to observe, nothing to evict
            self.session.compress(seq, budget_tokens=OBSERVE_ONLY_BUDGET, attention=attn)
        if compress:
            resp = self.session.compress(
                seq, budget_tokens=None if self.hold_budget else self.budget_tokens)
            self._counts[row] = [entry.kept for entry in sorted(resp.layers,
                                                                key=lambda e: e.layer)]

    def sync(self) -> None:
        """Waits for the DecodeStep in flight and applies its answer (raises its error)."""
        if self._inflight is None:
            return
        future, items, positions = self._inflight
        self._inflight = None
        resp = future.result()
        for row, out in enumerate(resp.items):
            if out.position != int(positions[0]):
                raise RuntimeError(
                    f"sequence {items[row].sequence_id}: the sidecar appended the token at "
                    f"position {out.position}, the model computed {int(positions[0])}")
            self._counts[row] = list(out.counts)
        if self._mirror is not None:
            b, evicted = len(resp.items), [list(out.evicted_positions) for out in resp.items]
            if all(len(e) == self.num_layers * self.num_kv_heads for e in evicted):
                self._mirror.apply(int(positions[0]), np.asarray(self._counts),
                                   np.asarray(evicted, np.int64).reshape(
                                       b, self.num_layers, self.num_kv_heads),
                                   np.asarray([out.merged for out in resp.items]))
            else:
                self._mirror.invalidate()
        # What the next step reads the held K/V by, unless a server that predates return_layout
        # left them out (then the next step asks with GetLayout).
        if all(len(out.layers) == self.num_layers for out in resp.items):
            self._next_layouts = [list(out.layers) for out in resp.items]

    # -- compressed prefix reuse ---------------------------------------------------------------

    def publish(self, key: str, query_window: Optional[int] = None
                ) -> sidecar_pb2.PublishResponse:
        """Publishes this cache's sequence (a cache of one row, after its prefill and
        compression) under ``key`` (:func:`kvsidecar.prefix_key`): another worker of the tenant
        starts from it with :meth:`from_prefix` instead of recomputing the prefill."""
        self.sync()
        if len(self.sequence_ids) != 1:
            raise UnsupportedModelError(
                f"publish needs a cache of one row after its prefill; this one holds "
                f"{len(self.sequence_ids)} sequences")
        return self.session.publish(self.sequence_ids[0], key, query_window)

    @classmethod
    def from_prefix(cls, session: Session, model: Any, key: str,
                    overlap: bool = True) -> "SidecarCache":
        """A cache of one row started from the prefix published under ``key``: its K/V,
        positions, policy and budget as published. Pass ``generate`` the prefix's tokens followed
        by the new ones: the cache reports the prefix as seen, so only the new ones are
        computed."""
        created = session.create_sequence(from_prefix=key)
        try:
            layout = session.get_layout(created.sequence_id, omit_positions=True)
            tokens = int(created.budget.tokens_per_layer)
            cache = cls(session, model, policy=created.policy, budget=tokens or None,
                        overlap=overlap)
        except Exception:
            session.release_sequence(created.sequence_id)
            raise
        by_layer = sorted(layout.layers, key=lambda e: e.layer)
        if cache._omni is not None:
            cache._omni.plan(created.policy, cache.windows)
        cache.sequence_ids = [created.sequence_id]
        cache.budget_tokens = int(created.budget.tokens_per_layer)
        cache._seen = int(layout.next_position)
        cache._counts = np.array([[e.count for e in by_layer]], np.int64)
        return cache

    # -- state and accounting ----------------------------------------------------------------

    @property
    def last_selection(self) -> Dict[int, List[sidecar_pb2.SelectResponse.Item]]:
        """OmniKV: the last decode step's Select answer per filter layer, one item per row
        (selected positions, staging views of the sparse layers); empty for other policies."""
        return {} if self._omni is None else dict(self._omni.selection)

    @property
    def counts(self) -> List[List[int]]:
        """Tokens held per row and layer now."""
        self.sync()
        return [] if self._counts is None else self._counts.tolist()

    def kv_bytes(self) -> int:
        """Bytes of K and V the sidecar holds for this cache now (all rows and layers)."""
        per_token = 2 * self.num_kv_heads * self.head_dim * self.session.arena.storage_dtype.itemsize
        return int(np.sum(self.counts)) * per_token

    def release(self) -> None:
        """Releases the sidecar sequences (the cache is empty afterwards)."""
        try:
            self.sync()
        finally:
            step, self._step = self._step, None
            if step is not None:
                self._abandon(step)
            ids, self.sequence_ids = self.sequence_ids, []
            self._counts = None
            self._mirror = None
            self._next_layouts = None
            self._seen = 0
            self._padded = False
            self._arena_t = None
            if self._omni is not None:
                self._omni = _OmniKv()
            for seq in ids:
                self.session.release_sequence(seq)

    def __enter__(self) -> "SidecarCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- what it does not do -------------------------------------------------------------------

    def _unsupported(self, what: str) -> None:
        raise UnsupportedModelError(
            f"SidecarCache does not support {what}: the sidecar owns the kept set")

    def reset(self) -> None:
        self.release()

    def reorder_cache(self, beam_idx: Any) -> None:
        self._unsupported("reorder_cache (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._unsupported("batch_repeat_interleave (num_return_sequences or num_beams > 1)")

    def batch_select_indices(self, indices: Any) -> None:
        self._unsupported("batch_select_indices (contrastive search)")
