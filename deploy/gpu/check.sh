#!/usr/bin/env bash
# The one GPU-machine command: unpacks the bundle made by deploy/gpu/bundle.sh and, in under 8
# minutes, runs every CUDA check of the project, writing logs and a figures table into $OUT.
#
# The device tool call (the bundle in .gpu/ of the checkout the call sends, made beforehand with
# deploy/gpu/bundle.sh; about 21 MB, the 64 MiB the call carries includes the working tree):
#   run(command="bash deploy/gpu/check.sh", carry=[".gpu"], timeout_s=510)
# A rerun of failed steps only, while the machine is warm (see KVS_CHECK_ONLY below):
#   run(command="KVS_CHECK_ONLY=suites,python bash deploy/gpu/check.sh", carry=[".gpu"],
#       timeout_s=400)
#
# Steps, each under its own timeout (a hang costs that step only; a failure is recorded and the
# next step runs):
#   1. nvidia-smi, the image's Python/torch, the bundle's library check on this machine
#   2. the CUDA parity tests, the CUDA IPC tests, --backend=auto, every /cuda suite (manifest.json)
#   3. the Python CudaArena with the image's torch (tests/clients/python/test_cuda_arena.py and
#      deploy/gpu/cuda_arena_check.py), and kvsidecar.hf.SidecarCache generating with tiny
#      transformers models on the GPU (deploy/gpu/hf_cuda_check.py)
#   4. cuda_bench: gather, KeyDiff scoring, top-k, attention window, each against a limit of the
#      same run (device-to-device copy, cuBLAS GEMM)
#   5. each policy's whole compress through the sidecar vs PyTorch on the same GPU
#      (bench/gpu/torch_compress_bench.py), then one compress of four policies with the staging
#      layer's per-call trace (KVS_STAGING_TRACE=1)
#   6. DecodeStep, 64 sequences x 32 layers: p50/p99 on --backend=cuda and on --backend=cpu
#      (service_bench BM_DecodeStep), and the shape of every policy's decode step and compress on
#      --backend=cuda: calls, synchronisations, transfers and launches per RPC (bench/rpc_counts)
#   7. spill and restore of a 256 MiB sequence between the CUDA arena and the host tier, against
#      cudaMemcpy from page-locked memory in the same run (storage_bench, KVS_BENCH_BACKEND=cuda)
# $OUT gets at most 8 files: summary.md (step status + figures), env.txt, tests.log,
# failures.log, python.log, cuda_bench.log, torch_bench.log, decode.log (DecodeStep and spill).
#   deploy/gpu/check.sh [BUNDLE_ARCHIVE]     (default .gpu/kvs-gpu-bundle.tar.xz; OUT defaults
#                                             to .gpu/out when unset)
# A rerun of some steps only: KVS_CHECK_ONLY=tests,python (keys: machine tests suites python
# cuda_bench torch trace decode spill), e.g. run(command="KVS_CHECK_ONLY=suites bash deploy/gpu/check.sh", ...).
# KVS_CHECK_TORCH_POLICIES (default: the bench's list) narrows step 5, KVS_CHECK_TRACE_POLICIES
# (default streaming_llm,keydiff,snapkv,h2o) names the policies its trace follows;
# KVS_CHECK_DECODE_BACKENDS (default "cuda cpu") and KVS_CHECK_DECODE_STEPS (50) size step 6.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
archive=${1:-$root/.gpu/kvs-gpu-bundle.tar.xz}
out=${OUT:-$root/.gpu/out}
budget=${KVS_CHECK_BUDGET_S:-465}   # whole run, seconds (under 8 minutes)
mkdir -p "$out"
work=$(mktemp -d /tmp/kvs-check-XXXXXX)
begin=$SECONDS
declare -a steps=()

