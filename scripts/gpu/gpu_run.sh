#!/usr/bin/env bash
# The benchmark of record and the memory check, on a GPU machine without a package index:
#   bash scripts/gpu/gpu_run.sh
# Installs offline (scripts/gpu/gpu_install.sh), then runs `paged bench` (every installed backend,
# alone on the GPU) and the compute-sanitizer run, writing to $OUT: list.txt, bench.txt,
# bench.json, bench-sweep.png, bench.err, sanitize.txt. The conformance suite has its own
# script: scripts/gpu/gpu_conformance.sh.
# Knobs (environment): BENCH_ARGS, extra `paged bench` options; BENCH_S and SANITIZE_S, optional
# wall-clock limits in seconds for the two steps (unset: no limit).
set -uo pipefail
source scripts/gpu/gpu_install.sh

bounded() {  # bounded SECONDS COMMAND...: COMMAND, stopped after SECONDS if SECONDS is not empty
  local s=$1; shift
  if [ -n "$s" ]; then timeout "$s" "$@"; else "$@"; fi
}

paged list > "$OUT/list.txt" 2>&1

# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
bounded "${BENCH_S:-}" paged bench --sweep-len 4096,32768 --json "$OUT/bench.json" \
  --plot "$OUT/bench-sweep.png" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$?"

bounded "${SANITIZE_S:-}" env PAGED_AUTOTUNE=0 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/sanitize.py > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc=$?"
tail -4 "$OUT/sanitize.txt"; sed -n 1,70p "$OUT/bench.txt"
