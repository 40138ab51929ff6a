#!/usr/bin/env bash
# The H200 run behind docs/benchmarks.md and docs/reliability.md, in one device call:
#   device run: bash scripts/gpu_run.sh   (carry: .whl, see scripts/gpu_install.sh)
# Installs offline, then `paged bench` (every installed backend, alone on the GPU) and the
# compute-sanitizer run, each bounded in time so the call ends inside the 10-minute limit.
# Logs under $OUT. The conformance suite has its own call: scripts/gpu_conformance.sh.
# Knobs: BENCH_S, SANITIZE_S (seconds), BENCH_ARGS (extra `paged bench` options).
set -uo pipefail
source scripts/gpu_install.sh
paged list > "$OUT/list.txt" 2>&1

timeout "${BENCH_S:-300}" paged bench --sweep-len 4096,32768 --json "$OUT/bench.json" \
  --plot "$OUT/bench-sweep.png" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$?"

PAGED_AUTOTUNE=0 timeout "${SANITIZE_S:-120}" compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/sanitize.py > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc=$?"
tail -4 "$OUT/sanitize.txt"; sed -n 1,70p "$OUT/bench.txt"
