"""Locates the SmolLM2 GGUF file: $KVS_MODEL_PATH if set, else the cache that
deploy/fetch_model.sh fills ($KVS_MODEL_DIR or ~/.cache/kvsidecar/models), running that script
(which verifies the checksum and is a no-op when the file is there) when it can be found: `script`,
$KVS_FETCH_SCRIPT, the source checkout this package was imported from, or ./deploy."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator, Optional

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _candidate_scripts(script: Optional[str]) -> Iterator[str]:
    if script:
        yield script
    if os.environ.get("KVS_FETCH_SCRIPT"):
        yield os.environ["KVS_FETCH_SCRIPT"]
    here = os.path.dirname(os.path.abspath(__file__))
    # This checkout: clients/python/examples/numpy_llama -> repo root.
    yield os.path.join(here, "..", "..", "..", "..", "deploy", "fetch_model.sh")
    yield os.path.join(os.getcwd(), "deploy", "fetch_model.sh")


def model_path(fetch: bool = True, script: Optional[str] = None) -> str:
    """Path of the GGUF file; FileNotFoundError (with the reason) if absent and not fetchable."""
    explicit = os.environ.get("KVS_MODEL_PATH")
    if explicit:
        if not os.path.isfile(explicit):
            raise FileNotFoundError(f"KVS_MODEL_PATH={explicit} does not exist")
        return explicit
    model_dir = os.environ.get("KVS_MODEL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvsidecar", "models")
    path = os.path.join(model_dir, GGUF_NAME)
    if fetch:
        for candidate in _candidate_scripts(script):
            candidate = os.path.normpath(candidate)
            if not os.path.isfile(candidate):
                continue
            env = dict(os.environ)
            # This interpreter's pip (a venv has one; a bare Debian python3 may not).
            env.setdefault("PIP", f"{sys.executable} -m pip")
            env.setdefault("PYTHON", sys.executable)
            res = subprocess.run(["bash", candidate], capture_output=True, text=True, env=env)
            fetched = res.stdout.strip()
            if res.returncode == 0 and os.path.isfile(fetched):
                return fetched
            raise FileNotFoundError(
                f"{candidate} failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(
        f"{path} not found and deploy/fetch_model.sh was not found to fetch it; run it or set "
        "KVS_MODEL_PATH")
