"""The kvsidecar data-plane client: attach a worker, write and read its KV cache, compress it.

Ownership: a :class:`Client` owns one gRPC channel. A :class:`Session` (from
:meth:`Client.attach`) owns one attached server session: the arena mapping (mapped once, at
attach), the ``Watch`` stream that ties the session's life to this process (if the process dies,
its connection drops and the server reclaims the session at once), and a heartbeat thread that
renews the lease every ``lease_ms / 3``. Leaving the ``with`` block (or :meth:`Session.detach`)
ends the session, stops both and unmaps the arena.

Threading: Client and Session may be used from several threads (each call is one independent
RPC; the server serialises work on a session), except :meth:`Session.detach`, which must not
overlap other calls on the session. numpy views of the arena stay valid memory until the last
view is dropped, but their contents belong to the sidecar again after detach.

Errors: every failed call raises a :class:`kvsidecar.errors.KvsError` subclass with the gRPC code
and the server's message (INVALID_ARGUMENT messages name the offending field).

Layouts (see :mod:`kvsidecar.arena` for the block layout):
  - K/V of a reservation or a read: ``[H][tokens][D]`` arrays per layer.
  - Inline Append payloads and DecodeStep ``inline_kv``: ``[layers][2][H][tokens][D]``.
  - Queries (AttentionInputs): ``[layers][Hq][num_queries][D]``, post-RoPE.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple,
                    Union)

import grpc
import numpy as np

from kvsidecar import _rpc
from kvsidecar.arena import Arena, CudaArena, dtype_bytes, open_arena, storage_dtype, to_storage
from kvsidecar.errors import InvalidArgument, KvsError, OutOfRange, error_from_rpc
from kvsidecar.v1 import common_pb2, sidecar_pb2, sidecar_pb2_grpc

__all__ = [
    "Client", "Session", "Reservation", "ReserveItem", "AppendSegment", "DecodeItem",
    "CallFuture", "ExportResult", "LayerKV", "model_layout", "policy", "budget", "attention",
    "Tier", "prefix_key", "QUERY_AGNOSTIC_POLICIES",
]

Tier = common_pb2.Tier

_DTYPE_NAMES = {
    "fp16": common_pb2.DTYPE_FLOAT16, "float16": common_pb2.DTYPE_FLOAT16,
    "bf16": common_pb2.DTYPE_BFLOAT16, "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "fp32": common_pb2.DTYPE_FLOAT32, "float32": common_pb2.DTYPE_FLOAT32,
}

PolicyLike = Union[None, str, common_pb2.PolicySpec]
BudgetLike = Union[None, int, common_pb2.Budget]


# --- Request builders -------------------------------------------------------------------------


def _dtype(value: Union[int, str]) -> int:
    if isinstance(value, str):
        try:
            return _DTYPE_NAMES[value.lower()]
        except KeyError:
            raise InvalidArgument(
                f"dtype {value!r} is not one of {sorted(set(_DTYPE_NAMES))}") from None
    return int(value)


def model_layout(num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: Union[int, str] = "fp16", num_q_heads: Optional[int] = None,
                 block_tokens: int = 0) -> common_pb2.ModelLayout:
    """A ``ModelLayout``. ``dtype`` is "fp16", "bf16", "fp32" or a ``DType`` value;
    ``num_q_heads`` defaults to ``num_kv_heads``; ``block_tokens`` 0 = the server default."""
    return common_pb2.ModelLayout(
        num_layers=num_layers, num_kv_heads=num_kv_heads,
        num_q_heads=num_kv_heads if num_q_heads is None else num_q_heads, head_dim=head_dim,
        dtype=common_pb2.DType.ValueType(_dtype(dtype)), block_tokens=block_tokens)


def policy(name: str, allocator: Optional[common_pb2.LayerAllocator] = None,
           **params: Any) -> common_pb2.PolicySpec:
    """A ``PolicySpec`` by name with its parameters, e.g. ``policy("keydiff", recent_fraction=0.1)``
    or ``policy("streaming_llm", n_sink=4)``. Names: streaming_llm, keydiff, h2o, tova, snapkv,
    cake, d2o, caote, omnikv. kvpress's variants are parameters too:
    ``policy("h2o", normalize_by_queries=True)`` (ObservedAttentionPress),
    ``policy("tova", all_heads=True, keep_last_token=True)`` (TOVAPress) and
    ``policy("snapkv", defaults=common_pb2.SnapKvParams.DEFAULTS_KVPRESS)`` (SnapKVPress; with a
    PyramidKV allocator, PyramidKVPress)."""
    spec = common_pb2.PolicySpec(name=name)
    field_desc = common_pb2.PolicySpec.DESCRIPTOR.fields_by_name.get(name)
    if field_desc is not None and field_desc.containing_oneof is not None:
        sub = getattr(spec, name)
        sub.SetInParent()  # selects the params oneof even with every field at its default
        if params:
            sub.CopyFrom(type(sub)(**params))
    elif params:
        raise InvalidArgument(f"policy {name!r} takes no parameters")
    if allocator is not None:
        spec.allocator.CopyFrom(allocator)
    return spec


def _policy(value: PolicyLike) -> Optional[common_pb2.PolicySpec]:
    if value is None:
        return None
    if isinstance(value, str):
        return common_pb2.PolicySpec(name=value)
    return value


def budget(tokens_per_layer: int, strict: bool = False, prefill_block_tokens: int = 0,
           per_layer_tokens: Optional[Sequence[int]] = None) -> common_pb2.Budget:
    """A ``Budget`` of ``tokens_per_layer`` tokens kept per layer."""
    return common_pb2.Budget(tokens_per_layer=tokens_per_layer, strict=strict,
                             prefill_block_tokens=prefill_block_tokens,
                             per_layer_tokens=list(per_layer_tokens or []))


# Every budget of the client is what is kept (never what is evicted): tokens per layer here,
# the fraction of the prompt in kvsidecar.hf. 0 keeps nothing and is refused everywhere; None
# (unset) means the default: no budget for a new sequence (unless an operator set a default
# budget), the sequence's own budget for compress and score.
NO_ZERO_BUDGET = ("keeps no token: a budget is what is kept (tokens per layer >= 1; kvpress's "
                  "compression_ratio is the share evicted, 1 - kept / prompt)")


def _budget(value: BudgetLike) -> Optional[common_pb2.Budget]:
    if value is None:
        return None
    if isinstance(value, (float, np.floating)):
        raise InvalidArgument(
            f"budget={value!r}: create_sequence takes tokens per layer; a fraction of the prompt "
            "kept is SidecarCache's (kvsidecar.hf), or ceil(fraction * prompt tokens)")
    if isinstance(value, (int, np.integer)):
        if int(value) == 0:
            raise InvalidArgument(f"budget=0 {NO_ZERO_BUDGET}; None: no budget (the server's "
                                  "default budget, unbounded unless an operator set one)")
        return budget(int(value))
    return value


def _budget_tokens(value: Optional[int]) -> int:
    """budget_tokens of Compress / Score on the wire: None = 0 = the sequence's budget."""
    if value is None:
        return 0
    if int(value) == 0:
        raise InvalidArgument(f"budget_tokens=0 {NO_ZERO_BUDGET}; None: the sequence's budget")
    return int(value)


