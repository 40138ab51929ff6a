#!/usr/bin/env bash
# The whole conformance suite at full size on the GPU machine, in one device call:
#   device run: bash scripts/gpu_conformance.sh      (carry: .whl, see scripts/gpu_install.sh)
# Every installed backend runs in parallel pytest-xdist workers (Triton compiles and FlashInfer's
# JIT are CPU-bound; the GPU is mostly idle). If .whl holds the flash-attn 2.8.3 sdist and no
# prebuilt copy, flash-attn is built in the background meanwhile (plugins/flash-attn2/build_sm90.sh),
# then checked too, and the build comes back as $OUT/fa2-sm90.tar.xz for later calls.
# Knobs: BACKENDS (default: every registered one but flash-attn2), JOBS (workers), CONF_S (seconds).
set -uo pipefail
source scripts/gpu_install.sh
FA2_SDIST=.whl/flash_attn-2.8.3.tar.gz
if [ -f "$FA2_SDIST" ] && [ ! -d /tmp/fa2 ]; then
  FA_HEAD_DIMS=${FA_HEAD_DIMS:-"128 256"} MAX_JOBS=${FA_JOBS:-8} PYTHON=python3 \
    bash plugins/flash-attn2/build_sm90.sh "$FA2_SDIST" /tmp/fa2 > "$OUT/fa2-build.log" 2>&1 &
  FA2_PID=$!
fi
paged list > "$OUT/list.txt" 2>&1; cat "$OUT/list.txt"

conformance() {  # conformance NAME BACKENDS SECONDS
  PAGED_AUTOTUNE=0 timeout -s INT "$3" python3 -m pytest --pyargs paged_conformance -p no:cacheprovider \
    -n "${JOBS:-10}" --timeout 300 -q -rfE --paged-size full --backends "$2" \
    --paged-report "$OUT/conformance-$1" > "$OUT/conformance-$1.txt" 2>&1
  echo "conformance $1 rc=$?"; tail -4 "$OUT/conformance-$1.txt"
}
MAX_JOBS=4 conformance h200 "${BACKENDS:-reference,triton-unified,triton-splitkv,flashinfer}" "${CONF_S:-330}"

if [ -n "${FA2_PID:-}" ]; then
  for _ in $(seq 1 "${FA2_WAIT_S:-90}"); do kill -0 "$FA2_PID" 2>/dev/null || break; sleep 1; done
  wait "$FA2_PID"; echo "flash-attn build rc=$?"; grep -E "^== |compiled in|Error|error:" "$OUT/fa2-build.log" | tail -8
  if [ -d /tmp/fa2/flash_attn ]; then
    tar -cJf "$OUT/fa2-sm90.tar.xz" -C /tmp fa2 && ls -la "$OUT/fa2-sm90.tar.xz"
    export PYTHONPATH=/tmp/fa2:$PYTHONPATH
    paged list 2>&1 | grep flash-attn2
    JOBS=8 conformance h200-flash-attn2 flash-attn2 "${FA2_CONF_S:-100}"
  fi
fi
grep -E "passed|failed" "$OUT"/conformance-*.txt | tail -4