left() { echo $((budget - (SECONDS - begin))); }
only=",${KVS_CHECK_ONLY:-machine,tests,suites,python,cuda_bench,torch,trace,decode,spill},"
want() { [[ $only == *",$1,"* ]]; }
# step NAME LIMIT_S LOG CMD...: runs CMD with its output appended to LOG, killed after
# min(LIMIT_S, time left - 5 s); records the result line for summary.md.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local remaining
  remaining=$(($(left) - 5))
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  if [ "$limit" -le 5 ]; then
    steps+=("| $name | NOT RUN | 0 s | out of time |")
    echo "== $name: not run (out of time)" | tee -a "$log"
    return 1
  fi
  echo "== $name (limit ${limit} s)" | tee -a "$log"
  local t0=$SECONDS rc
  # bash -c: the command may be one of the functions below (exported).
  timeout -k 5 "$limit" bash -c '"$@"' step "$@" >>"$log" 2>&1
  rc=$?
  local result=PASS
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && result=TIMEOUT
  [ $rc -ne 0 ] && [ "$result" = PASS ] && result="FAIL (exit $rc)"
  steps+=("| $name | $result | $((SECONDS - t0)) s | $(basename "$log") |")
  echo "== $name: $result in $((SECONDS - t0)) s" | tee -a "$log"
  return $rc
}

# trace_summary FILE: the staging trace lines (KVS_STAGING_TRACE=1) of FILE summed per job type.
trace_summary() {
  awk '/^staging /{t=$2; n[t]++; for(i=3;i<=NF;i++){split($i,kv,"="); s[t,kv[1]]+=kv[2]}}
    END{printf "%-34s %6s %7s %9s %9s %9s %9s %9s %12s\n","job type","calls","jobs",
      "up MB","down MB","plan ms","upload ms","launch ms","wait+down ms";
    for(t in n) printf "%-34s %6d %7d %9.1f %9.1f %9.1f %9.1f %9.1f %12.1f\n",t,n[t],
      s[t,"jobs"],s[t,"up"]/1e6,s[t,"down"]/1e6,s[t,"plan_us"]/1e3,s[t,"upload_us"]/1e3,
      s[t,"launch_us"]/1e3,s[t,"wait_download_us"]/1e3}' "$1"
}
export -f trace_summary

# --- 0. unpack -----------------------------------------------------------------------------
env_log="$out/env.txt"
if [ ! -f "$archive" ]; then
  echo "no bundle at $archive (make it with deploy/gpu/bundle.sh; carry .gpu)" | tee "$env_log"
  exit 1
fi
# tar's xz filter needs the xz program; Python's lzma where it is missing.
tar -C "$work" -xf "$archive" 2>/dev/null ||
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$archive" "$work" || { echo "cannot unpack $archive" | tee "$env_log"; exit 1; }
bundle="$work/kvs-gpu-bundle"
bin="$bundle/build"
export root bundle bin work

# cuBLAS (cuda_bench only) and the driver come from this machine: the toolkit, else torch's wheels.
cublas_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  ls "$d"/libcublas.so.1[0-9]* >/dev/null 2>&1 && { cublas_dir=$d; break; }
done
if [ -z "$cublas_dir" ]; then
  for sp in $(python3 -c 'import site; print(*site.getsitepackages())' 2>/dev/null); do
    f=$(find "$sp/nvidia" -name 'libcublas.so.1[0-9]*' 2>/dev/null | head -1)
    [ -n "$f" ] && { cublas_dir=$(dirname "$f"); break; }
  done
fi
# The bundle's programs get its libraries; nothing else does (python3 with torch keeps its own).
export cublas_dir ld_path="$bundle/lib${cublas_dir:+:$cublas_dir}"
mkdir -p "$work/bin"
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$ld_path" \
  "$bin/service/kvsidecar" >"$work/bin/kvsidecar"
chmod +x "$work/bin/kvsidecar"

# --- 1. the machine --------------------------------------------------------------------------
env_info() {
  local rc=0
  date -u
  nvidia-smi || rc=1
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  echo "cublas: ${cublas_dir:-not found}"
  python3 -c 'import sys, torch, grpc, numpy; print(sys.version); print("torch", torch.__version__,
    torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0)); print("grpcio",
    grpc.__version__, "numpy", numpy.__version__)'
  python3 -c 'import google.protobuf as p; print("protobuf", p.__version__)' ||
    echo "protobuf: not installed (the bundled wheel is used)"
  python3 -c 'import json,sys; m=json.load(sys.stdin);
print("bundle commit", m["commit"], m["build"]); print(len(m["tests"]), "tests")' <"$bundle/manifest.json"
  python3 "$root/deploy/gpu/bundle_tool.py" verify "$bundle" || rc=1
  return $rc
}
export -f env_info
want machine && step "machine, bundle libraries" 40 "$env_log" env_info