# Policies whose kept set does not depend on the prompt's queries: a prefix compressed with them
# may be published without a query window (sidecar.proto PublishRequest says why).
QUERY_AGNOSTIC_POLICIES = ("streaming_llm", "keydiff")


def prefix_key(token_ids: Union[Sequence[int], np.ndarray], layout: common_pb2.ModelLayout,
               policy: PolicyLike, budget: BudgetLike,
               query_window: Optional[int] = None) -> str:
    """The content key of a compressed prefix, for :meth:`Session.publish` and
    ``create_sequence(from_prefix=...)``: sha256 (64 lowercase hex digits) over the token ids,
    the model layout, the policy with its parameters, the budget and the query window (a
    query-aware policy publishes only with one). Two workers that compute the same key from the
    same prompt prefix and configuration share one stored copy; any difference gives another
    key. Protobuf fields are hashed in their deterministic serialization."""
    digest = hashlib.sha256(b"kvsidecar-prefix-v1\0")

    def part(data: bytes) -> None:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise InvalidArgument(f"token_ids must be one-dimensional, got shape {ids.shape}")
    part(ids.astype("<i8").tobytes())
    part(layout.SerializeToString(deterministic=True))
    spec, bud = _policy(policy), _budget(budget)
    part(b"" if spec is None else spec.SerializeToString(deterministic=True))
    part(b"" if bud is None else bud.SerializeToString(deterministic=True))
    if query_window is not None and query_window < 0:
        raise InvalidArgument(f"query_window must be >= 0, got {query_window}")
    part(str(query_window or 0).encode())
    return digest.hexdigest()


def attention(queries: np.ndarray, query_positions: Optional[Sequence[int]] = None,
              softmax_scale: Optional[float] = None, layers: Optional[Sequence[int]] = None,
              bf16: bool = False) -> common_pb2.AttentionInputs:
    """``AttentionInputs`` carrying post-RoPE queries inline.

    Args:
        queries: ``[layers][Hq][num_queries][D]``; float32 or float16 (sent as such), or uint16
            bfloat16 bit patterns (sent as bf16). With ``bf16=True`` float input is converted.
        query_positions: absolute positions of the queries (size num_queries); None = let the
            server infer them where it can (decode steps).
        softmax_scale: default ``1 / sqrt(D)``.
        layers: the layers the queries belong to; None = all, in order.
    """
    q = np.asarray(queries)
    if q.ndim != 4:
        raise InvalidArgument(f"queries must be [layers][Hq][num_queries][D], got shape {q.shape}")
    if bf16 and q.dtype != np.uint16:
        q = to_storage(q, common_pb2.DTYPE_BFLOAT16)
    if q.dtype == np.float32:
        qdtype = common_pb2.DTYPE_FLOAT32
    elif q.dtype == np.float16:
        qdtype = common_pb2.DTYPE_FLOAT16
    elif q.dtype == np.uint16:
        qdtype = common_pb2.DTYPE_BFLOAT16
    else:
        q = q.astype(np.float32)
        qdtype = common_pb2.DTYPE_FLOAT32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    return common_pb2.AttentionInputs(
        layers=list(layers or []), num_queries=q.shape[2],
        query_positions=list(query_positions or []), softmax_scale=scale, queries_dtype=qdtype,
        inline_queries=np.ascontiguousarray(q).astype(q.dtype.newbyteorder("<")).tobytes())


def staged_attention(offset: int, num_queries: int,
                     query_positions: Optional[Sequence[int]] = None,
                     softmax_scale: Optional[float] = None, head_dim: Optional[int] = None,
                     layers: Optional[Sequence[int]] = None) -> common_pb2.AttentionInputs:
    """``AttentionInputs`` naming fp32 queries ``[layers][Hq][num_queries][D]`` the worker wrote at
    byte ``offset`` of its session's query staging area (``attach(staging_bytes=...)``; write them
    through ``arena.staging``): the request then carries no query bytes.

    ``softmax_scale`` defaults to ``1 / sqrt(head_dim)``; give one of the two.
    """
    if softmax_scale is None:
        if not head_dim:
            raise InvalidArgument("staged_attention needs softmax_scale or head_dim")
        softmax_scale = 1.0 / math.sqrt(head_dim)
    return common_pb2.AttentionInputs(
        layers=list(layers or []), num_queries=num_queries,
        query_positions=list(query_positions or []), softmax_scale=softmax_scale,
        queries_dtype=common_pb2.DTYPE_FLOAT32, staging_offset=offset)


# --- Value types --------------------------------------------------------------------------------


@dataclass
class ReserveItem:
    """One item of :meth:`Session.batch_reserve`."""
    sequence_id: str
    num_tokens: int
    positions: Optional[Sequence[int]] = None  # None = continue from the next position
    layers: Optional[Sequence[int]] = None     # None = all layers


@dataclass
class AppendSegment:
    """One segment of an inline append: ``kv`` is ``[layers][2][H][num_tokens][D]`` (any float
    dtype, converted to the session dtype; bf16 may be given as uint16 bit patterns) or raw
    little-endian bytes in the session dtype."""
    sequence_id: str
    kv: Union[np.ndarray, bytes]
    num_tokens: Optional[int] = None           # required when kv is bytes
    positions: Optional[Sequence[int]] = None
    layers: Optional[Sequence[int]] = None
    compress_if_over_budget: bool = False


