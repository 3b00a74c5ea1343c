"""Fixtures of the Python client tests: a real kvsidecar server on loopback.

The binary is $KVSIDECAR_BIN (ctest sets it to the built target); without it the tests fail
rather than skip, so a broken setup cannot pass silently. One server per test module; each test
attaches its own sessions and must leave none behind (checked by the `admin` fixture).
"""

import os

import pytest

import kvsidecar as kvs
from kvsidecar.server import LocalServer
from kvs_py_util import wait_for


@pytest.fixture(scope="module")
def server():
    if not os.environ.get("KVSIDECAR_BIN"):
        pytest.fail("set KVSIDECAR_BIN to the kvsidecar binary (<build>/service/kvsidecar)")
    with LocalServer(lease_ms=10000) as srv:
        yield srv
        assert srv.running(), "the server died during the tests\n" + srv.logs()


@pytest.fixture
def client(server):
    with kvs.Client(server.address, timeout=30, worker_name="pytest") as c:
        yield c


@pytest.fixture
def admin(server):
    with kvs.Admin(server.admin_address, timeout=30) as a:
        yield a
        # Every test detaches what it attached: the server must be empty again.
        assert wait_for(lambda: a.get_stats().sessions == 0), a.list_sessions()
