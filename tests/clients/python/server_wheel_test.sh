#!/usr/bin/env bash
# `pip install` of the wheel that carries the server is all a worker needs: deploy/server_wheel.sh
# builds it from BINARY, a fresh venv installs it (its dependencies from PyPI, or pip's cache),
# and then, with an environment of PATH and HOME only (no KVSIDECAR_BIN, no LD_LIBRARY_PATH, no
# build tree on any path), LocalServer() starts the wheel's server and a session attaches, writes,
# compresses and reads back; the `kvsidecar` command runs the same server (--version).
#   tests/clients/python/server_wheel_test.sh PYTHON BINARY
# PYTHON: a venv's python with pip (builds the wheel); the new venv uses the system's python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
py=${1:?usage: server_wheel_test.sh PYTHON BINARY}
binary=${2:?usage: server_wheel_test.sh PYTHON BINARY}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvs-server-wheel-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

wheel=$(PYTHON="$py" "$root/deploy/server_wheel.sh" --binary "$binary" --out "$work/wheel")
case "$(basename "$wheel")" in
  kvsidecar-*-py3-none-linux_*.whl) echo "ok   $(basename "$wheel"), $(stat -c %s "$wheel") bytes" ;;
  *) echo "FAIL: the wheel is not tagged for this platform: $wheel" >&2; exit 1 ;;
esac

python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --disable-pip-version-check --no-input -q "$wheel" \
  >"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; exit 1; }
echo "ok   installed into a fresh venv"

clean=(env -i "PATH=/usr/bin:/bin" "HOME=$HOME" "TMPDIR=${TMPDIR:-/tmp}")
"${clean[@]}" "$work/venv/bin/kvsidecar" --version >"$work/version.txt"
grep -q "^kvsidecar " "$work/version.txt" ||
  { echo "FAIL: kvsidecar --version printed:" >&2; cat "$work/version.txt" >&2; exit 1; }
echo "ok   the kvsidecar command runs the wheel's server: $(head -1 "$work/version.txt")"

(cd "$work" && "${clean[@]}" "$work/venv/bin/python" - "$work/venv") <<'PY'
import os, sys
import numpy as np
import kvsidecar as kvs
from kvsidecar.server import LocalServer, bundled_binary, find_binary

venv = os.path.realpath(sys.argv[1])
assert "KVSIDECAR_BIN" not in os.environ and "LD_LIBRARY_PATH" not in os.environ
assert bundled_binary() and os.path.realpath(find_binary()).startswith(venv), find_binary()
L, H, D, T = 2, 2, 16, 40
rng = np.random.default_rng(0)
k = rng.standard_normal((L, H, T, D), dtype=np.float32)
v = rng.standard_normal((L, H, T, D), dtype=np.float32)
with LocalServer() as server, kvs.Client(server.address) as client:
    layout = kvs.model_layout(num_layers=L, num_kv_heads=H, num_q_heads=4, head_dim=D,
                              dtype="fp32")
    with client.attach(layout, num_blocks=64) as session:
        seq = session.create_sequence("keydiff", budget=8).sequence_id
        r = session.reserve(seq, T)
        for layer in range(L):
            r.write(layer, k[layer], v[layer])
        session.commit(r)
        kept = [entry.kept for entry in session.compress(seq).layers]
        assert kept == [8, 8], kept
        got = session.read_layer(session.get_layout(seq), layer=1)
        heads = np.arange(H)[:, None]
        assert np.array_equal(got.k, k[1][heads, got.positions])
print("ok   LocalServer() started the wheel's server; a session wrote, compressed to 8 and "
      "read back bit for bit")
PY
echo "server wheel: 4 passed, 0 failed ($(( $(date +%s) - start )) s)"