# --- 2. tests from the manifest ----------------------------------------------------------------
tests_log="$out/tests.log"
want tests && step "CUDA parity, IPC, backend=auto" 100 "$tests_log" \
  python3 "$root/deploy/gpu/run_tests.py" "$bundle" "$root" --group parity --group ipc \
  --group backend --jobs 4 --timeout 90 --fail-on-skip --library-path "$ld_path" \
  --log "$out/failures.log"
want suites && step "/cuda suites" 170 "$tests_log" \
  python3 "$root/deploy/gpu/run_tests.py" "$bundle" "$root" --group cuda_suite --jobs 8 \
  --timeout 120 --deadline 160 --fail-on-skip --library-path "$ld_path" \
  --log "$out/failures.log"

# --- 3. Python CudaArena with torch ----------------------------------------------------------
py_log="$out/python.log"
python_setup() {
  local pip=(python3 -m pip install -q --no-index --no-deps --no-compile
             --disable-pip-version-check --target "$work/site")
  "${pip[@]}" "$bundle"/python/kvsidecar-*.whl "$bundle"/python/protobuf-*.whl || return 1
  # grpcio: the image's unless older than the stubs need.
  python3 -c 'import grpc, sys
sys.exit(tuple(map(int, grpc.__version__.split(".")[:2])) < (1, 66))' ||
    "${pip[@]}" "$bundle"/python/grpcio-*.whl
  PYTHONPATH="$work/site" python3 -c 'import kvsidecar, kvsidecar.v1.sidecar_pb2_grpc
import google.protobuf as p; print("client from", kvsidecar.__file__, "protobuf", p.__version__)'
}
# The whole file; its real-GPU test must have run (a skip there means torch saw no device).
arena_pytest() {
  python3 -m pytest -q -p no:cacheprovider -rA "$root/tests/clients/python/test_cuda_arena.py" |
    tee "$work/pytest.out"
  [ "${PIPESTATUS[0]}" -eq 0 ] &&
    grep -q "^PASSED .*test_torch_tensors_over_a_real_cuda_arena" "$work/pytest.out"
}
export -f python_setup arena_pytest
export PYTHONUNBUFFERED=1
if want python && step "Python client install" 40 "$py_log" python_setup; then
  export PYTHONPATH="$work/site" KVSIDECAR_BIN="$work/bin/kvsidecar"
  step "CudaArena pytest" 60 "$py_log" arena_pytest
  step "CudaArena torch check" 60 "$py_log" python3 "$root/deploy/gpu/cuda_arena_check.py" \
    --json "$work/arena.json"
  step "SidecarCache on CUDA" 90 "$py_log" python3 "$root/deploy/gpu/hf_cuda_check.py" \
    --json "$work/hf.json"
fi

# --- 4. cuda_bench -------------------------------------------------------------------------------
cuda_bench() {
  # stdbuf: each benchmark's line reaches the log as it ends, also when the step is cut off.
  LD_LIBRARY_PATH=$ld_path stdbuf -oL "$bin/bench/cuda_bench" --benchmark_out="$work/cuda_bench.json" \
    --benchmark_out_format=json || return 1
  # Google Benchmark exits 0 after a benchmark's SkipWithError: an error fails the step.
  ! grep -q '"error_occurred": true' "$work/cuda_bench.json"
}
export -f cuda_bench
want cuda_bench && step "cuda_bench" 90 "$out/cuda_bench.log" cuda_bench

# --- 5. each policy's compress vs PyTorch ----------------------------------------------------------
if { want torch || want trace; } &&
    { [ -n "${PYTHONPATH:-}" ] || python_setup >>"$py_log" 2>&1; }; then
  export PYTHONPATH="$work/site" KVSIDECAR_BIN="$work/bin/kvsidecar"
  want torch && step "compress vs PyTorch" 140 "$out/torch_bench.log" \
    python3 "$root/bench/gpu/torch_compress_bench.py" --json "$work/torch_bench.json" \
    ${KVS_CHECK_TORCH_POLICIES:+--policies "$KVS_CHECK_TORCH_POLICIES"}
  # Where a Compress's time goes: the staging layer's per-call trace (planning, upload, launch,
  # device, download) of one compress per policy, the sidecar's stderr appended to the log.
  want trace && step "staging trace" 90 "$out/torch_bench.log" env KVS_STAGING_TRACE=1 \
    python3 "$root/bench/gpu/torch_compress_bench.py" \
    --policies "${KVS_CHECK_TRACE_POLICIES:-streaming_llm,keydiff,snapkv,h2o}" \
    --repeats 1 --server-log "$work/compress_trace.txt"
  if [ -f "$work/compress_trace.txt" ]; then
    {
      awk '/^## kvsidecar stderr, policy /{if (f) close(f); f=ENVIRON["work"] "/trace_" $NF ".txt"}
           f {print > f}' "$work/compress_trace.txt"
      for f in "$work"/trace_*.txt; do
        echo "-- staging trace, one warm-up and one timed compress: ${f##*/trace_}"
        trace_summary "$f"
      done
    } >>"$out/torch_bench.log" 2>&1
  fi
