"""Start a local kvsidecar server process (tests, benchmarks, demos).

:class:`LocalServer` runs the ``kvsidecar`` binary on ephemeral loopback ports with a private
temporary data directory and shared-memory directory, waits for its "kvsidecar listening" line and
exposes the data-plane and admin addresses. It is a context manager: leaving the block stops the
server (SIGTERM, then SIGKILL) and removes its directories. The binary is ``binary``, else
``$KVSIDECAR_BIN``, else the server the wheel carries (``kvsidecar/_server``: the binary and the
shared libraries it needs, built by deploy/server_wheel.sh; ``pip install`` of that wheel is all a
worker needs). The same server runs from the command line as ``kvsidecar`` (this module's
:func:`main`, a console script of the wheel).

The server never outlives this process: its stdin is a pipe whose write end only this object
holds, and it runs with ``--exit_when_stdin_closes``, so when this process dies, even by SIGKILL,
the kernel closes the pipe and the server shuts down as on SIGTERM. (Its directories are then left
behind: nothing of this process runs to remove them.) A child this process forks without exec
inherits the write end and keeps the server up until it exits too; subprocess's children do not
(close_fds).

Not thread-safe; one object per server process.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["LocalServer", "find_binary", "bundled_binary", "main"]

_LISTENING = re.compile(r"kvsidecar listening data=(\S+) admin=(\S+)")
_BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_server", "kvsidecar")


def bundled_binary() -> Optional[str]:
    """The server the wheel carries (kvsidecar/_server/kvsidecar), or None in a wheel without."""
    return _BUNDLED if os.path.isfile(_BUNDLED) and os.access(_BUNDLED, os.X_OK) else None


def find_binary(binary: Optional[str] = None) -> str:
    """``binary``, else ``$KVSIDECAR_BIN``, else the wheel's own server; FileNotFoundError if
    none is an executable."""
    path = binary or os.environ.get("KVSIDECAR_BIN", "") or bundled_binary() or ""
    if not path:
        raise FileNotFoundError(
            "no kvsidecar binary: pass binary=, set KVSIDECAR_BIN to <build>/service/kvsidecar, "
            "or install the wheel that carries the server (deploy/server_wheel.sh)")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"kvsidecar binary {path!r} is not an executable file")
    return path


def server_environment(binary: str) -> Dict[str, str]:
    """The environment to run `binary` in: the wheel's server finds its libraries beside it
    (kvsidecar/_server/lib, first on LD_LIBRARY_PATH); any other binary gets ours as it is."""
    env = dict(os.environ)
    if os.path.abspath(binary) == _BUNDLED:
        lib = os.path.join(os.path.dirname(_BUNDLED), "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (lib, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``kvsidecar`` console script: runs the wheel's server with these arguments."""
    binary = bundled_binary()
    if binary is None:
        print("kvsidecar: this installation carries no server binary (install the wheel built "
              "by deploy/server_wheel.sh, or run <build>/service/kvsidecar)", file=sys.stderr)
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    os.execve(binary, [binary, *args], server_environment(binary))
    return 0  # pragma: no cover - execve does not return


class LocalServer:
    """A kvsidecar process on loopback.

    Args:
        binary: path of the ``kvsidecar`` binary (default ``$KVSIDECAR_BIN``, else the wheel's).
        lease_ms: default session lease.
        extra_args: more command-line flags (see ``kvsidecar --help``).
        start_timeout: seconds to wait for the listening line.
        shm_dir: directory of the arena files; default a private directory under /dev/shm
            (or the temporary directory when /dev/shm does not exist).

    Attributes:
        address, admin_address: ``host:port`` of the data plane and the admin service.
        dir: the private temporary directory (data dir, logs).
    """

    def __init__(self, binary: Optional[str] = None, *, lease_ms: int = 10000,
                 extra_args: Sequence[str] = (), start_timeout: float = 30.0,
                 shm_dir: Optional[str] = None) -> None:
        self.binary = find_binary(binary)
        self.dir = tempfile.mkdtemp(prefix="kvsidecar-py-")
        if shm_dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else self.dir
            shm_dir = tempfile.mkdtemp(prefix="kvsidecar-py-shm-", dir=base)
            self._own_shm = True
        else:
            self._own_shm = False
        self.shm_dir = shm_dir
        self.address = ""
        self.admin_address = ""
        args: List[str] = [self.binary, "--listen=127.0.0.1:0", "--admin_listen=127.0.0.1:0",
                           f"--data_dir={self.dir}/data", f"--shm_dir={self.shm_dir}",
                           f"--lease_ms={lease_ms}", "--exit_when_stdin_closes=true",
                           *extra_args]
        self._stdout_path = os.path.join(self.dir, "kvsidecar.stdout")
        self._stderr_path = os.path.join(self.dir, "kvsidecar.stderr")
        with open(self._stdout_path, "wb") as out, open(self._stderr_path, "wb") as err:
            self.process = subprocess.Popen(args, stdout=out, stderr=err,
                                            stdin=subprocess.PIPE,
                                            env=server_environment(self.binary))
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.stdout())
            if match:
                self.address, self.admin_address = match.group(1), match.group(2)
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        logs = self.logs()
        self.stop()
        raise RuntimeError(f"kvsidecar did not report listening within {start_timeout} s "
                           f"(exit code {self.process.returncode})\n{logs}")

    def stdout(self) -> str:
        with open(self._stdout_path, "r", errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self._stderr_path, "r", errors="replace") as f:
            return f.read()

    def logs(self) -> str:
        return f"--- kvsidecar stdout ---\n{self.stdout()}--- kvsidecar stderr ---\n{self.stderr()}"

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        return self.process.returncode

    def close(self) -> None:
        """Stops the server and removes its directories."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._own_shm:
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