@dataclass
class DecodeItem:
    """One item of :meth:`Session.decode_step`: the new token of ``sequence_id``.

    Give its K/V either as a pending one-token ``reservation`` (committed first) or as
    ``inline_kv`` ``[L][2][H][1][D]``, or neither if it was already committed. ``attention`` is
    the token's query for every layer (see :func:`attention`). ``return_layout``: the response
    item also carries the sequence's layout after the step (``layers``: counts and block tables,
    as :meth:`Session.get_layout` with ``omit_positions``), saving a GetLayout before the next
    step reads the held K/V."""
    sequence_id: str
    attention: Optional[common_pb2.AttentionInputs] = None
    reservation: Optional["Reservation"] = None
    inline_kv: Union[None, np.ndarray, bytes] = None
    return_layout: bool = False


@dataclass
class LayerKV:
    """One layer of a sequence read back: ``k``, ``v`` ``[H][count][D]`` in the storage dtype,
    ``positions`` ``[H][count]`` (None when the layout omitted them)."""
    layer: int
    k: np.ndarray
    v: np.ndarray
    positions: Optional[np.ndarray]

    @property
    def count(self) -> int:
        return int(self.k.shape[1])


class CallFuture:
    """A unary call in flight (:meth:`Session.decode_step_future`,
    :meth:`Session.get_layout_future`): ``result()`` waits for the response and returns it, or
    raises the call's :class:`KvsError`; ``done()`` does not wait."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def done(self) -> bool:
        return bool(self._future.done())

    def add_done_callback(self, fn: Any) -> None:
        """Calls ``fn(self)`` when the call completes (on a gRPC thread), or now if it has."""
        self._future.add_done_callback(lambda _: fn(self))

    def result(self, timeout: Optional[float] = None) -> Any:
        try:
            return self._future.result(timeout=timeout)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None


class Reservation:
    """A pending reservation: where its tokens go in the mapped arena. Write K/V with
    :meth:`write` (or :meth:`Session.write_reserved`), then :meth:`Session.commit` it."""

    def __init__(self, session: "Session", sequence_id: str,
                 response: sidecar_pb2.ReserveResponse) -> None:
        self.session = session
        self.sequence_id = sequence_id
        self.response = response
        self._layers = {slots.layer: slots for slots in response.layers}

    @property
    def id(self) -> int:
        return self.response.reservation_id

    @property
    def num_tokens(self) -> int:
        return len(self.response.positions)

    @property
    def positions(self) -> np.ndarray:
        """Positions the reserved tokens get (int32, size num_tokens)."""
        return np.asarray(self.response.positions, dtype=np.int32)

    @property
    def layers(self) -> List[int]:
        return list(self._layers)

    def slots(self, layer: int) -> sidecar_pb2.LayerSlots:
        try:
            return self._layers[layer]
        except KeyError:
            raise InvalidArgument(
                f"layer {layer} is not part of reservation {self.id} (layers {self.layers})"
            ) from None

    def views(self, layer: int) -> List[Tuple[int, np.ndarray, np.ndarray]]:
        """Zero-copy views of the reserved slots of ``layer``: a list of ``(first_token, K, V)``
        with K, V ``[H][n][D]`` arrays over the arena (one entry per block touched); token
        ``first_token + j`` of the reservation is ``K[:, j]``. Write into them in place."""
        arena = self.session.arena
        slots = self.slots(layer)
        B = arena.block_tokens
        first = slots.first_slot
        out = []
        i, T = 0, self.num_tokens
        while i < T:
            s = first + i
            index = s // B - first // B
            if index >= len(slots.blocks):
                raise OutOfRange(f"reservation {self.id} layer {layer}: token {i} has no block")
            blk = arena.block(slots.blocks[index])
            ib = s % B
            n = min(B - ib, T - i)
            out.append((i, blk[0, :, ib:ib + n, :], blk[1, :, ib:ib + n, :]))
            i += n
        return out

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Writes K and V ``[H][num_tokens][D]`` of ``layer`` into the reserved slots (see
        :meth:`Session.write_reserved`)."""
        self.session.write_reserved(self, layer, k, v)


@dataclass
class ExportResult:
    """An exported sequence: the header (layout, per-layer counts and positions) and the payload
    ``[layer][2][H][count][D]`` in the session dtype, layers in header order."""
    header: sidecar_pb2.ExportHeader
    payload: bytes
    _offsets: Dict[int, Tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        lay = self.header.layout
        row = lay.head_dim * dtype_bytes(lay.dtype)
        offset = 0
        for entry in self.header.layers:
            size = 2 * lay.num_kv_heads * entry.count * row
            self._offsets[entry.layer] = (offset, entry.count)
            offset += size
        if offset != len(self.payload):
            raise InvalidArgument(
                f"export payload has {len(self.payload)} bytes, header implies {offset}")

    def layer(self, layer: int) -> LayerKV:
        """K, V ``[H][count][D]`` and positions ``[H][count]`` of model layer ``layer``
        (views of the payload, storage dtype)."""
        if layer not in self._offsets:
            raise OutOfRange(f"layer {layer} was not exported")
        offset, count = self._offsets[layer]
        lay = self.header.layout
        H, D = lay.num_kv_heads, lay.head_dim
        arr = np.frombuffer(self.payload, dtype=storage_dtype(lay.dtype),
                            count=2 * H * count * D, offset=offset).reshape(2, H, count, D)
        entry = next(e for e in self.header.layers if e.layer == layer)
        pos = np.asarray(entry.positions, dtype=np.int32)
        return LayerKV(layer, arr[0], arr[1], pos.reshape(H, count) if pos.size else None)


# --- Client and Session -------------------------------------------------------------------------


class Client:
    """A connection to a kvsidecar data plane.

    Args:
        address: ``host:port`` of the data plane.
        timeout: deadline in seconds of each unary call and of each Append/Export stream
            (None = none).
        connect_timeout: the constructor waits this long for the channel to be ready (0 = lazy);
            :class:`kvsidecar.errors.Unavailable` if it is not.
        credentials: channel credentials; None = insecure (loopback / same pod). TLS and mutual
            TLS: :func:`kvsidecar.tls_credentials` (CA bundle, client certificate and key).
        token: the tenant's bearer token, when the sidecar runs with --tenant_tokens_file (sent
            as ``authorization: Bearer <token>`` on every call and stream).
        server_name: the name the sidecar's TLS certificate carries, when it is not the host of
            ``address`` (e.g. dialing an IP with a certificate for a DNS name).
        worker_name: default worker name shown in Admin ListSessions.
        channel_options: extra gRPC channel options.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = 60.0,
                 connect_timeout: float = 10.0,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 token: Optional[str] = None, server_name: Optional[str] = None,
                 worker_name: str = "",
                 channel_options: Sequence[Tuple[str, Any]] = ()) -> None:
        self.address = address
        self.timeout = timeout
        self.worker_name = worker_name
        channel, self._channel = _rpc.make_channel(address, credentials, channel_options, token,
                                                   server_name)
        self.stub = sidecar_pb2_grpc.SidecarStub(channel)
        try:
            _rpc.wait_ready(self._channel, address, connect_timeout)
        except KvsError:
            self._channel.close()
            raise

    def close(self) -> None:
        """Closes the channel (sessions attached through it stop working)."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def attach(self, layout: common_pb2.ModelLayout, *, tenant: str = "",
               worker_name: Optional[str] = None, num_blocks: int = 0, lease_ms: int = 0,
               staging_bytes: int = 0, watch: bool = True, heartbeat: bool = True) -> "Session":
        """Attaches a worker: a new session with its own arena, mapped here.

        Use it as a context manager (``with client.attach(...) as session:``); leaving the block
        detaches. ``layout`` is a ``ModelLayout`` (see :func:`model_layout`). ``num_blocks`` and
        ``lease_ms`` 0 = server defaults. ``watch`` holds the Watch stream (reclaim at once if
        this process dies); ``heartbeat`` renews the lease in a background thread.
        """
        request = sidecar_pb2.AttachRequest(
            layout=layout, tenant=tenant,
            worker_name=self.worker_name if worker_name is None else worker_name,
            num_blocks=num_blocks, lease_ms=lease_ms, staging_bytes=staging_bytes)
        response = _rpc.call(self.stub.Attach, request, self.timeout)
        try:
            return Session(self, response, watch=watch, heartbeat=heartbeat)
        except BaseException:
            try:
                _rpc.call(self.stub.Detach,
                          sidecar_pb2.DetachRequest(session_id=response.session_id), self.timeout)
            except KvsError:
                pass
            raise


