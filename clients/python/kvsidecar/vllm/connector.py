"""``SidecarConnector``: vLLM's KV connector (V1) over kvsidecar.

Selected with one flag::

    --kv-transfer-config '{"kv_connector": "SidecarConnector",
        "kv_connector_module_path": "kvsidecar.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "127.0.0.1:50051", "tier": "remote"}}'

vLLM's own prefix cache stays on and answers first; the connector serves what it misses.

*Scheduler side* (vLLM's engine-core process): ``get_num_new_matched_tokens`` hashes the prompt
block by block (:mod:`kvsidecar.vllm.keys`) and asks the sidecar which keys its tenant holds
(``LookupPrefixes``, one call); whole mode answers the longest stored run of blocks past vLLM's
own hit. In compressed mode it reads the longest stored compressed prefix (``P`` prompt tokens
kept as ``C``) right there, re-rotates its keys to positions ``0..C-1``
(:mod:`kvsidecar.vllm.rerotate`) and rewrites the request's prompt to ``C`` placeholder tokens
followed by the prompt's tokens after ``P``: vLLM then computes the rest at positions from ``C``
on. The placeholders are salted (``cache_salt``) so that vLLM's prefix cache never takes those
blocks for real tokens. Everything that can fail happens before the rewrite: any error leaves the
request untouched and reports no hit.

*Worker side* (vLLM's worker process): ``start_load_kv`` copies each loaded block from the
sidecar's arena into vLLM's paged blocks (compressed prefixes come with the step's metadata, already
read and rotated); a block that cannot be read is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes from it (the connector sets vLLM's
``kv_load_failure_policy`` to ``recompute``). ``wait_for_save``, after the step whose forward
completed a prompt's blocks, copies them into the arena and publishes them: whole, one copy per
block under its chain key, or compressed by the sidecar with the configured policy and budget,
one copy under the key of the prefix, to the configured tier.

Any failure (no sidecar, a damaged or missing copy, a shape that does not match) is logged with
its reason and ends as a miss or a recompute: the connector never hands vLLM KV it did not verify.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.logger import init_logger

import kvsidecar as kvs
from kvsidecar.vllm import config as cfgmod
from kvsidecar.vllm import keys as keymod
from kvsidecar.vllm import paged
from kvsidecar.vllm.rerotate import Rerotator, contiguous_positions
from kvsidecar.vllm.store import TIERS, SidecarStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvsidecar")

# The token id of a compressed prefix's slots in a rewritten prompt (never fed to the model).
PLACEHOLDER_TOKEN = 0
# Between two attempts to attach to a sidecar that did not answer (each waits up to 1 s).
RECONNECT_INTERVAL_S = 5.0


@dataclass
class LoadItem:
    req_id: str
    block_ids: List[int]
    keys: List[str] = field(default_factory=list)  # whole: one key per block
    # compressed: per layer K, V [H][C][D], already in position order and re-rotated
    keys_kv: Optional[List[torch.Tensor]] = None
    values_kv: Optional[List[torch.Tensor]] = None


@dataclass
class SaveItem:
    req_id: str
    block_ids: List[int]         # the vLLM blocks holding the tokens to save
    keys: List[str]              # whole: key per block (same length as block_ids)
    compressed_key: str = ""     # compressed: the prefix's key
    num_tokens: int = 0          # compressed: prefix tokens
    budget_tokens: int = 0
    window_slots: List[int] = field(default_factory=list)  # snapkv: its window's cache slots


@dataclass
class SidecarMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: List[LoadItem] = field(default_factory=list)
    saves: List[SaveItem] = field(default_factory=list)


@dataclass
class _Plan:
    """What the scheduler side knows of one request."""
    chain: List[str]               # whole-block keys of the prompt's full blocks
    stored: Set[int]               # blocks the sidecar holds (found or loaded)
    save_blocks: int               # full blocks of the prompt (whole mode saves these)
    save_tokens: int = 0           # compressed mode: prefix to compress and publish (0 = none)
    compressed_key: str = ""
    load: Optional[LoadItem] = None
    loaded_tokens: int = 0
    # compressed: the prefix as loaded (kept for a reload after a preemption frees its blocks)
    compressed_kv: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None
    rewritten: bool = False        # compressed prefix loaded: the prompt holds placeholders
    saved: bool = False


class SidecarConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM KV connector storing prefixes in kvsidecar (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole",
                 kv_cache_config: "KVCacheConfig" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = cfgmod.parse(self._kv_transfer_config.kv_connector_extra_config)
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.block_tokens = int(vllm_config.cache_config.block_size)
        self.dtype = _cache_dtype(vllm_config)
        self.layout = kvs.model_layout(
            num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
            head_dim=model.get_head_size(), dtype=paged.SIDECAR_DTYPES[self.dtype],
            num_q_heads=model.get_num_attention_heads(parallel), block_tokens=self.block_tokens)
        self.root = keymod.root_hash(self.cfg.model_id or str(model.model),
                                     self.layout.SerializeToString(deterministic=True))
        self.tier = TIERS[self.cfg.tier]
        self.num_blocks = self.cfg.num_blocks or self.layout.num_layers * (
            -(-int(model.max_model_len) // self.block_tokens) + 1)
        self._store: Optional[SidecarStore] = None
        self._next_attempt = 0.0
        self._down_reason = ""
        self.disabled = ""  # why this connector serves nothing, if it does not
        self.rotator: Optional[Rerotator] = None
        is_scheduler = role == KVConnectorRole.SCHEDULER
        if is_scheduler:
            self._plans: Dict[str, _Plan] = {}
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # A block that cannot be read must be recomputed, not fail the request.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if self.cfg.compressed:
                try:
                    self.rotator = Rerotator.for_model(vllm_config)
                except ValueError as e:
                    self.disabled = f"compressed prefixes need re-rotated keys: {e}"
        else:
            self.kv_caches: List[torch.Tensor] = []
            self._invalid: Set[int] = set()
        logger.info("kvsidecar: %s connector, %s%s", "scheduler" if is_scheduler else "worker",
                    cfgmod.as_dict(self.cfg),
                    f"; serving nothing: {self.disabled}" if self.disabled else "")

    # ---- the sidecar session (both roles) ----

    def _session(self) -> Optional[SidecarStore]:
        if self.disabled:
            return None
        if self._store is not None and self._store.healthy():
            return self._store
        if self._store is not None:
            health = self._store.session.health
            self._drop_store(f"the session ended: {health}" if health else "the session ended")
        now = time.monotonic()
        if now < self._next_attempt:
            return None
        self._next_attempt = now + RECONNECT_INTERVAL_S
        try:
            self._store = SidecarStore(
                self.cfg.address, self.layout, self.dtype, token=self.cfg.token,
                tenant=self.cfg.tenant, num_blocks=self.num_blocks, timeout=self.cfg.timeout,
                worker_name=f"vllm-{self.role.name.lower()}-{os.getpid()}")
        except Exception as e:  # noqa: BLE001 - any failure: no sidecar for now
            reason = f"{type(e).__name__}: {e}"
            if reason != self._down_reason:
                logger.warning("kvsidecar: no sidecar at %s (%s); serving no hits, saving "
                               "nothing until it answers", self.cfg.address, reason)
            self._down_reason = reason
            return None
        if self._down_reason:
            logger.info("kvsidecar: sidecar at %s answers again (after: %s)", self.cfg.address,
                        self._down_reason)
        self._down_reason = ""
        return self._store

    def _drop_store(self, why: str) -> None:
        logger.warning("kvsidecar: dropping the sidecar session (%s)", why)
        self._down_reason = why
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass

    def _failed(self, what: str, e: BaseException) -> None:
        logger.warning("kvsidecar: %s: %s: %s", what, type(e).__name__, e)
        if isinstance(e, kvs.errors.Unavailable) or isinstance(e, kvs.errors.NotFound) and \
                "session" in str(e):
            self._drop_store(f"{type(e).__name__}")

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        plan = self._plans.get(request.request_id)
        if plan is not None and plan.rewritten:
            return max(0, plan.loaded_tokens - num_computed_tokens), False
        prompt = list(request.prompt_token_ids or [])
        b = self.block_tokens
        full = len(prompt) // b
        plan = _Plan(chain=[keymod.hex_key(h) for h in
                            keymod.block_chain(self.root, prompt, b, full)],
                     stored=set(), save_blocks=full)
        self._plans[request.request_id] = plan
        store = self._session()
        if store is None or not prompt:
            return 0, False
        usable = (len(prompt) - 1) // b  # vLLM computes at least the prompt's last token
        if self.cfg.compressed:
            return self._match_compressed(request, prompt, plan, store, num_computed_tokens), False
        try:
            found = store.lookup(plan.chain)
        except Exception as e:  # noqa: BLE001
            self._failed(f"lookup for request {request.request_id} (no hit)", e)
            return 0, False
        plan.stored = set(found)
        run = 0
        while run < usable and run in found:
            run += 1
        local = num_computed_tokens // b
        if run <= local:
            return 0, False
        plan.load = LoadItem(request.request_id, [], keys=plan.chain[local:run])
        plan.loaded_tokens = (run - local) * b
        return plan.loaded_tokens, False

    def _compressed_candidates(self, request: "Request", prompt: List[int],
                               plan: _Plan) -> List[int]:
        """Prefix lengths a compressed copy may have, longest first: the request's
        ``kv_transfer_params["kvsidecar"]["prefix_tokens"]`` when given, else every block
        boundary short of the prompt's last token."""
        params = (request.kv_transfer_params or {}).get("kvsidecar") or {}
        hint = int(params.get("prefix_tokens", 0) or 0)
        if hint > 0:
            return [min(hint, len(prompt) - 1)]
        usable = (len(prompt) - 1) // self.block_tokens
        return [n * self.block_tokens for n in range(usable, 0, -1)]

    def _match_compressed(self, request: "Request", prompt: List[int], plan: _Plan,
                          store: SidecarStore, num_computed_tokens: int) -> int:
        lengths = self._compressed_candidates(request, prompt, plan)
        chain = [bytes.fromhex(k) for k in plan.chain]
        method = self.cfg.method()
        keys = [keymod.compressed_key(self.root, chain, prompt, self.block_tokens, n, method)
                for n in lengths if n > 0]
        if lengths and lengths[0] > 0:
            plan.save_tokens, plan.compressed_key = lengths[0], keys[0]
        if num_computed_tokens > 0 or not keys:
            return 0  # vLLM's own cache holds the start of this prompt whole: better than a copy
        try:
            found = store.lookup(keys)
            if not found:
                return 0
            index = min(found)
            plan.save_tokens = 0  # the longest candidate is stored already (or a longer one is)
            data = store.fetch_compressed(keys[index])
            k, v = self._rotated(data, lengths[index])
        except Exception as e:  # noqa: BLE001
            self._failed(f"compressed prefix for request {request.request_id} (no hit)", e)
            return 0
        kept = int(k[0].shape[1])
        _rewrite_prompt(request, kept, lengths[index], keys[index])
        plan.rewritten, plan.loaded_tokens = True, kept
        plan.compressed_kv = (k, v)
        logger.info("kvsidecar: request %s starts from a compressed prefix: %d prompt tokens "
                    "kept as %d", request.request_id, lengths[index], kept)
        return kept

    def _rotated(self, data: Any, prefix_tokens: int) -> Tuple[List[torch.Tensor],
                                                               List[torch.Tensor]]:
        assert self.rotator is not None
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        counts = {int(k.shape[1]) for k in data.keys}
        if len(counts) != 1:
            raise ValueError(f"layers keep different token counts {sorted(counts)}; a prompt "
                             "can start from one count only")
        (kept,) = counts
        if not 0 < kept <= prefix_tokens:
            raise ValueError(f"{kept} kept tokens for a prefix of {prefix_tokens}")
        out_k, out_v = [], []
        for layer, (k, v, pos) in enumerate(zip(data.keys, data.values, data.positions)):
            if tuple(k.shape) != (heads, kept, dim) or tuple(pos.shape) != (heads, kept):
                raise ValueError(f"layer {layer}: K {tuple(k.shape)}, positions "
                                 f"{tuple(pos.shape)}; expected ({heads}, {kept}, {dim})")
            if int(pos.min()) < 0 or int(pos.max()) >= prefix_tokens:
                raise ValueError(f"layer {layer}: positions outside [0, {prefix_tokens})")
            rk, rv = contiguous_positions(k, v, pos, self.rotator)
            if not (torch.isfinite(rk).all() and torch.isfinite(rv).all()):
                raise ValueError(f"layer {layer}: non-finite K/V")
            out_k.append(rk.contiguous())
            out_v.append(rv.contiguous())
        return out_k, out_v

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        b = self.block_tokens
        if plan.compressed_kv is not None:
            # Every allocation that counts the prefix as computed gets it (again, after a
            # preemption).
            k, v = plan.compressed_kv
            plan.load = LoadItem(request.request_id, block_ids[:-(-num_external_tokens // b)],
                                 keys_kv=k, values_kv=v)
        elif plan.load is not None:
            # After vLLM's own hit (blocks 0..start-1): the blocks the keys name, in order.
            start = plan.chain.index(plan.load.keys[0])
            plan.load.block_ids = block_ids[start:start + num_external_tokens // b]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> SidecarMetadata:
        meta = SidecarMetadata()
        for plan in self._plans.values():
            if plan.load is not None and plan.load.block_ids:
                meta.loads.append(plan.load)
                plan.load = None
        progress: Dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            progress[req_id] = computed
        for req_id, computed in progress.items():
            pending = self._plans.get(req_id)
            if pending is None or pending.saved or pending.rewritten:
                continue
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            item = self._save_item(req_id, pending, computed, done)
            if item is not None:
                meta.saves.append(item)
        return meta

    def _save_item(self, req_id: str, plan: _Plan, computed_tokens: int,
                   done_tokens: int) -> Optional[SaveItem]:
        b = self.block_tokens
        if self.cfg.compressed:
            n = plan.save_tokens
            if n <= 0:
                plan.saved = True
                return None
            if done_tokens < n:
                return None
            plan.saved = True
            all_blocks = self._block_ids(req_id)
            item = SaveItem(req_id, all_blocks[:-(-n // b)], [], compressed_key=plan.compressed_key,
                            num_tokens=n, budget_tokens=self.cfg.budget_for(n))
            if self.cfg.window:
                w = min(self.cfg.window, n)
                if computed_tokens > n - w:
                    # The window's queries were computed in an earlier step (chunked prefill).
                    logger.info("kvsidecar: request %s: snapkv's window of %d queries spans "
                                "two steps; prefix not stored", req_id, w)
                    return None
                item.window_slots = [all_blocks[p // b] * b + p % b for p in range(n - w, n)]
            return item
        if done_tokens < plan.save_blocks * b:
            return None
        plan.saved = True
        missing = [i for i in range(plan.save_blocks) if i not in plan.stored]
        if not missing:
            return None
        ids = self._block_ids(req_id)
        return SaveItem(req_id, [ids[i] for i in missing], [plan.chain[i] for i in missing])

    def _block_ids(self, req_id: str) -> List[int]:
        assert self._kv_cache_manager is not None
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._plans.pop(request.request_id, None)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self.kv_caches = [tensor for _, tensor in ordered]
        want = (self.layout.num_kv_heads, self.block_tokens, 2 * self.layout.head_dim)
        shapes = {tuple(t.shape[1:]) for t in self.kv_caches}
        if len(self.kv_caches) != self.layout.num_layers or shapes != {want} or any(
                t.dtype != self.dtype or t.device.type != "cpu" for t in self.kv_caches):
            self.disabled = (f"vLLM's KV caches ({len(self.kv_caches)} layers, block shapes "
                             f"{sorted(shapes)}) are not the CPU layout [blocks, {want[0]}, "
                             f"{want[1]}, {want[2]}] x {self.layout.num_layers} this connector "
                             "reads")
        else:
            self.disabled = paged.check_layout(self.dtype, self.block_tokens,
                                               self.layout.num_kv_heads, self.layout.head_dim)
        if self.disabled:
            logger.warning("kvsidecar: serving nothing: %s", self.disabled)
        elif self.cfg.window:
            self._wrap_attention()

    # SnapKV needs the post-RoPE queries of its window, which vLLM keeps nowhere: each attention
    # layer's forward is wrapped to copy the rows of the window's tokens (found by their cache
    # slots) in the step that computes them.

    def _wrap_attention(self) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        self._capture_slots: Dict[int, Tuple[int, int]] = {}   # slot -> (save item, row)
        self._captured: Dict[int, Dict[int, torch.Tensor]] = {}  # item -> layer -> [W][Hq][D]
        for name, layer in context.items():
            impl = getattr(layer, "impl", None)
            if impl is None or not hasattr(layer, "kv_cache"):
                continue
            index = extract_layer_index(name)
            forward = impl.forward

            def wrapped(layer_: Any, query: torch.Tensor, *args: Any, _forward: Any = forward,
                        _index: int = index, **kwargs: Any) -> Any:
                if self._capture_slots and len(args) >= 4 and args[3] is not None:
                    self._capture(_index, query, args[3])
                return _forward(layer_, query, *args, **kwargs)

            impl.forward = wrapped

    def _capture(self, layer: int, query: torch.Tensor, attn_metadata: Any) -> None:
        md = attn_metadata[next(iter(attn_metadata))] if isinstance(attn_metadata, dict) \
            else attn_metadata
        slots = md.slot_mapping[:query.shape[0]].tolist()
        for row, slot in enumerate(slots):
            hit = self._capture_slots.get(int(slot))
            if hit is None:
                continue
            item, w = hit
            per_layer = self._captured.setdefault(item, {})
            if layer not in per_layer:
                n = sum(1 for v in self._capture_slots.values() if v[0] == item)
                per_layer[layer] = torch.zeros(n, query.shape[1], query.shape[2])
            per_layer[layer][w] = query[row].to(torch.float32)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._role == KVConnectorRole.WORKER and self.cfg.window:
            self._capture_slots = {slot: (i, w) for i, item in enumerate(connector_metadata.saves)
                                   for w, slot in enumerate(item.window_slots)}
            self._captured = {}

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for item in meta.loads:
            logger.info("kvsidecar: request %s: loading %d blocks", item.req_id,
                        len(item.block_ids))
            if self.cfg.load_delay_s:
                time.sleep(self.cfg.load_delay_s)
            if item.keys_kv is not None:
                assert item.values_kv is not None
                for layer, cache in enumerate(self.kv_caches):
                    paged.write_tokens(cache, item.block_ids, item.keys_kv[layer],
                                       item.values_kv[layer])
                continue
            self._load_whole(item)

    def _load_whole(self, item: LoadItem) -> None:
        store = self._session()
        if store is None or len(item.keys) != len(item.block_ids):
            why = ((self._down_reason or self.disabled or "no sidecar") if store is None
                   else f"{len(item.keys)} keys for {len(item.block_ids)} blocks")
            logger.warning("kvsidecar: request %s: %d blocks not loaded (%s); vLLM recomputes "
                           "them", item.req_id, len(item.block_ids), why)
            self._invalid.update(item.block_ids)
            return

        def sink(layer: int, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            paged.write_blocks(self.kv_caches[layer], [item.block_ids[i]], k.unsqueeze(0),
                               v.unsqueeze(0))

        try:
            store.load_blocks(item.keys, sink)
        except Exception as e:  # noqa: BLE001
            self._failed(f"request {item.req_id}: loading {len(item.keys)} blocks (vLLM "
                         "recomputes them)", e)
            self._invalid.update(item.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save saves whole blocks after the forward

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for i, item in enumerate(meta.saves):
            store = self._session()
            if store is None:
                return
            try:
                self._save(store, item, i)
            except Exception as e:  # noqa: BLE001
                self._failed(f"request {item.req_id}: saving its prefix (not stored)", e)
        if self.cfg.window:
            self._capture_slots, self._captured = {}, {}

    def _window_attention(self, item: SaveItem, index: int) -> Any:
        """The window's post-RoPE queries as Commit takes them, or None when not every layer's
        were seen."""
        captured = self._captured.get(index, {})
        if sorted(captured) != list(range(self.layout.num_layers)):
            return None
        q = torch.stack([captured[layer] for layer in range(self.layout.num_layers)])
        w = len(item.window_slots)
        return kvs.attention(q.permute(0, 2, 1, 3).contiguous().numpy(),
                             query_positions=list(range(item.num_tokens - w, item.num_tokens)))

    def _save(self, store: SidecarStore, item: SaveItem, index: int) -> None:
        def source(layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
            return paged.read_blocks(self.kv_caches[layer], item.block_ids)

        if item.compressed_key:
            attention = None
            if item.window_slots:
                attention = self._window_attention(item, index)
                if attention is None:
                    logger.warning("kvsidecar: request %s: the window's queries were not all "
                                   "seen; prefix not stored", item.req_id)
                    return
            stored = store.save_compressed(item.compressed_key, item.num_tokens, source,
                                           self.cfg.policy_spec(), item.budget_tokens, self.tier,
                                           query_window=len(item.window_slots),
                                           attention=attention)
            logger.info("kvsidecar: request %s: %d prefix tokens published compressed to %d "
                        "per layer (%d bytes)", item.req_id, item.num_tokens, item.budget_tokens,
                        stored)
        else:
            stored = store.save_blocks(item.keys, source, self.tier)
            logger.info("kvsidecar: request %s: %d blocks published (%d bytes)", item.req_id,
                        len(item.keys), stored)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def _cache_dtype(vllm_config: "VllmConfig") -> torch.dtype:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ValueError(f"kvsidecar: kv cache dtype {cache_dtype!r} is not served (use auto)")
    dtype = vllm_config.model_config.dtype
    if dtype not in paged.SIDECAR_DTYPES:
        raise ValueError(f"kvsidecar: model dtype {dtype} is not one of fp16, bf16, fp32")
    return dtype  # type: ignore[no-any-return]


def _rewrite_prompt(request: "Request", kept: int, prefix_tokens: int, key: str) -> None:
    """The prompt as vLLM computes it from a compressed prefix: ``kept`` placeholder tokens (the
    loaded slots), then the prompt after its first ``prefix_tokens``. The salt makes vLLM's own
    prefix cache hash these blocks apart from any real tokens."""
    prompt = list(request.prompt_token_ids or [])
    rewritten = [PLACEHOLDER_TOKEN] * kept + prompt[prefix_tokens:]
    request.prompt_token_ids = rewritten
    request._all_token_ids[:] = rewritten + list(request._output_token_ids)
    request.num_prompt_tokens = len(rewritten)
    request.cache_salt = f"kvsidecar-compressed:{key}"
    request.block_hashes = []
    request.update_block_hashes()
