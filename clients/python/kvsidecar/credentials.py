"""Channel credentials for a sidecar that serves TLS or mutual TLS.

The sidecar serves TLS on both gRPC ports when started with ``--tls_cert_file`` /
``--tls_key_file``, and requires a client certificate signed by ``--tls_client_ca_file`` when that
is set (mutual TLS). Bearer tokens (``--tenant_tokens_file`` on the data plane,
``--admin_token_file`` on Admin) are separate: pass ``token=`` to :class:`kvsidecar.Client` /
:class:`kvsidecar.Admin`, which sends ``authorization: Bearer <token>`` on every call, streams
included.

    creds = kvs.tls_credentials(root_cert="ca.pem", client_cert="client.pem",
                                client_key="client.key")
    with kvs.Client("sidecar:50051", credentials=creds, token="token-aaaa") as client: ...

Pure functions; the returned credentials may be shared by any number of channels.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import grpc

from kvsidecar.errors import InvalidArgument

__all__ = ["tls_credentials"]

PemLike = Union[None, bytes, str, "os.PathLike[str]"]


def _pem(value: PemLike, what: str) -> Optional[bytes]:
    """PEM bytes from bytes, a PEM string, or the path of a PEM file."""
    if value is None:
        return None
    if isinstance(value, bytes):
        data = value
    else:
        text = os.fspath(value)
        if "-----BEGIN" in text:
            data = text.encode()
        else:
            try:
                with open(text, "rb") as f:
                    data = f.read()
            except OSError as error:
                raise InvalidArgument(f"{what}: cannot read {text!r}: {error.strerror}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"{what} is not PEM (no -----BEGIN line)")
    return data


def tls_credentials(root_cert: PemLike = None, client_cert: PemLike = None,
                    client_key: PemLike = None) -> grpc.ChannelCredentials:
    """TLS channel credentials.

    Args:
        root_cert: the CA bundle that signed the sidecar's certificate (a path, a PEM string or
            PEM bytes); None = the system roots.
        client_cert, client_key: this worker's certificate chain and private key, for a sidecar
            with mutual TLS; give both or neither.

    The sidecar's certificate must name the host the client dials (a DNS or IP subjectAltName);
    to dial an address it does not name, pass ``server_name=`` to Client / Admin.
    """
    if (client_cert is None) != (client_key is None):
        raise InvalidArgument("client_cert and client_key go together: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(root_cert, "root_cert"),
        private_key=_pem(client_key, "client_key"),
        certificate_chain=_pem(client_cert, "client_cert"))
