#!/usr/bin/env bash
# deploy/build_progress.sh reports "N of M steps, T spent, about E left" from a log that grows as
# a Ninja build writes it, while the build's process runs, and stops when it ends.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
(for i in 1 2 3 4; do echo "[$i/12] Building CXX object step$i.o" >>"$log"; sleep 1; done) &
out=$(bash "$root/deploy/build_progress.sh" "$log" $! 1 build 2>&1)
printf '%s\n' "$out"
lines=$(printf '%s\n' "$out" | grep -cE '^build: [1-4] of 12 steps, 0:0[0-9] spent, about [0-9]+:[0-9]{2} left$')
[ "$lines" -ge 2 ] || { echo "FAIL: expected at least 2 progress lines" >&2; exit 1; }
echo "build progress: 1 passed, 0 failed"
