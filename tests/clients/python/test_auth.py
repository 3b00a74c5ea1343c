"""TLS, mutual TLS and bearer tokens through the Python client, against the real kvsidecar binary
started with certificates that openssl makes at test time (a CA, a server certificate for
localhost / 127.0.0.1, a client certificate), as tests/e2e/auth_test.cc does for C++."""

import subprocess

import grpc
import numpy as np
import pytest

import kvsidecar as kvs
from kvsidecar.server import LocalServer
from kvsidecar.v1 import sidecar_pb2
from kvs_py_util import layout, random_kv

TOKENS = "team-a: token-aaaa\nteam-b: token-bbbb\n"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """ca.pem, server.{pem,key}, client.{pem,key} (P-256, signed by the CA), and other_ca.pem (a
    CA that signed nothing here)."""
    d = tmp_path_factory.mktemp("certs")
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    script = " && ".join([
        f"openssl req -x509 {ec} -keyout ca.key -out ca.pem -days 2 -subj /CN=kvs-py-test-ca",
        f"openssl req -x509 {ec} -keyout other_ca.key -out other_ca.pem -days 2 -subj /CN=other",
        f"openssl req {ec} -keyout server.key -out server.csr -subj /CN=localhost",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
        "-extfile server.ext -out server.pem",
        f"openssl req {ec} -keyout client.key -out client.csr -subj /CN=kvs-py-test-client",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
        "-out client.pem",
    ])
    out = subprocess.run(["sh", "-c", script], cwd=d, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (d / "tokens.yaml").write_text(TOKENS)
    (d / "admin.token").write_text("admin-secret-1\n")
    return d


def _server(certs, mtls):
    args = [f"--tls_cert_file={certs}/server.pem", f"--tls_key_file={certs}/server.key",
            f"--tenant_tokens_file={certs}/tokens.yaml",
            f"--admin_token_file={certs}/admin.token"]
    if mtls:
        args.append(f"--tls_client_ca_file={certs}/ca.pem")
    return LocalServer(extra_args=args)


def _round_trip(session):
    """Append and read back through the arena: the data plane works over this channel."""
    seq = session.create_sequence().sequence_id
    kv = random_kv("fp16", (2, 2, 2, 3, 16))
    session.append(seq, kv)
    got = session.read_layer(session.get_layout(seq), layer=1)
    assert np.array_equal(got.k, kv[1, 0]) and np.array_equal(got.v, kv[1, 1])
    assert session.export(seq).layer(0).count == 3


def test_tls_with_tenant_and_admin_tokens(certs):
    creds = kvs.tls_credentials(root_cert=certs / "ca.pem")
    with _server(certs, mtls=False) as srv:
        # The client dials 127.0.0.1: the certificate's IP subjectAltName is checked.
        with kvs.Client(srv.address, credentials=creds, token="token-aaaa") as client, \
                kvs.Admin(srv.admin_address, credentials=creds, token="admin-secret-1") as admin:
            with client.attach(layout("fp16"), num_blocks=8, tenant="team-b") as session:
                assert session.watching(timeout=10)  # the Watch stream is authenticated too
                _round_trip(session)
                # The token's tenant wins over the request's tenant field.
                assert [s.tenant for s in admin.list_sessions().sessions] == ["team-a"]
                # Team B on team A's session: PERMISSION_DENIED, worded as for a missing one.
                with kvs.Client(srv.address, credentials=creds, token="token-bbbb") as other:
                    heartbeat = sidecar_pb2.HeartbeatRequest(session_id=session.session_id)
                    with pytest.raises(kvs.errors.PermissionDenied) as foreign:
                        kvs._rpc.call(other.stub.Heartbeat, heartbeat, 10)
                    missing = sidecar_pb2.HeartbeatRequest(
                        session_id="0" * len(session.session_id))
                    with pytest.raises(kvs.errors.PermissionDenied) as absent:
                        kvs._rpc.call(other.stub.Heartbeat, missing, 10)
                    assert foreign.value.message.replace(session.session_id, "ID") == \
                        absent.value.message.replace("0" * len(session.session_id), "ID")
            assert admin.get_stats().sessions == 0
        # TLS without a token, or with a wrong one: UNAUTHENTICATED.
        with kvs.Client(srv.address, credentials=creds) as anonymous:
            with pytest.raises(kvs.errors.Unauthenticated):
                anonymous.attach(layout("fp16"), num_blocks=8)
        with kvs.Client(srv.address, credentials=creds, token="token-zzzz") as wrong:
            with pytest.raises(kvs.errors.Unauthenticated):
                wrong.attach(layout("fp16"), num_blocks=8)
        with kvs.Admin(srv.admin_address, credentials=creds, token="token-aaaa") as bad_admin:
            with pytest.raises(kvs.errors.Unauthenticated):  # a tenant token is not the admin's
                bad_admin.get_stats()
        # A server name the certificate carries, dialed through an address it does not name.
        with kvs.Client(srv.address.replace("127.0.0.1", "localhost"), credentials=creds,
                        token="token-aaaa", server_name="localhost") as named:
            with named.attach(layout("fp16"), num_blocks=8) as session:
                _round_trip(session)
        # Plaintext against TLS, a CA that did not sign the server, a name the certificate does
        # not carry: the channel never becomes ready.
        with pytest.raises(kvs.errors.Unavailable):
            kvs.Client(srv.address, token="token-aaaa", connect_timeout=1)
        with pytest.raises(kvs.errors.Unavailable, match="within 1 s: .*"):
            kvs.Client(srv.address, credentials=kvs.tls_credentials(certs / "other_ca.pem"),
                       token="token-aaaa", connect_timeout=1)
        with pytest.raises(kvs.errors.Unavailable):
            kvs.Client(srv.address, credentials=creds, server_name="not-the-server",
                       token="token-aaaa", connect_timeout=1)
        assert srv.running()


def test_mutual_tls_wants_a_client_certificate(certs):
    with _server(certs, mtls=True) as srv:
        mutual = kvs.tls_credentials(root_cert=certs / "ca.pem",
                                     client_cert=certs / "client.pem",
                                     client_key=(certs / "client.key").read_bytes())
        with kvs.Client(srv.address, credentials=mutual, token="token-aaaa") as client, \
                kvs.Admin(srv.admin_address, credentials=mutual, token="admin-secret-1") as admin:
            with client.attach(layout("fp16"), num_blocks=8) as session:
                assert session.watching(timeout=10)
                _round_trip(session)
                assert admin.get_stats().sessions == 1
        # TLS without a client certificate: the handshake fails.
        with pytest.raises(kvs.errors.Unavailable):
            kvs.Client(srv.address, credentials=kvs.tls_credentials(certs / "ca.pem"),
                       token="token-aaaa", connect_timeout=1)
        # A certificate signed by another CA: refused too.
        d = certs / "stranger"
        d.mkdir(exist_ok=True)
        out = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(d / "s.key"), "-out",
             str(d / "s.pem"), "-days", "2", "-subj", "/CN=stranger"],
            capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        stranger = kvs.tls_credentials(certs / "ca.pem", d / "s.pem", d / "s.key")
        with pytest.raises(kvs.errors.Unavailable):
            kvs.Client(srv.address, credentials=stranger, token="token-aaaa", connect_timeout=1)
        assert srv.running()


def test_tls_credentials_check_their_input(certs, tmp_path):
    with pytest.raises(kvs.errors.InvalidArgument, match="both or neither"):
        kvs.tls_credentials(certs / "ca.pem", client_cert=certs / "client.pem")
    with pytest.raises(kvs.errors.InvalidArgument, match="root_cert: cannot read"):
        kvs.tls_credentials(tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(kvs.errors.InvalidArgument, match="root_cert is not PEM"):
        kvs.tls_credentials(tmp_path / "junk.pem")
    pem = (certs / "ca.pem").read_text()
    assert isinstance(kvs.tls_credentials(pem), grpc.ChannelCredentials)  # a PEM string
    with pytest.raises(kvs.errors.InvalidArgument, match="server_name needs TLS"):
        kvs.Client("127.0.0.1:1", server_name="localhost", connect_timeout=0)
