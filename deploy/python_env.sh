#!/usr/bin/env bash
# Creates (or refreshes) the Python virtual environment the Python tests run in, and installs the
# kvsidecar Python client into it from ./clients/python with its test, model and hf extras
# (PyPI; hf = torch + transformers, about 6 GiB with torch's CUDA runtime wheels).
#   deploy/python_env.sh VENV_DIR        # e.g. build/pyenv (git-ignored); prints VENV_DIR/bin/python
#   KVS_PY_EDITABLE=1 deploy/python_env.sh VENV_DIR   # editable install, for development
#   KVS_PY_EXTRAS=test,model deploy/python_env.sh VENV_DIR   # other extras (default test,model,hf)
# The gRPC stubs are generated from ./proto while pip builds the package. Re-running reinstalls the
# client (a changed .proto is picked up) without re-downloading what is already installed. The
# build writes nothing into the source tree (setup.py keeps build/ and *.egg-info in a temporary
# directory; tests/clients/python/install_clean_test.sh checks it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:?usage: deploy/python_env.sh VENV_DIR}

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
py="$venv/bin/python"
pip_args=(--disable-pip-version-check --no-input -q)
extras=${KVS_PY_EXTRAS:-test,model,hf}
if [ "${KVS_PY_EDITABLE:-0}" = 1 ]; then
  # Sources used in place; the stubs are generated into clients/python/kvsidecar/v1 (git-ignored).
  "$py" -m pip install "${pip_args[@]}" -e "$root/clients/python[$extras]" >&2
else
  # A plain copy in site-packages, the stubs generated into the wheel.
  "$py" -m pip install "${pip_args[@]}" "$root/clients/python[$extras]" >&2
fi
"$py" -c "import kvsidecar, kvsidecar.v1.sidecar_pb2_grpc" >&2
echo "$py"
