"""Channel setup and gRPC-error translation shared by Client and Admin (internal)."""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar

import grpc

from kvsidecar.errors import error_from_rpc

# Export chunks are up to 4 MiB; layouts and headers up to the server's 64 MiB message limit.
MAX_MESSAGE_BYTES = 64 << 20

_Response = TypeVar("_Response")


class _CallDetails(
        collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor,
                           grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the bearer token) to every call of a channel."""

    def __init__(self, metadata: Sequence[Tuple[str, str]]) -> None:
        self._metadata = list(metadata)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout,
                            list(details.metadata or []) + self._metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable[..., Any],
                              details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any],
                               details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any],
                               details: grpc.ClientCallDetails, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Callable[..., Any],
                                details: grpc.ClientCallDetails, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def make_channel(address: str, credentials: Optional[grpc.ChannelCredentials],
                 options: Sequence[Tuple[str, Any]] = (),
                 token: Optional[str] = None,
                 server_name: Optional[str] = None) -> Tuple[grpc.Channel, grpc.Channel]:
    """(channel to use, underlying channel to close and wait on). ``token``: sent as
    ``authorization: Bearer <token>`` metadata on every call (tenant or admin token).
    ``server_name``: the name the server's TLS certificate must carry, when it is not the host
    of ``address`` (TLS only)."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)] + list(options)
    if server_name:
        if credentials is None:
            from kvsidecar.errors import InvalidArgument
            raise InvalidArgument("server_name needs TLS credentials (see tls_credentials)")
        opts.append(("grpc.ssl_target_name_override", server_name))
    if credentials is None:
        channel = grpc.insecure_channel(address, options=opts)
    else:
        channel = grpc.secure_channel(address, credentials, options=opts)
    if not token:
        return channel, channel
    return grpc.intercept_channel(
        channel, _MetadataInterceptor([("authorization", f"Bearer {token}")])), channel


def wait_ready(channel: grpc.Channel, address: str, timeout: Optional[float]) -> None:
    if not timeout:
        return
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        from kvsidecar.errors import Unavailable
        raise Unavailable(f"cannot connect to {address} within {timeout} s"
                          f"{_why_not_ready(channel)}") from None


def _why_not_ready(channel: grpc.Channel) -> str:
    """gRPC's reason for the last failed connection (a refused port, a TLS handshake failure),
    read from one fail-fast health check; "" when there is none to tell."""
    check: Callable[..., Any] = channel.unary_unary(
        "/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
    try:
        check(b"", timeout=1.0)
    except grpc.RpcError as error:
        details = error.details() if hasattr(error, "details") else ""
        return f": {details}" if details else ""
    return ""


def call(method: Callable[..., _Response], request: Any, timeout: Optional[float]) -> _Response:
    """One unary call; a gRPC error becomes the matching KvsError."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as error:
        raise error_from_rpc(error) from None
