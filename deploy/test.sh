#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine: installs dependencies, builds, runs every test.
#   deploy/test.sh                 # RelWithDebInfo build in ./build, all tests
#   KVS_SANITIZE="address thread" deploy/test.sh   # additionally ASAN+UBSAN and TSAN builds
# Exits non-zero if any build step or test fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
jobs=$(nproc)

"$root/deploy/install_deps.sh"

run_suite() {  # run_suite BUILD_DIR [cmake args...]
  local dir=$1; shift
  echo "== configure $dir"
  cmake -S "$root" -B "$dir" -G Ninja "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  # Whether the CUDA backend is compiled in this suite (on when nvcc is found; issue 5).
  grep -h "kvsidecar: CUDA backend" "$dir.configure.log" || true
  echo "== build $dir"
  cmake --build "$dir" -j "$jobs"
  echo "== test $dir"
  ctest --test-dir "$dir" --output-on-failure --timeout 300 -j "$jobs" ||
    { print_failures "$dir"; return 1; }
}

# The output of every test that failed in BUILD_DIR's last ctest run, again at the end: a CI log
# is often read from its tail, where ctest leaves only the names of the failed tests.
print_failures() {  # print_failures BUILD_DIR
  local log=$1/Testing/Temporary/LastTest.log failed=$1/Testing/Temporary/LastTestsFailed.log
  [[ -f $log && -f $failed ]] || return 0
  echo "== output of the failed tests in $1"
  cut -d: -f2- "$failed" | while IFS= read -r name; do
    awk -v name="$name" '
      /^[0-9]+\/[0-9]+ Test: / && substr($0, index($0, " Test: ") + 7) == name { on = 1 }
      on { print }
      on && index($0, "\"" name "\" end time") == 1 { on = 0 }' "$log" | tail -n 200
  done
}

mkdir -p "$root/build"
# Free disk, said up front. A fresh run needs about 23 GiB under the checkout: the venv is 6 GiB
# (and vLLM's, 6.5 GiB more)
# (PyPI's torch for Linux x86_64 is the CUDA build; its nvidia-* and triton wheels are 4 GiB of
# it, and they must be there for `import torch` even on a CPU), pip holds about 3 GiB more while
# it installs, and the RelWithDebInfo and sanitizer build trees take about 3.5 and 6 GiB. Short of
# that, pip or the linker stops minutes in with "No space left on device"; this line says why.
free_kib=$(df -Pk "$root/build" | awk 'NR == 2 { print $4 }')
echo "== disk: $((free_kib / 1048576)) GiB free under $root (a fresh run needs about 23 GiB)"
if ((free_kib < 23 * 1048576)); then
  echo "deploy/test.sh: warning: less than 23 GiB free; the install or the build may run out" >&2
fi
# The Python client (clients/python) in a venv under the build dir, for its pytest suites (PyPI).
echo "== python venv $root/build/pyenv"
kvs_python=$("$root/deploy/python_env.sh" "$root/build/pyenv")
# vLLM's CPU build in a venv of its own (about 6.5 GB, 2-5 min), for the vLLM connector's tests;
# if it cannot be installed, those tests report themselves skipped with the reason.
echo "== vLLM venv $root/build/vllmenv"
if kvs_vllm_python=$("$root/deploy/vllm_env.sh" "$root/build/vllmenv"); then
  vllm_args=(-DKVS_VLLM_PYTHON="$kvs_vllm_python" -DKVS_VLLM_SKIP_REASON=)
else
  vllm_args=(-DKVS_VLLM_PYTHON= "-DKVS_VLLM_SKIP_REASON=deploy/vllm_env.sh failed (exit $?)")
fi
run_suite "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVS_PYTHON="$kvs_python" \
  "${vllm_args[@]}"

for sanitizer in ${KVS_SANITIZE:-}; do
  mkdir -p "$root/build-$sanitizer"
  run_suite "$root/build-$sanitizer" -DCMAKE_BUILD_TYPE=Debug -DKVS_SANITIZER="$sanitizer" \
    -DKVS_BUILD_BENCH=OFF
done
