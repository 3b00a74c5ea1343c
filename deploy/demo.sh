#!/usr/bin/env bash
# Sets up everything on a fresh Debian machine, starts the sidecar on embedded defaults (CPU
# backend, data in ./kvsidecar-data, ephemeral loopback ports) and runs the demo client against it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVS_BUILD_DIR:-$root/build}

"$root/deploy/install_deps.sh"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target kvsidecar kvs_demo >"$build.build.log" 2>&1 ||
  { tail -50 "$build.build.log"; exit 1; }

log=$(mktemp)
"$build/service/kvsidecar" --listen=127.0.0.1:0 --admin_listen=127.0.0.1:0 \
  --data_dir="$root/kvsidecar-data" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -f "$log"' EXIT

for _ in $(seq 1 100); do
  grep -q '^kvsidecar listening' "$log" && break
  kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
line=$(grep '^kvsidecar listening' "$log")
data=$(sed -E 's/.*data=([^ ]+).*/\1/' <<<"$line")
admin=$(sed -E 's/.*admin=([^ ]+).*/\1/' <<<"$line")
echo "sidecar: CPU backend, data plane $data, admin $admin, data dir $root/kvsidecar-data"
"$build/clients/cpp/kvs_demo" --target="$data" --admin_target="$admin"