fi

# --- 6. DecodeStep 64 x 32 -------------------------------------------------------------------------
decode() {
  local backend rc=0
  for backend in ${KVS_CHECK_DECODE_BACKENDS:-cuda cpu}; do
    echo "-- --backend=$backend"
    # The CUDA run keeps the server's staging trace: where a step's time goes, summed below.
    [ $backend = cuda ] && export KVS_STAGING_TRACE=1 KVS_BENCH_SERVER_LOG="$work/decode_trace.txt"
    [ $backend = cpu ] && unset KVS_STAGING_TRACE KVS_BENCH_SERVER_LOG
    LD_LIBRARY_PATH=$ld_path KVS_BENCH_BACKEND=$backend \
      KVS_BENCH_DECODE_STEPS=${KVS_CHECK_DECODE_STEPS:-50} \
      KVS_SERVER_BINARY="$bin/service/kvsidecar" stdbuf -oL "$bin/bench/service_bench" --benchmark_filter='BM_DecodeStep' \
      --benchmark_out="$work/decode_$backend.json" --benchmark_out_format=json || rc=1
    ! grep -q '"error_occurred": true' "$work/decode_$backend.json" 2>/dev/null || rc=1
  done
  return $rc
}
# The shape of each policy's DecodeStep (1, 8, 64 sequences x 4, 32 layers) and Compress on the
# GPU: one line per call (bench/rpc_counts.cc), read against the simulated device's in CI.
counts() {
  LD_LIBRARY_PATH=$ld_path KVS_SERVER_BINARY="$bin/service/kvsidecar" stdbuf -oL \
    "$bin/bench/rpc_counts" --backend=cuda ${KVS_CHECK_COUNTS_POLICIES:+--policies="$KVS_CHECK_COUNTS_POLICIES"}
}
export -f decode counts
want decode && step "DecodeStep 64x32" 70 "$out/decode.log" decode
want decode && step "calls per RPC (rpc_counts)" 60 "$out/decode.log" counts
if [ -f "$work/decode_trace.txt" ]; then  # also when the step ran out of time
  {
    echo "-- staging trace of the --backend=cuda run, summed per job type (every step, warm-up"
    echo "   included; $(grep -c '^staging ' "$work/decode_trace.txt") calls)"
    trace_summary "$work/decode_trace.txt"
  } >>"$out/decode.log" 2>&1
fi

# --- 7. spill and restore, GPU <-> host tier ----------------------------------------------------------
spill() {
  # The pool's spill/restore of one 256 MiB sequence between the CUDA arena and the host tier
  # (page-locked spill buffers), next to one cudaMemcpy of 256 MiB from page-locked and from plain
  # host memory (Arena::Read/Write).
  LD_LIBRARY_PATH=$ld_path KVS_BENCH_BACKEND=cuda stdbuf -oL "$bin/bench/storage_bench" \
    --benchmark_filter='Arena|SpillHost|RestoreHost' \
    --benchmark_out="$work/spill.json" --benchmark_out_format=json || return 1
  ! grep -q '"error_occurred": true' "$work/spill.json"
}
export -f spill
want spill && step "spill/restore GPU<->host" 60 "$out/decode.log" spill

# --- summary ---------------------------------------------------------------------------------------
{
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "# kvsidecar GPU check ($(date -u '+%F %T') UTC, ${gpu:-no GPU found})"
  echo
  echo "| step | result | time | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${steps[@]}"
  echo
  grep -h "^tests: " "$tests_log" 2>/dev/null | sed 's/^/    /'
  echo
  python3 "$root/deploy/gpu/summarize.py" "$work"
  echo
  echo "whole run: $((SECONDS - begin)) s"
} >"$out/summary.md" 2>&1
cat "$out/summary.md"
rm -rf "$work"
