#!/usr/bin/env bash
# The GPU bundle (deploy/gpu/bundle.sh) is self-contained: the programs of BUILD_DIR are bundled
# (no second build, no wheels, no compression), unpacked into an empty folder and
#   1. every program and library in it resolves its libraries inside the bundle's lib/ or among
#      the system C/C++ runtime (ldd with only LD_LIBRARY_PATH=<bundle>/lib; bundle_tool verify);
#   2. `kvsidecar --backend=auto` from the bundle starts on loopback with only LD_LIBRARY_PATH set,
#      falls back to the CPU backend (no CUDA driver is visible), and the bundle's `kvs_demo`
#      completes against it. Where this process may make a private mount namespace (root), the
#      run sees a /usr/lib holding only the system C/C++ runtime libraries, nothing in
#      /usr/local/lib or the CUDA toolkit: a library missing from the bundle cannot be found
#      anywhere else. Elsewhere it runs with the system libraries visible and says so.
# A negative control first removes one library kvsidecar needs from a copy of the bundle and
# expects both checks to fail.
#   tests/deploy/gpu_bundle_test.sh BUILD_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(realpath "${1:?usage: gpu_bundle_test.sh BUILD_DIR}")
work=$(mktemp -d "${TMPDIR:-/tmp}/kvs-bundle-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

start=$SECONDS
if ! "$root/deploy/gpu/bundle.sh" --build-dir "$build" --no-build --no-wheel --compress none \
    --out "$work/bundle.tar" >"$work/bundle.log" 2>&1; then
  cat "$work/bundle.log" >&2
  echo "FAIL: bundle.sh failed" >&2
  exit 1
fi
echo "bundled in $((SECONDS - start)) s: $(tail -1 "$work/bundle.log")"
mkdir "$work/empty"
tar -C "$work/empty" -xf "$work/bundle.tar"
bundle="$work/empty/kvs-gpu-bundle"
for f in manifest.json build/service/kvsidecar build/clients/cpp/kvs_demo; do
  [ -e "$bundle/$f" ] || fail "the bundle has no $f"
done

# Whether a private mount namespace is possible here (root, or unprivileged user namespaces).
isolate=()
if unshare -m --propagation private true 2>/dev/null; then
  isolate=(unshare -m --propagation private)
elif unshare -rm --propagation private true 2>/dev/null; then
  isolate=(unshare -rm --propagation private)
fi

# Runs kvsidecar --backend=auto and kvs_demo from BUNDLE with an environment of only
# LD_LIBRARY_PATH (+ a private /usr/lib of the system runtime where possible). Prints the server's
# log and the demo's output; exit 0 iff the server reported the cpu backend and the demo succeeded.
run_isolated() {
  local bundle=$1 scratch=$2
  mkdir -p "$scratch/data" "$scratch/usrlib/x86_64-linux-gnu"
  # The system C/C++ runtime, as the bundle's programs resolve it here.
  local lib
  for lib in $(ldd "$bundle/build/service/kvsidecar" "$bundle/build/clients/cpp/kvs_demo" |
      awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}' | sort -u); do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*)
        cp -L "$lib" "$scratch/usrlib/x86_64-linux-gnu/" ;;
    esac
  done
  local inner
  # shellcheck disable=SC2016  # expanded by the inner shell
  inner='
    set -u
    bundle=$1 scratch=$2 isolated=$3
    if [ "$isolated" = 1 ]; then
      for d in /usr/local/lib /usr/local/cuda/lib64 /usr/local/cuda/targets; do
        [ -d "$d" ] && mount -t tmpfs tmpfs "$d"
      done
      # Last: after this no program outside the bundle and the runtime can be loaded.
      mount --bind "$scratch/usrlib" /usr/lib || exit 3
    fi
    exec {sleeper}<> <(:)
    env -i LD_LIBRARY_PATH="$bundle/lib" "$bundle/build/service/kvsidecar" --backend=auto \
      --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0 --metrics_listen=off \
      --data_dir="$scratch/data" --shm_dir=/dev/shm >"$scratch/server.log" 2>&1 &
    server=$!
    line=""
    for ((i = 0; i < 200; i++)); do
      while IFS= read -r l; do
        [[ $l == "kvsidecar listening"* ]] && line=$l
      done <"$scratch/server.log"
      [ -n "$line" ] && break
      kill -0 $server 2>/dev/null || break
      read -t 0.1 -u $sleeper || true
    done
    echo "--- server log"; echo "$(<"$scratch/server.log")"
    if [ -z "$line" ]; then kill $server 2>/dev/null; wait $server; exit 4; fi
    [[ $line =~ data=([^ ]+) ]] && data=${BASH_REMATCH[1]}
    [[ $line =~ admin=([^ ]+) ]] && admin=${BASH_REMATCH[1]}
    echo "--- kvs_demo"
    env -i LD_LIBRARY_PATH="$bundle/lib" "$bundle/build/clients/cpp/kvs_demo" \
      --target="$data" --admin_target="$admin" 2>&1
    demo=$?
    kill $server; wait $server
    log=$(<"$scratch/server.log")
    [ $demo -eq 0 ] || exit 5
    [[ $log =~ backend.*cpu ]] || exit 6
    exit 0'
  if [ ${#isolate[@]} -gt 0 ]; then
    "${isolate[@]}" bash -c "$inner" inner "$bundle" "$scratch" 1
  else
    bash -c "$inner" inner "$bundle" "$scratch" 0
  fi
}

# Negative control: kvsidecar's first bundled library removed.
cp -a "$bundle" "$work/broken"
dropped=$(ldd "$bundle/build/service/kvsidecar" | awk -v lib="$bundle/lib/" \
  '$3 ~ /^\// {print $1}' | while read -r so; do [ -e "$bundle/lib/$so" ] && echo "$so"; done |
  head -1)
if [ -z "$dropped" ]; then
  fail "kvsidecar needs no library from the bundle's lib/ (nothing to drop)"
else
  rm "$work/broken/lib/$dropped"
  echo "negative control: $dropped removed from a copy of the bundle"
  if python3 "$root/deploy/gpu/bundle_tool.py" verify "$work/broken" >"$work/neg_verify.log" 2>&1
  then
    fail "verify accepted the bundle without $dropped"
  else
    grep -m2 "$dropped" "$work/neg_verify.log" | sed 's/^/  (expected) /'
  fi
  if [ ${#isolate[@]} -gt 0 ]; then
    if run_isolated "$work/broken" "$work/neg_run" >"$work/neg_run.log" 2>&1; then
      fail "kvsidecar served from the bundle without $dropped"
    else
      grep -m1 "$dropped" "$work/neg_run.log" | sed 's/^/  (expected) /'
    fi
  fi
fi

# The bundle itself.
if ! python3 "$root/deploy/gpu/bundle_tool.py" verify "$bundle"; then
  fail "the bundle is not self-contained (ldd above)"
fi
if [ ${#isolate[@]} -gt 0 ]; then
  echo "run: private mount namespace, /usr/lib = the system C/C++ runtime only"
else
  echo "NOTE: no private mount namespace here: the run below sees the system libraries too"
fi
if run_isolated "$bundle" "$work/run" >"$work/run.log" 2>&1; then
  grep -m1 '"backend"\|backend' "$work/run.log" | sed 's/^/  /'
  grep -m1 "^kvsidecar listening" "$work/run.log" | sed 's/^/  /'
  tail -2 "$work/run.log" | sed 's/^/  demo: /'
else
  status=$?
  cat "$work/run.log" >&2
  fail "kvsidecar --backend=auto + kvs_demo from the bundle (status $status: 3 mount, 4 no" \
       "listening line, 5 demo failed, 6 backend not cpu)"
fi
echo "total $((SECONDS - start)) s"
[ "$failures" -eq 0 ] || exit 1
echo "PASS"
