"""kvsidecar.server.LocalServer: the server it starts never outlives the process that started it.

A benchmark or test that is killed (SIGKILL, an OOM kill, ctest's timeout) runs no cleanup, and a
server left behind keeps its arena memory and ports. LocalServer holds the write end of the
server's stdin and starts it with --exit_when_stdin_closes: the kernel closes that pipe when the
owner dies however it dies, and the server shuts down as on SIGTERM.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import kvsidecar as kvs
from kvsidecar.server import LocalServer
from kvs_py_util import wait_for

# A child that starts a LocalServer, says the server's pid and address, and waits to be killed.
_OWNER = textwrap.dedent("""
    import sys, time
    from kvsidecar.server import LocalServer
    srv = LocalServer()
    print(srv.process.pid, srv.address, srv.dir, srv.shm_dir, flush=True)
    time.sleep(600)
""")


def _alive(pid):
    """True while `pid` exists and is not a zombie (an orphan is reaped by init, not by us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_server_stops_when_its_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    pid, dirs = None, []
    try:
        pid_text, address, *dirs = owner.stdout.readline().split()
        pid = int(pid_text)
        assert _alive(pid)
        with kvs.Client(address, timeout=10) as client:
            client.attach(kvs.model_layout(num_layers=1, num_kv_heads=1, num_q_heads=1,
                                           head_dim=8, dtype="fp32", block_tokens=4),
                          num_blocks=4).detach()
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert wait_for(lambda: not _alive(pid), timeout=30), \
            f"the server (pid {pid}) outlived its killed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if pid is not None and _alive(pid):  # only when the test failed
            os.kill(pid, signal.SIGKILL)
        # The killed owner could not remove its server's directories.
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_server_serves_while_its_owner_lives_and_stops_cleanly():
    with LocalServer() as srv:
        # Nothing is written to the pipe; an idle stdin must not stop the server.
        assert not wait_for(lambda: not srv.running(), timeout=1.0)
        with kvs.Client(srv.address, timeout=10):
            pass
        assert srv.running()
        assert srv.stop() == 0, srv.logs()
