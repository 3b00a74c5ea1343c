"""The code blocks of README.md and clients/python/README.md run as pasted.

Every ```python block of both files runs in a fresh interpreter, against a server started the way
the README says (LocalServer(): $KVSIDECAR_BIN here, the wheel's own server after `pip install`;
ctest py_server_wheel checks that one), except the fragments listed below, which show a call
inside a program the README does not spell out. The transformers block loads SmolLM2-135M from
its GGUF, which deploy/fetch_model.sh fetches first (the README's instruction), and checks what
it prints."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
READMES = [os.path.join(REPO, "README.md"), os.path.join(REPO, "clients", "python", "README.md")]
# First line of a fragment -> why it cannot run alone.
FRAGMENTS = {
    "key = kvs.prefix_key(": "names the token ids, layout and sessions of the paragraph above",
    "creds = kvs.tls_credentials(": "needs certificate files (test_auth.py runs it with some)",
}
# What a block prints, by a phrase of its code.
EXPECTED = {
    "r.write(layer, k[layer], v[layer])": ["kept per layer: [64, 64]", "K (2, 64, 64) uint16"],
    "SidecarCache(session, model": ["held per layer: ", " tokens seen"],
}


def _blocks():
    out = []
    for path in READMES:
        with open(path, encoding="utf-8") as f:
            for n, block in enumerate(re.findall(r"```python\n(.*?)```", f.read(), re.S)):
                out.append(pytest.param(block, id=f"{os.path.basename(os.path.dirname(path)) or 'repo'}"
                                                  f"-{os.path.basename(path)}-{n}"))
    return out


def test_every_block_is_run_or_named_a_fragment():
    firsts = [p.values[0].splitlines()[0] for p in _blocks()]
    assert any("SidecarCache" in p.values[0] for p in _blocks()), "no transformers example"
    for prefix in FRAGMENTS:
        assert any(line.startswith(prefix) for line in firsts), f"no such fragment: {prefix}"


@pytest.fixture(scope="module")
def model_dir():
    fetched = subprocess.run([os.path.join(REPO, "deploy", "fetch_model.sh")], check=True,
                             capture_output=True, text=True).stdout.strip()
    return os.path.dirname(fetched)


@pytest.mark.parametrize("block", _blocks())
def test_readme_block_runs_as_pasted(block, model_dir):
    first = block.splitlines()[0]
    if any(first.startswith(prefix) for prefix in FRAGMENTS):
        pytest.skip(f"a fragment: {FRAGMENTS[next(p for p in FRAGMENTS if first.startswith(p))]}")
    env = dict(os.environ, KVS_MODEL_DIR=model_dir, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", block],
                         capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    for phrase, printed in EXPECTED.items():
        if phrase in block:
            for text in printed:
                assert text in out.stdout, out.stdout + out.stderr
