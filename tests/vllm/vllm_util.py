"""Helpers of the vLLM connector's tests and benchmarks: a private redis-server, sidecars with
tenant tokens, and vLLM engines run as processes of their own (tests/vllm/engine_job.py)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from kvsidecar.server import LocalServer

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = {"team-a": "token-aaaa", "team-b": "token-bbbb"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    """redis-server on a free loopback port, no persistence; stopped on close."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (deploy/install_deps.sh "
                                    "installs it)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvs-vllm-redis-")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.cli("PING").strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> str:
        done = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=20)
        return done.stdout

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def sidecar(tmp: str, redis: Optional[Redis] = None, extra: List[str] = ()) -> LocalServer:
    """A sidecar with the two test tenants' tokens (and the Redis tier when given)."""
    tokens = os.path.join(tmp, "tokens.yaml")
    with open(tokens, "w") as f:
        f.write("".join(f"{tenant}: {token}\n" for tenant, token in TOKENS.items()))
    os.chmod(tokens, 0o600)
    args = [f"--tenant_tokens_file={tokens}", "--host_tier_bytes=512Mi",
            "--disk_tier_bytes=1Gi", *extra]
    if redis is not None:
        args.append(f"--remote_tier={redis.url}")
    return LocalServer(lease_ms=20000, extra_args=args)


def token_file(tmp: str, tenant: str) -> str:
    path = os.path.join(tmp, f"{tenant}.token")
    with open(path, "w") as f:
        f.write(TOKENS[tenant] + "\n")
    os.chmod(path, 0o600)
    return path


def connector(server: LocalServer, token: Optional[str], **extra: Any) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"address": server.address, "timeout": 20}
    if token:
        cfg["token_file"] = token
    cfg.update(extra)
    return cfg


class Engine:
    """One engine_job.py process; ``wait()`` returns its results (rounds of outputs)."""

    def __init__(self, tmp: str, model: str, rounds: List[List[List[int]]],
                 connector_cfg: Optional[Dict[str, Any]], **job: Any) -> None:
        self.dir = tempfile.mkdtemp(prefix="engine-", dir=tmp)
        rpc = os.path.join(self.dir, "rpc")
        os.makedirs(rpc)
        spec = {"model": model, "connector": connector_cfg, "rounds": rounds,
                "reset_prefix_cache": True, "rpc_dir": rpc, **job}
        self.job = os.path.join(self.dir, "job.json")
        self.out = os.path.join(self.dir, "out.json")
        self.log_path = os.path.join(self.dir, "engine.log")
        with open(self.job, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, VLLM_RPC_BASE_PATH=rpc, OMP_NUM_THREADS="2",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_job.py"),
                                         self.job, self.out], stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_log(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"engine never logged {text!r}\n{self.log()[-6000:]}")

    def wait(self, timeout: float = 420) -> List[Dict[str, Any]]:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"engine did not finish in {timeout} s\n{self.log()[-6000:]}")
        self._log.close()
        if code != 0 or not os.path.exists(self.out):
            raise AssertionError(f"engine exited {code}\n{self.log()[-8000:]}")
        with open(self.out) as f:
            rounds: List[Dict[str, Any]] = json.load(f)["rounds"]
        return rounds


def run(tmp: str, model: str, rounds: List[Any], connector_cfg: Optional[Dict[str, Any]],
        timeout: float = 420, **job: Any) -> List[Dict[str, Any]]:
    return Engine(tmp, model, rounds, connector_cfg, **job).wait(timeout)
