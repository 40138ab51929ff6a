#!/usr/bin/env bash
# The H200 run behind docs/benchmarks.md and docs/reliability.md, in one device call:
#   device run: bash scripts/gpu_run.sh   (carry: .whl with FlashInfer, see shared/GPU.md)
# Installs offline, then bench (every backend), the sanitizer, and FlashInfer's conformance
# subset; each stage bounded so the call ends inside the 10-minute limit. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/paged-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
fi
python3 -m pip install -q --no-build-isolation --no-deps -e core -e conformance \
  -e plugins/triton-unified -e plugins/triton-splitkv -e plugins/flashinfer -e plugins/flash-attn2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
paged list > "$OUT/list.txt" 2>&1

timeout "${BENCH_S:-280}" paged bench --sweep-len 4096,32768 --json "$OUT/bench.json" \
  --plot "$OUT/bench-sweep.png" > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$?"

PAGED_AUTOTUNE=0 timeout "${SANITIZE_S:-90}" compute-sanitizer --tool memcheck --error-exitcode 1 \
  python3 scripts/sanitize.py > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc=$?"

timeout "${CHECK_S:-150}" paged check --size full --backend flashinfer --report "$OUT/conformance-flashinfer" \
  --case bf16 --case shared_prefix --case mixed_prefill --case decode_only-long --case padding_rows \
  --case spec_verify --case first_token --case softcap --case sliding_window \
  > "$OUT/check-flashinfer.txt" 2> "$OUT/check-flashinfer.err"
echo "check rc=$?"

timeout "${GRAPH_S:-50}" python3 -m pytest -q -p no:cacheprovider plugins/flashinfer/tests -k "graph or capture" \
  > "$OUT/flashinfer-graph.txt" 2>&1
echo "flashinfer graph tests rc=$?"; tail -3 "$OUT/flashinfer-graph.txt"
tail -4 "$OUT/sanitize.txt"; tail -25 "$OUT/check-flashinfer.txt"; sed -n 1,60p "$OUT/bench.txt"