class Session:
    """One attached session (see :meth:`Client.attach`). Context manager: detaches on exit."""

    def __init__(self, client: Client, response: sidecar_pb2.AttachResponse, *, watch: bool,
                 heartbeat: bool) -> None:
        self.client = client
        self.stub = client.stub
        self.timeout = client.timeout
        self.attach_response = response
        self.session_id: str = response.session_id
        self.layout: common_pb2.ModelLayout = response.layout
        self.lease_ms: int = response.lease_ms
        self.backend: str = response.backend
        self._arena: Optional[Union[Arena, CudaArena]] = None
        self._arena_error: Optional[BaseException] = None
        if response.arena.kind == common_pb2.ArenaHandle.KIND_CUDA_IPC:
            # A CUDA arena this process cannot map (no CUDA runtime, no device with the arena's
            # UUID, a stale or foreign handle) leaves the session usable through the inline
            # append/export calls; the reason is raised when the arena is used.
            try:
                self._arena = open_arena(response.arena, response.layout, response.session_id)
            except KvsError as error:
                self._arena_error = error
        else:
            self._arena = Arena(response.arena, response.layout, response.session_id)
        self._lock = threading.Lock()
        self._detached = False
        self._stop = threading.Event()
        self._health: Optional[KvsError] = None
        self._watching = threading.Event()
        self._draining = threading.Event()
        self._watch_call: Any = None
        self._threads: List[threading.Thread] = []
        if watch:
            self._watch_call = self.stub.Watch(
                sidecar_pb2.WatchRequest(session_id=self.session_id))
            self._start_thread(self._watch_loop, "kvsidecar-watch")
        if heartbeat and self.lease_ms > 0:
            self._start_thread(self._heartbeat_loop, "kvsidecar-heartbeat")

    # -- lifecycle --

    def _start_thread(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch_loop(self) -> None:
        try:
            for event in self._watch_call:
                if event.kind == sidecar_pb2.SessionEvent.KIND_WATCHING:
                    self._watching.set()
                elif event.kind == sidecar_pb2.SessionEvent.KIND_DRAINING:
                    self._draining.set()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED and not self._stop.is_set():
                self._health = error_from_rpc(error)

    def _heartbeat_loop(self) -> None:
        period = max(self.lease_ms / 3000.0, 0.01)
        while not self._stop.wait(period):
            try:
                self.heartbeat()
            except KvsError as error:
                if not self._stop.is_set():
                    self._health = error
                if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
                    return  # the session is gone on the server; renewing cannot bring it back

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._detached:
            return
        try:
            self.detach()
        except KvsError:
            # The block's own exception says more than a failed detach (e.g. the session was
            # already reclaimed); without one, the detach error is raised.
            if exc_type is None:
                raise

    @property
    def arena(self) -> Union[Arena, CudaArena]:
        """The mapped arena: :class:`Arena` (CPU backend) or :class:`CudaArena` (CUDA backend).
        For a CUDA arena this process could not map, the error that prevented it
        (``FailedPrecondition``: no CUDA runtime or device, a device UUID no local GPU has)."""
        if self._arena_error is not None:
            raise self._arena_error
        if self._arena is None:
            raise InvalidArgument("the session is detached; its arena is unmapped")
        return self._arena

    @property
    def detached(self) -> bool:
        return self._detached

    def watching(self, timeout: Optional[float] = None) -> bool:
        """True once the server bound the session to this process's Watch stream."""
        return self._watching.wait(timeout)

    @property
    def draining(self) -> bool:
        """True after the server announced it is draining."""
        return self._draining.is_set()

    @property
    def health(self) -> Optional[KvsError]:
        """None while the session looks alive; else the last heartbeat error or why the Watch
        stream ended."""
        return self._health

    def detach(self) -> sidecar_pb2.DetachResponse:
        """Ends the session on the server (releasing its sequences and arena), stops the
        heartbeat and the Watch stream, unmaps the arena. A second call raises
        FailedPrecondition."""
        with self._lock:
            if self._detached:
                from kvsidecar.errors import FailedPrecondition
                raise FailedPrecondition(f"session {self.session_id} is already detached")
            self._detached = True
        self._stop.set()
        try:
            return _rpc.call(self.stub.Detach,
                             sidecar_pb2.DetachRequest(session_id=self.session_id), self.timeout)
        finally:
            if self._watch_call is not None:
                self._watch_call.cancel()
            for thread in self._threads:
                thread.join(timeout=5)
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    def heartbeat(self) -> sidecar_pb2.HeartbeatResponse:
        """Renews the lease now (the background thread does it every lease/3)."""
        return self._call(self.stub.Heartbeat,
                          sidecar_pb2.HeartbeatRequest(session_id=self.session_id))

    def _call(self, method: Callable[..., _rpc._Response], request: Any) -> _rpc._Response:
        return _rpc.call(method, request, self.timeout)

    # -- sequences --

    def create_sequence(self, policy: PolicyLike = None, budget: BudgetLike = None,
                        sequence_id: str = "",
                        retain_evicted: bool = False,
                        layer_windows: Optional[Sequence[int]] = None,
                        from_prefix: str = "") -> sidecar_pb2.CreateSequenceResponse:
        """Creates a sequence. ``policy``: a ``PolicySpec`` or a policy name (None = the server
        default); ``budget``: a ``Budget`` or tokens per layer kept (>= 1; None = the server's
        default budget, unbounded unless an operator set one; 0 is refused);
        ``sequence_id`` empty = server-generated (read it from the response);
        ``layer_windows``: per layer, the sliding window W that layer keeps (its last W tokens,
        whatever the policy), 0 = a global layer; None = no windows. ``from_prefix``:
        start from the prefix this tenant published under that key (:meth:`publish`) instead
        of empty, skipping its prefill: K/V, positions, windows and policy state as published
        (policy and budget, if given, must equal the published ones)."""
        request = sidecar_pb2.CreateSequenceRequest(
            session_id=self.session_id, sequence_id=sequence_id, retain_evicted=retain_evicted,
            layer_windows=list(layer_windows or ()), from_prefix=from_prefix)
        spec, bud = _policy(policy), _budget(budget)
        if spec is not None:
            request.policy.CopyFrom(spec)
        if bud is not None:
            request.budget.CopyFrom(bud)
        return self._call(self.stub.CreateSequence, request)

    def release_sequence(self, sequence_id: str) -> sidecar_pb2.ReleaseSequenceResponse:
        """Releases a sequence and its blocks."""
        return self._call(self.stub.ReleaseSequence, sidecar_pb2.ReleaseSequenceRequest(
            session_id=self.session_id, sequence_id=sequence_id))

    # -- zero-copy writes --

    def _reserve_request(self, sequence_id: str, num_tokens: int,
                         positions: Optional[Sequence[int]],
                         layers: Optional[Sequence[int]]) -> sidecar_pb2.ReserveRequest:
        return sidecar_pb2.ReserveRequest(
            session_id=self.session_id, sequence_id=sequence_id, num_tokens=num_tokens,
            positions=[int(p) for p in (positions if positions is not None else [])],
            layers=[int(l) for l in (layers if layers is not None else [])])

    def reserve(self, sequence_id: str, num_tokens: int,
                positions: Optional[Sequence[int]] = None,
                layers: Optional[Sequence[int]] = None) -> Reservation:
        """Reserves slots for ``num_tokens`` new tokens (in ``layers``, None = all). Write their
        K/V with :meth:`write_reserved`, then :meth:`commit`."""
        response = self._call(self.stub.Reserve,
                              self._reserve_request(sequence_id, num_tokens, positions, layers))
        return Reservation(self, sequence_id, response)

    def write_reserved(self, reservation: Reservation, layer: int, k: np.ndarray,
                       v: np.ndarray) -> None:
        """Writes K and V of ``layer`` into the reserved slots, straight into the arena.

        ``k``, ``v``: ``[H][num_tokens][D]``; float arrays are converted to the session dtype
        (bf16 may be given as uint16 bit patterns, written as-is).
        """
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        T = reservation.num_tokens
        arrays = []
        for name, value in (("k", k), ("v", v)):
            arr = np.asarray(value)
            if arr.shape != (H, T, D):
                raise InvalidArgument(
                    f"{name} must have shape [H][num_tokens][D] = {(H, T, D)}, got {arr.shape}")
            arrays.append(to_storage(arr, self.layout.dtype))
        arena = self.arena
        if isinstance(arena, CudaArena):
            # Device memory: one cudaMemcpy per (block, kv, head) run of reserved slots.
            slots = reservation.slots(layer)
            B, first_slot, i = arena.block_tokens, slots.first_slot, 0
            while i < T:
                s = first_slot + i
                index = s // B - first_slot // B
                if index >= len(slots.blocks):
                    raise OutOfRange(f"reservation {reservation.id} layer {layer}: token {i} has "
                                     "no block")
                n = min(B - s % B, T - i)
                for kv in (0, 1):
                    for head in range(H):
                        arena.write_rows(slots.blocks[index], kv, head, s % B,
                                         arrays[kv][head, i:i + n, :])
                i += n
            return
        for first, kview, vview in reservation.views(layer):
            n = kview.shape[1]
            kview[...] = arrays[0][:, first:first + n, :]
            vview[...] = arrays[1][:, first:first + n, :]

    def commit(self, reservation: Reservation, compress_if_over_budget: bool = False,
               attention: Optional[common_pb2.AttentionInputs] = None
               ) -> sidecar_pb2.CommitResponse:
        """Commits a reservation (its slots now hold what was written)."""
        return self._call(self.stub.Commit,
                          self._commit_request(reservation, compress_if_over_budget, attention))

    def _commit_request(self, reservation: Reservation, compress_if_over_budget: bool,
                        attention: Optional[common_pb2.AttentionInputs]
                        ) -> sidecar_pb2.CommitRequest:
        request = sidecar_pb2.CommitRequest(
            session_id=self.session_id, sequence_id=reservation.sequence_id,
            reservation_id=reservation.id, compress_if_over_budget=compress_if_over_budget)
        if attention is not None:
            request.attention.CopyFrom(attention)
        return request

    def cancel_reservation(self, reservation: Reservation) -> None:
        """Drops a pending reservation without committing it."""
        self._call(self.stub.CancelReservation, sidecar_pb2.CancelReservationRequest(
            session_id=self.session_id, sequence_id=reservation.sequence_id,
            reservation_id=reservation.id))

    def batch_reserve(self, items: Iterable[Union[ReserveItem, Tuple[str, int]]]
                      ) -> List[Reservation]:
        """Reserves for many sequences in one RPC; all or nothing (the error names the index of
        the first bad item). Items: :class:`ReserveItem` or ``(sequence_id, num_tokens)``."""
        normalized = [item if isinstance(item, ReserveItem) else ReserveItem(*item)
                      for item in items]
        request = sidecar_pb2.BatchReserveRequest(requests=[
            self._reserve_request(i.sequence_id, i.num_tokens, i.positions, i.layers)
            for i in normalized])
        response = self._call(self.stub.BatchReserve, request)
        return [Reservation(self, item.sequence_id, r)
                for item, r in zip(normalized, response.responses)]

    def batch_commit(self, reservations: Sequence[Reservation],
                     compress_if_over_budget: bool = False,
                     attention: Optional[Sequence[Optional[common_pb2.AttentionInputs]]] = None
                     ) -> sidecar_pb2.BatchCommitResponse:
        """Commits many reservations in one RPC (``attention``: one entry per reservation)."""
        attn = list(attention) if attention is not None else [None] * len(reservations)
        if len(attn) != len(reservations):
            raise InvalidArgument("attention must have one entry per reservation")
        request = sidecar_pb2.BatchCommitRequest(requests=[
            self._commit_request(r, compress_if_over_budget, a)
            for r, a in zip(reservations, attn)])
        return self._call(self.stub.BatchCommit, request)

    # -- inline writes and reads --

    def _segment_chunks(self, segment: AppendSegment,
                        chunk_bytes: int) -> Iterator[sidecar_pb2.AppendChunk]:
        layers = list(segment.layers) if segment.layers is not None else []
        num_layers = len(layers) if layers else self.layout.num_layers
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        if isinstance(segment.kv, (bytes, bytearray, memoryview)):
            if segment.num_tokens is None:
                raise InvalidArgument("num_tokens is required when kv is bytes")
            payload = bytes(segment.kv)
            num_tokens = segment.num_tokens
        else:
            arr = np.asarray(segment.kv)
            if arr.ndim != 5 or arr.shape[0] != num_layers or arr.shape[1] != 2 or \
                    arr.shape[2] != H or arr.shape[4] != D:
                raise InvalidArgument(
                    f"kv must be [layers][2][H][tokens][D] = [{num_layers}][2][{H}][T][{D}], "
                    f"got {arr.shape}")
            num_tokens = arr.shape[3] if segment.num_tokens is None else segment.num_tokens
            payload = np.ascontiguousarray(to_storage(arr, self.layout.dtype)).tobytes()
        header = sidecar_pb2.AppendHeader(
            session_id=self.session_id, sequence_id=segment.sequence_id, num_tokens=num_tokens,
            positions=[int(p) for p in (segment.positions or [])], layers=layers,
            payload_bytes=len(payload), compress_if_over_budget=segment.compress_if_over_budget)
        yield sidecar_pb2.AppendChunk(header=header)
        view = memoryview(payload)
        for start in range(0, len(payload), chunk_bytes):
            yield sidecar_pb2.AppendChunk(data=bytes(view[start:start + chunk_bytes]))

    def append(self, sequence_id: str, kv: Union[np.ndarray, bytes], *,
               num_tokens: Optional[int] = None, positions: Optional[Sequence[int]] = None,
               layers: Optional[Sequence[int]] = None, compress_if_over_budget: bool = False,
               chunk_bytes: int = 1 << 20) -> sidecar_pb2.AppendResponse:
        """Appends tokens inline (a client stream): ``kv`` is ``[layers][2][H][T][D]`` (see
        :class:`AppendSegment`). Committed when the last byte arrives."""
        return self.batch_append([AppendSegment(sequence_id, kv, num_tokens, positions, layers,
                                                compress_if_over_budget)], chunk_bytes)

    def batch_append(self, segments: Sequence[AppendSegment],
                     chunk_bytes: int = 1 << 20) -> sidecar_pb2.AppendResponse:
        """Appends several segments (sequences) in one stream; segments before a failing one
        stay committed."""
        if chunk_bytes <= 0:
            raise InvalidArgument(f"chunk_bytes must be > 0, got {chunk_bytes}")
        # Build every segment up front so local errors are raised before anything is sent.
        chunks = [c for segment in segments for c in self._segment_chunks(segment, chunk_bytes)]
        try:
            return self.stub.Append(iter(chunks), timeout=self.timeout)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    def export(self, sequence_id: str, layers: Optional[Sequence[int]] = None,
               chunk_bytes: int = 0) -> ExportResult:
        """Reads a sequence inline (a server stream): header + payload, see
        :class:`ExportResult`."""
        request = sidecar_pb2.ExportRequest(session_id=self.session_id, sequence_id=sequence_id,
                                            layers=list(layers or []), chunk_bytes=chunk_bytes)
        header = None
        parts: List[bytes] = []
        try:
            for chunk in self.stub.Export(request, timeout=self.timeout):
                if chunk.HasField("header"):
                    if header is not None:
                        raise InvalidArgument("export stream carried two headers")
                    header = chunk.header
                else:
                    parts.append(chunk.data)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        if header is None:
            raise InvalidArgument("export stream ended without a header")
        return ExportResult(header, b"".join(parts))

    # -- layout, in-place reads, compression --

    def get_layout(self, sequence_id: str, layers: Optional[Sequence[int]] = None,
                   omit_positions: bool = False) -> sidecar_pb2.GetLayoutResponse:
        """Per-layer counts, block tables and positions of a sequence."""
        return self._call(self.stub.GetLayout,
                          self._layout_request(sequence_id, layers, omit_positions))

    def get_layout_future(self, sequence_id: str, layers: Optional[Sequence[int]] = None,
                          omit_positions: bool = False) -> "CallFuture":
        """:meth:`get_layout` without waiting: ``result()`` of the returned future waits for the
        response (or raises the KvsError). The layouts of a batch's sequences can be asked for
        together instead of one round trip after another."""
        return CallFuture(self.stub.GetLayout.future(
            self._layout_request(sequence_id, layers, omit_positions), timeout=self.timeout))

    def _layout_request(self, sequence_id: str, layers: Optional[Sequence[int]],
                        omit_positions: bool) -> sidecar_pb2.GetLayoutRequest:
        return sidecar_pb2.GetLayoutRequest(
            session_id=self.session_id, sequence_id=sequence_id, layers=list(layers or []),
            omit_positions=omit_positions)

    @staticmethod
    def _layer_entry(layout: Union[sidecar_pb2.GetLayoutResponse, common_pb2.LayerLayout],
                     layer: Optional[int]) -> common_pb2.LayerLayout:
        if isinstance(layout, common_pb2.LayerLayout):
            return layout
        for entry in layout.layers:
            if entry.layer == layer:
                return entry
        raise OutOfRange(f"layer {layer} is not in the layout")

    def layer_blocks(self, layout: Union[sidecar_pb2.GetLayoutResponse, common_pb2.LayerLayout],
                     layer: Optional[int] = None) -> List[Tuple[np.ndarray, int]]:
        """Zero-copy views of the blocks of one layer, in slot order: a list of
        ``(block [2][H][B][D], valid_tokens)``; slot ``i * B + j`` is ``block[:, :, j]`` of entry
        i. Valid until the sequence next changes (commit, compress, release). On a CUDA arena
        the blocks are torch tensors over the device memory (needs torch with CUDA)."""
        entry = self._layer_entry(layout, layer)
        arena = self.arena
        B = arena.block_tokens
        nb = -(-entry.count // B)
        if len(entry.block_table) < nb:
            raise OutOfRange(f"layer {entry.layer}: {len(entry.block_table)} blocks for "
                             f"{entry.count} tokens")
        return [(arena.block(entry.block_table[i]), min(B, entry.count - i * B))
                for i in range(nb)]

    def read_layer(self, layout: Union[sidecar_pb2.GetLayoutResponse, common_pb2.LayerLayout],
                   layer: Optional[int] = None) -> LayerKV:
        """K, V ``[H][count][D]`` (storage dtype) and positions ``[H][count]`` of one layer,
        gathered from the mapped arena through the block table of ``layout`` (from
        :meth:`get_layout`): no RPC, one copy out of shared memory. Use :meth:`layer_blocks` for
        the block views themselves."""
        entry = self._layer_entry(layout, layer)
        arena = self.arena
        H, B, D = arena.num_kv_heads, arena.block_tokens, arena.head_dim
        count = entry.count
        nb = -(-count // B)
        table = np.asarray(entry.block_table[:nb], dtype=np.int64)
        if len(table) < nb:
            raise OutOfRange(f"layer {entry.layer}: {len(table)} blocks for {count} tokens")
        if table.size and (table.min() < 0 or table.max() >= arena.num_blocks):
            raise OutOfRange(f"layer {entry.layer}: block table outside the arena")
        if isinstance(arena, CudaArena):
            blocks = arena.read_blocks(table)  # one cudaMemcpy per block, to the host
        else:
            blocks = arena.blocks[table]  # [nb][2][H][B][D]
        kv = blocks.transpose(1, 2, 0, 3, 4).reshape(2, H, nb * B, D)[:, :, :count, :]
        pos = np.asarray(entry.positions, dtype=np.int32)
        return LayerKV(entry.layer, np.ascontiguousarray(kv[0]), np.ascontiguousarray(kv[1]),
                       pos.reshape(H, count) if pos.size else None)

    def read_sequence(self, sequence_id: str) -> List[LayerKV]:
        """Every layer of a sequence read in place (one GetLayout + :meth:`read_layer`)."""
        layout = self.get_layout(sequence_id)
        return [self.read_layer(entry) for entry in layout.layers]

    def _compress_request(self, sequence_id: str, budget_tokens: Optional[int],
                          policy: PolicyLike,
                          attention: Optional[common_pb2.AttentionInputs],
                          return_positions: bool) -> sidecar_pb2.CompressRequest:
        request = sidecar_pb2.CompressRequest(
            session_id=self.session_id, sequence_id=sequence_id,
            budget_tokens=_budget_tokens(budget_tokens), return_positions=return_positions)
        spec = _policy(policy)
        if spec is not None:
            request.policy.CopyFrom(spec)
        if attention is not None:
            request.attention.CopyFrom(attention)
        return request

    def compress(self, sequence_id: str, budget_tokens: Optional[int] = None,
                 policy: PolicyLike = None,
                 attention: Optional[common_pb2.AttentionInputs] = None,
                 return_positions: bool = False) -> sidecar_pb2.CompressResponse:
        """Brings a sequence inside its budget (or ``budget_tokens`` tokens per layer, >= 1;
        None: the sequence's) with its policy (or ``policy``), compacting in place. Read it back with :meth:`get_layout`."""
        return self._call(self.stub.Compress, self._compress_request(
            sequence_id, budget_tokens, policy, attention, return_positions))

    def batch_compress(self, requests: Sequence[Union[str, sidecar_pb2.CompressRequest,
                                                      Dict[str, Any]]]
                       ) -> sidecar_pb2.BatchCompressResponse:
        """Compresses many sequences in one RPC. Items: a sequence id, a ``CompressRequest``
        (session_id filled in) or a dict of :meth:`compress` keyword arguments with
        ``sequence_id``."""
        built = []
        for item in requests:
            if isinstance(item, str):
                built.append(self._compress_request(item, None, None, None, False))
            elif isinstance(item, dict):
                args = dict(item)
                built.append(self._compress_request(
                    args.pop("sequence_id"), args.pop("budget_tokens", None),
                    args.pop("policy", None), args.pop("attention", None),
                    args.pop("return_positions", False)))
                if args:
                    raise InvalidArgument(f"unknown compress arguments {sorted(args)}")
            else:
                request = sidecar_pb2.CompressRequest()
                request.CopyFrom(item)
                if not request.session_id:
                    request.session_id = self.session_id
                built.append(request)
        return self._call(self.stub.BatchCompress,
                          sidecar_pb2.BatchCompressRequest(requests=built))

    def decode_step(self, items: Sequence[DecodeItem]) -> sidecar_pb2.DecodeStepResponse:
        """One decode step for many sequences: commits/appends each new token, folds its query
        into the policy state and evicts every layer back to its budget."""
        return self._call(self.stub.DecodeStep, self._decode_step_request(items))

    def decode_step_future(self, items: Sequence[DecodeItem]) -> "CallFuture":
        """:meth:`decode_step` without waiting: the request is sent now, ``result()`` of the
        returned future waits for the response (or raises the KvsError). Lets a worker compute
        (e.g. its logits) while the sidecar runs the step."""
        return CallFuture(self.stub.DecodeStep.future(self._decode_step_request(items),
                                                      timeout=self.timeout))

    def _decode_step_request(self, items: Sequence[DecodeItem]) -> sidecar_pb2.DecodeStepRequest:
        request = sidecar_pb2.DecodeStepRequest()
        for item in items:
            out = request.items.add(session_id=self.session_id, sequence_id=item.sequence_id,
                                    return_layout=item.return_layout)
            if item.attention is not None:
                out.attention.CopyFrom(item.attention)
            if item.reservation is not None:
                out.reservation_id = item.reservation.id
            if item.inline_kv is not None:
                if isinstance(item.inline_kv, (bytes, bytearray)):
                    out.inline_kv = bytes(item.inline_kv)
                else:
                    out.inline_kv = np.ascontiguousarray(
                        to_storage(item.inline_kv, self.layout.dtype)).tobytes()
        return request

    def score(self, sequence_id: str, budget_tokens: Optional[int] = None,
              policy: PolicyLike = None,
              attention: Optional[common_pb2.AttentionInputs] = None,
              layers: Optional[Sequence[int]] = None) -> sidecar_pb2.ScoreResponse:
        """Dry run: the scores and kept slots the policy would choose; changes nothing."""
        request = sidecar_pb2.ScoreRequest(session_id=self.session_id, sequence_id=sequence_id,
                                           budget_tokens=_budget_tokens(budget_tokens),
                                           layers=list(layers or []))
        spec = _policy(policy)
        if spec is not None:
            request.policy.CopyFrom(spec)
        if attention is not None:
            request.attention.CopyFrom(attention)
        return self._call(self.stub.Score, request)

    def select(self, sequence_id: str, step_id: int,
               attention: Optional[common_pb2.AttentionInputs] = None,
               prompt_tokens: int = 0) -> sidecar_pb2.SelectResponse:
        """OmniKV's selection for one decode step of an ``omnikv`` sequence: ``attention`` carries
        the listed filter layers' queries (:func:`attention` with ``layers=``). The response item
        gives, per filter layer, the selected prompt positions (ascending) and, per sparse layer, a
        ``LayerLayout`` of staging blocks holding those tokens followed by the layer's generated
        ones: read it with :meth:`read_layer`. ``prompt_tokens``: N, fixed by the first call
        (0 = the sequence's next position then). A retry with the same ``step_id`` returns the
        same selection."""
        item = sidecar_pb2.SelectRequest.Item(session_id=self.session_id,
                                              sequence_id=sequence_id, step_id=step_id,
                                              prompt_tokens=prompt_tokens)
        if attention is not None:
            item.attention.CopyFrom(attention)
        return self._call(self.stub.Select, sidecar_pb2.SelectRequest(items=[item]))

    def get_retained(self, sequence_id: str, layers: Optional[Sequence[int]] = None
                     ) -> sidecar_pb2.GetRetainedResponse:
        """The tokens a ``retain_evicted`` sequence evicted, per (layer, kv head) in eviction
        order: positions, selection scores, and K / V bytes ``[n][D]`` in the session dtype."""
        return self._call(self.stub.GetRetained, sidecar_pb2.GetRetainedRequest(
            session_id=self.session_id, sequence_id=sequence_id, layers=list(layers or [])))

    def spill(self, sequence_id: str, target: common_pb2.Tier.ValueType = common_pb2.TIER_HOST
              ) -> sidecar_pb2.SpillResponse:
        """Moves a sequence out of the arena to the host tier, disk or the remote tier on Redis
        (``Tier.TIER_HOST`` / ``TIER_DISK`` / ``TIER_REMOTE``); its blocks are freed. Any later
        data-plane call on it restores it."""
        return self._call(self.stub.Spill, sidecar_pb2.SpillRequest(
            session_id=self.session_id, sequence_id=sequence_id, target=target))

    def publish(self, sequence_id: str, key: str, query_window: Optional[int] = None,
                tier: common_pb2.Tier.ValueType = common_pb2.TIER_UNSPECIFIED
                ) -> sidecar_pb2.PublishResponse:
        """Stores a copy of the sequence's (compressed) cache under ``key`` (from
        :func:`prefix_key`) for this tenant: in the remote tier when the sidecar has one (every
        sidecar sharing it can use it), else on disk; ``tier`` names one (``TIER_HOST``,
        ``TIER_DISK``, ``TIER_REMOTE``). The sequence stays live. Query-aware
        policies (all but streaming_llm and keydiff) need ``query_window``, the trailing prefix
        tokens whose queries drove the compression, which must also be in the key."""
        return self._call(self.stub.Publish, sidecar_pb2.PublishRequest(
            session_id=self.session_id, sequence_id=sequence_id, prefix_key=key,
            query_window=query_window or 0, tier=tier))

    def lookup_prefixes(self, keys: Sequence[str]
                        ) -> Dict[int, sidecar_pb2.LookupPrefixesResponse.Found]:
        """Which of ``keys`` this tenant has published, without reading them: index into
        ``keys`` -> where the copy is (tier) and its bytes. Keys not found are absent."""
        response = self._call(self.stub.LookupPrefixes, sidecar_pb2.LookupPrefixesRequest(
            session_id=self.session_id, prefix_keys=list(keys)))
        return {found.index: found for found in response.found}

    def unpublish(self, key: str) -> sidecar_pb2.UnpublishResponse:
        """Deletes this tenant's prefix published under ``key`` (NotFound without one)."""
        return self._call(self.stub.Unpublish, sidecar_pb2.UnpublishRequest(
            session_id=self.session_id, prefix_key=key))

    def restore(self, sequence_id: str, from_session_id: str = "",
                adopt_any_session: bool = False) -> sidecar_pb2.RestoreResponse:
        """Brings a spilled sequence back into the arena (a new block table; K/V and positions
        bit-identical). The response's tier is where it came from (TIER_ARENA: it was not
        spilled). ``from_session_id``: adopt the disk copy of an ended session of this tenant.
        ``adopt_any_session``: adopt the newest copy of ``sequence_id`` left by any ended session
        of this tenant (after a drain or a restart, when the old session id is not known)."""
        request = sidecar_pb2.RestoreRequest(session_id=self.session_id, sequence_id=sequence_id)
        if from_session_id:
            request.from_session_id = from_session_id
        if adopt_any_session:
            request.adopt_any_session = True
        return self._call(self.stub.Restore, request)
