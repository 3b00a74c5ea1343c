#!/usr/bin/env bash
# Builds the Python client's wheel with a self-contained kvsidecar server inside it: the binary
# and the shared-library closure the GPU bundle computes (deploy/gpu/bundle_tool.py server: every
# library ldd lists but the system C/C++ runtime, stripped) under kvsidecar/_server. After
# `pip install` of that wheel, kvsidecar.server.LocalServer() starts that server with no build and
# no KVSIDECAR_BIN, and the `kvsidecar` command runs it.
#   deploy/server_wheel.sh                      # build/service/kvsidecar -> build/wheel/*.whl
#   deploy/server_wheel.sh --binary PATH --out DIR
# Build the server first (cmake --build build --target kvsidecar; a Release build gives the
# smallest wheel). PYTHON (default python3) runs pip; pip builds the wheel in isolation from a copy
# of the tracked files of clients/python and proto/, so the checkout is left as it was. The wheel
# is tagged for this platform (py3-none-linux_x86_64) and runs on a Linux whose glibc and
# libstdc++ are at least this machine's (Debian 12). Prints the wheel's path.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
binary=$root/build/service/kvsidecar
out=$root/build/wheel
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary=$(realpath "$2"); shift 2 ;;
    --out) out=$(realpath -m "$2"); shift 2 ;;
    *) sed -n '2,13p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
  esac
done
[ -x "$binary" ] || { echo "server_wheel.sh: no server binary at $binary (build it first)" >&2; exit 1; }
py=${PYTHON:-python3}

stage=$(mktemp -d "${TMPDIR:-/tmp}/kvs-server-wheel-XXXXXX")
trap 'rm -rf "$stage"' EXIT
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$root" && git ls-files -z -- clients/python proto | xargs -0 cp --parents -t "$stage")
else
  cp -r "$root/clients" "$root/proto" "$stage/"
fi
rm -rf "$stage/clients/python/kvsidecar/_server"
python3 "$root/deploy/gpu/bundle_tool.py" server "$binary" "$stage/clients/python/kvsidecar/_server" >&2
mkdir -p "$out"
rm -f "$out"/kvsidecar-*.whl
"$py" -m pip wheel --disable-pip-version-check --no-input -q --no-deps -w "$out" \
  "$stage/clients/python" >&2
wheel=$(ls "$out"/kvsidecar-*.whl)
echo "$wheel"
