#!/usr/bin/env bash
# Why the open speed gaps are what they are, in one GPU call (no package index needed):
#   bash scripts/gpu/gpu_investigate.sh
# Installs offline (scripts/gpu/gpu_install.sh), then, each step bounded in time:
#   1. scripts/gpu_profile.py: hardware counters (Nsight Compute) of every profile case;
#   2. scripts/prefill_ceiling.py: a minimal flash tile's rate by K/V load path, beside the product;
#   3. scripts/gpu_tune.py quant-depth small-decode: 8-bit caches (configs, split counts, static
#      and head-major scales) and small decodes (split counts x configs), at fixed configs;
#   4. paged bench on the cases those questions are about, our backends beside FlashInfer.
# Writes profile.txt, ceiling.txt, tune.txt, bench.txt/json (and the raw ncu CSVs under
# profile/) to $OUT, and prints the tables last. Knobs (seconds): PROFILE_S, CEILING_S, TUNE_S,
# BENCH_S (defaults 240, 150, 300, 240).
set -uo pipefail
source scripts/gpu/gpu_install.sh

timeout "${PROFILE_S:-240}" python3 scripts/gpu_profile.py --out "$OUT/profile" > "$OUT/profile.txt" 2>&1
echo "profile rc=$?"
timeout "${CEILING_S:-150}" python3 scripts/prefill_ceiling.py > "$OUT/ceiling.txt" 2>&1
echo "ceiling rc=$?"
timeout "${TUNE_S:-300}" python3 scripts/gpu_tune.py --deadline $(( ${TUNE_S:-300} - 30 )) quant-depth small-decode \
  > "$OUT/tune.txt" 2>&1
echo "tune rc=$?"
timeout "${BENCH_S:-240}" paged bench --cases decode,decode-int8,decode-fp8,decode-fp8-static,prefill,mixed,sweep \
  --sweep-batches 1,2,4,8 --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$?"

tail -20 "$OUT/profile.txt"; echo; cut -c1-150 "$OUT/ceiling.txt" | tail -30; echo
grep -E "^(q-depth|small)" "$OUT/tune.txt" | cut -c1-150; echo; sed -n 1,60p "$OUT/bench.txt"
