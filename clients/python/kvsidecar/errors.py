"""Exceptions of the kvsidecar client.

Every failed call raises a subclass of :class:`KvsError` chosen by the gRPC status code, carrying
the code and the server's message unchanged (the server names the offending field in
INVALID_ARGUMENT messages). Local checks of the client (an array of the wrong shape, a slot
outside the arena) raise :class:`InvalidArgument` / :class:`OutOfRange` the same way, with
``code`` set to the matching gRPC code.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc

__all__ = [
    "KvsError", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted",
    "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated",
    "error_from_rpc",
]


class KvsError(Exception):
    """A kvsidecar call failed.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode``).
        message: the server's message (or the client's, for local checks).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class Cancelled(KvsError):
    code = grpc.StatusCode.CANCELLED


class Unknown(KvsError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KvsError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvsError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KvsError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvsError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KvsError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvsError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KvsError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KvsError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(KvsError, IndexError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KvsError, NotImplementedError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvsError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(KvsError, ConnectionError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KvsError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KvsError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[KvsError]] = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}


def error_from_rpc(error: grpc.RpcError) -> KvsError:
    """The :class:`KvsError` subclass for a ``grpc.RpcError`` (same code, same message)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, KvsError)
    return cls(details or "", code)
