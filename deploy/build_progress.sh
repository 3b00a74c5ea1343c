#!/usr/bin/env bash
# Progress of a Ninja build whose output goes to LOG, on stderr: every INTERVAL seconds (default
# 10) while process PID runs, the last "[N/M]" line Ninja wrote as "N of M steps, T spent, about E
# left" (E from the rate so far), and nothing while no step has finished. deploy/worker_demo.sh
# runs it beside its build, whose output goes to a log file.
#   deploy/build_progress.sh LOG PID [INTERVAL] [LABEL]
set -uo pipefail
log=${1:?usage: build_progress.sh LOG PID [INTERVAL] [LABEL]}
pid=${2:?usage: build_progress.sh LOG PID [INTERVAL] [LABEL]}
interval=${3:-10}
label=${4:-build}
start=$SECONDS
clock() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }
while kill -0 "$pid" 2>/dev/null; do
  sleep "$interval"
  last=$(grep -ao '^\[[0-9]*/[0-9]*\]' "$log" 2>/dev/null | tail -n 1 | tr -d '[]')
  [ -n "$last" ] || continue
  n=${last%/*} m=${last#*/} spent=$((SECONDS - start))
  [ "$n" -gt 0 ] || continue
  echo "$label: $n of $m steps, $(clock "$spent") spent, about $(clock $((spent * (m - n) / n))) left" >&2
done
