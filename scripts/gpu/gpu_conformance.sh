#!/usr/bin/env bash
# The whole conformance suite at full size, on a GPU machine without a package index:
#   bash scripts/gpu/gpu_conformance.sh
# Installs offline (scripts/gpu/gpu_install.sh), then runs the backends in concurrent pytest
# sessions, with pytest-xdist workers where it is installed (Triton compiles and FlashInfer's JIT
# are CPU-bound; the GPU is mostly idle), each writing $OUT/conformance-<name>.{md,json,txt}.
# Merge the reports into one matrix with `paged check --merge $OUT/conformance-*.json --report NAME`.
# If the wheels folder holds the flash-attn 2.8.3 sdist and no prebuilt copy, flash-attn is built
# first (plugins/flash-attn2/build_sm90.sh, sm_90 only) and packed as $OUT/fa2-sm90.tar.xz: put
# that file in the wheels folder and later runs unpack it instead of rebuilding.
# Knobs (environment):
#   SESSIONS    ";"-separated "name|backends|workers|pytest -k expression" (default: one session of
#               every backend); an empty workers field runs without xdist, "auto" as many workers
#               as fit: one per 5 GiB of GPU memory, shared by the sessions, at most one per CPU
#               (each worker holds 1-4 GiB: two sessions of 16 workers ran an 80 GB H100 out of
#               memory on 2026-12-07).
#   CONF_S      optional: seconds after which every session is interrupted (SIGINT); each still
#               writes the matrix of what ran, and a later run can fill in the rest (--merge).
#   TEST_S      optional: pytest-timeout's limit per test (needs pytest-timeout).
#   SESSION_JOBS  parallel compile jobs of each session's FlashInfer JIT (default 4).
#   FA_BUILD=0  never build flash-attn; FA_BUILD_S optional: a limit in seconds for the build.
set -uo pipefail
source scripts/gpu/gpu_install.sh

bounded() {  # bounded SIGNAL SECONDS COMMAND...: COMMAND, signalled after SECONDS if SECONDS is not empty
  local sig=$1 s=$2; shift 2
  if [ -n "$s" ]; then timeout -s "$sig" "$s" "$@"; else "$@"; fi
}

FA2_SDIST=$PAGED_WHEELS/flash_attn-2.8.3.tar.gz
if [ "${FA_BUILD:-1}" = 1 ] && [ -f "$FA2_SDIST" ] && [ ! -d /tmp/fa2 ]; then
  MAX_JOBS=${FA_JOBS:-$(nproc)} PYTHON=python3 bounded TERM "${FA_BUILD_S:-}" \
    bash plugins/flash-attn2/build_sm90.sh "$FA2_SDIST" /tmp/fa2 > "$OUT/fa2-build.log" 2>&1
  echo "flash-attn build rc=$?"; grep -E "compiled in|error:" "$OUT/fa2-build.log" | tail -4
  [ -d /tmp/fa2/flash_attn ] && tar -cJf "$OUT/fa2-sm90.tar.xz" -C /tmp fa2 && export PYTHONPATH=/tmp/fa2:$PYTHONPATH
fi
paged list > "$OUT/list.txt" 2>&1; cat "$OUT/list.txt"

XDIST=auto
python3 -c "import xdist" 2>/dev/null || { XDIST=; echo "pytest-xdist not installed: one worker per session"; }
IFS=';' read -ra specs <<< "${SESSIONS:-all|reference,triton-unified,flashinfer,flash-attn2|$XDIST|}"
gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
fit=$(( gib / 5 / ${#specs[@]} )); cpus=$(nproc)
fit=$(( fit < 1 ? 1 : (fit > cpus ? cpus : fit) ))
session() {  # session NAME BACKENDS WORKERS [K-EXPRESSION]
  PAGED_AUTOTUNE=0 MAX_JOBS=${SESSION_JOBS:-4} bounded INT "${CONF_S:-}" python3 -m pytest \
    --pyargs paged_conformance -p no:cacheprovider ${3:+-n "$3"} ${TEST_S:+--timeout "$TEST_S"} \
    -q -rfE --paged-size full --backends "$2" ${4:+-k "$4"} \
    --paged-report "$OUT/conformance-$1" > "$OUT/conformance-$1.txt" 2>&1
  echo "conformance $1 rc=$?: $(tail -1 "$OUT/conformance-$1.txt")"
}
for spec in "${specs[@]}"; do
  IFS='|' read -r name backends workers kexpr <<< "$spec"
  [ -z "$XDIST" ] && workers=
  [ "$workers" = auto ] && workers=$fit
  session "$name" "$backends" "$workers" "$kexpr" &
done
wait
grep -hE "^[0-9]+ passed, [0-9]+ failed" "$OUT"/conformance-*.txt
