"""The kvsidecar Admin client (admin.proto): configuration, defaults, quotas, sessions, stats.

Served on the sidecar's admin port (``--admin_listen``), separate from the data plane. Thread-safe
(each call is one RPC); errors raise :class:`kvsidecar.errors.KvsError` subclasses.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import grpc

from kvsidecar import _rpc
from kvsidecar.v1 import admin_pb2, admin_pb2_grpc, common_pb2

__all__ = ["Admin"]


class Admin:
    """A connection to the Admin service.

    Args:
        address: ``host:port`` of the admin listener.
        timeout: deadline of each call in seconds (None = none).
        connect_timeout: wait this long for the channel to be ready (0 = lazy).
        credentials: channel credentials; None = insecure. TLS and mutual TLS:
            :func:`kvsidecar.tls_credentials`.
        token: the admin bearer token, when the sidecar runs with --admin_token_file.
        server_name: the name the sidecar's TLS certificate carries, when it is not the host of
            ``address``.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = 60.0,
                 connect_timeout: float = 10.0,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 token: Optional[str] = None, server_name: Optional[str] = None,
                 channel_options: Sequence[Tuple[str, Any]] = ()) -> None:
        self.address = address
        self.timeout = timeout
        channel, self._channel = _rpc.make_channel(address, credentials, channel_options, token,
                                                   server_name)
        self.stub = admin_pb2_grpc.AdminStub(channel)
        try:
            _rpc.wait_ready(self._channel, address, connect_timeout)
        except Exception:
            self._channel.close()
            raise

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: Callable[..., _rpc._Response], request: Any) -> _rpc._Response:
        return _rpc.call(method, request, self.timeout)

    def get_config(self) -> admin_pb2.GetConfigResponse:
        """The configuration in force (YAML), default policy/budget and backend."""
        return self._call(self.stub.GetConfig, admin_pb2.GetConfigRequest())

    def set_defaults(self, default_policy: Optional[common_pb2.PolicySpec] = None,
                     default_budget: Optional[common_pb2.Budget] = None,
                     rebudget_tenant: str = "", **fields: Any) -> admin_pb2.SetDefaultsResponse:
        """Default policy and budget for new sequences (None = unchanged); ``rebudget_tenant``
        compresses that tenant's sequences to the new budget. Other SetDefaultsRequest fields
        (e.g. ``rebudget_tokens_per_layer``) may be given by name."""
        request = admin_pb2.SetDefaultsRequest(rebudget_tenant=rebudget_tenant, **fields)
        if default_policy is not None:
            request.default_policy.CopyFrom(default_policy)
        if default_budget is not None:
            request.default_budget.CopyFrom(default_budget)
        return self._call(self.stub.SetDefaults, request)

    def set_quota(self, tenant: str, quota: admin_pb2.Quota,
                  rebudget: bool = False) -> admin_pb2.SetQuotaResponse:
        """Sets a tenant's quota (0 fields = unlimited)."""
        return self._call(self.stub.SetQuota,
                          admin_pb2.SetQuotaRequest(tenant=tenant, quota=quota, rebudget=rebudget))

    def get_quotas(self, tenant: str = "") -> Any:
        """Every tenant with a quota or with sessions: its quota and current use (GetQuotas)."""
        if not hasattr(self.stub, "GetQuotas"):
            from kvsidecar.errors import Unimplemented
            raise Unimplemented("this client's admin.proto has no GetQuotas")
        return self._call(self.stub.GetQuotas, admin_pb2.GetQuotasRequest(tenant=tenant))

    def list_sessions(self, tenant: str = "") -> admin_pb2.ListSessionsResponse:
        """Attached sessions (optionally of one tenant)."""
        return self._call(self.stub.ListSessions, admin_pb2.ListSessionsRequest(tenant=tenant))

    def list_sequences(self, session_id: str = "",
                       tenant: str = "") -> admin_pb2.ListSequencesResponse:
        """Sequences, optionally filtered by session and/or tenant."""
        return self._call(self.stub.ListSequences, admin_pb2.ListSequencesRequest(
            session_id=session_id, tenant=tenant))

    def get_stats(self) -> admin_pb2.GetStatsResponse:
        """Server-wide counters: sessions, sequences, arena use, tokens appended/evicted."""
        return self._call(self.stub.GetStats, admin_pb2.GetStatsRequest())

    def drain(self, to: int = common_pb2.TIER_UNSPECIFIED,
              grace_ms: int = 0) -> admin_pb2.DrainResponse:
        """Stops accepting attaches; says how many sessions remain. With ``to``
        (``common_pb2.TIER_DISK``, or 4 for the remote tier) also moves every live sequence there
        within ``grace_ms`` (0 = the sidecar's --drain_grace) and reports per sequence what moved
        and what did not, and why; the call then takes up to the grace period."""
        request = admin_pb2.DrainRequest(to=to, grace_ms=grace_ms)  # type: ignore[arg-type]
        if to == common_pb2.TIER_UNSPECIFIED:
            return self._call(self.stub.Drain, request)
        grace_s = grace_ms / 1000 if grace_ms > 0 else 3600.0
        timeout = None if self.timeout is None else self.timeout + grace_s
        return _rpc.call(self.stub.Drain, request, timeout)

    def force_release(self, session_id: str, sequence_id: str = ""
                      ) -> admin_pb2.ForceReleaseResponse:
        """Releases a sequence, or a whole session when ``sequence_id`` is empty."""
        return self._call(self.stub.ForceRelease, admin_pb2.ForceReleaseRequest(
            session_id=session_id, sequence_id=sequence_id))
