#!/usr/bin/env bash
# The whole conformance suite at full size on the GPU machine, in one device call:
#   device run: bash scripts/gpu_conformance.sh      (carry: .whl, see scripts/gpu_install.sh)
# Backends run in concurrent pytest sessions of pytest-xdist workers (Triton compiles and
# FlashInfer's JIT are CPU-bound; the GPU is mostly idle), each writing
# $OUT/conformance-<name>.{md,json,txt}. If .whl holds the flash-attn 2.8.3 sdist and no prebuilt
# copy, flash-attn is built first (plugins/flash-attn2/build_sm90.sh, bounded by FA_BUILD_S), and
# comes back as $OUT/fa2-sm90.tar.xz to carry in .whl/ next time (FA_BUILD=0: never build).
# Knobs: SESSIONS, ";"-separated "name|backends|workers|pytest -k expression" (default: one
# session of every backend); CONF_S, the seconds after which every session is interrupted (each
# still writes its matrix of what ran); CALL_S, the whole call's budget (default 570 s, inside
# the device's 600): the sessions are interrupted earlier if the install and build took long.
set -uo pipefail
START=$(date +%s)
source scripts/gpu_install.sh
FA2_SDIST=.whl/flash_attn-2.8.3.tar.gz
if [ "${FA_BUILD:-1}" = 1 ] && [ -f "$FA2_SDIST" ] && [ ! -d /tmp/fa2 ]; then
  MAX_JOBS=${FA_JOBS:-16} PYTHON=python3 timeout "${FA_BUILD_S:-500}" \
    bash plugins/flash-attn2/build_sm90.sh "$FA2_SDIST" /tmp/fa2 > "$OUT/fa2-build.log" 2>&1
  echo "flash-attn build rc=$?"; grep -E "compiled in|error:" "$OUT/fa2-build.log" | tail -4
  [ -d /tmp/fa2/flash_attn ] && tar -cJf "$OUT/fa2-sm90.tar.xz" -C /tmp fa2 && export PYTHONPATH=/tmp/fa2:$PYTHONPATH
fi
paged list > "$OUT/list.txt" 2>&1; cat "$OUT/list.txt"
LEFT=$(( ${CALL_S:-570} - ($(date +%s) - START) - 15 ))
CONF_S=$(( ${CONF_S:-420} < LEFT ? ${CONF_S:-420} : LEFT ))
if [ "$CONF_S" -lt 30 ]; then echo "no time left for the conformance sessions (CALL_S=${CALL_S:-570})"; exit 0; fi
echo "conformance sessions get ${CONF_S} s"

session() {  # session NAME BACKENDS WORKERS [K-EXPRESSION]
  PAGED_AUTOTUNE=0 MAX_JOBS=4 timeout -s INT "$CONF_S" python3 -m pytest --pyargs paged_conformance \
    -p no:cacheprovider -n "$3" --timeout 400 -q -rfE --paged-size full --backends "$2" ${4:+-k "$4"} \
    --paged-report "$OUT/conformance-$1" > "$OUT/conformance-$1.txt" 2>&1
  echo "conformance $1 rc=$?: $(tail -1 "$OUT/conformance-$1.txt")"
}
IFS=';' read -ra specs <<< "${SESSIONS:-all|reference,triton-unified,triton-splitkv,flashinfer,flash-attn2|14|}"
for spec in "${specs[@]}"; do
  IFS='|' read -r name backends workers kexpr <<< "$spec"
  session "$name" "$backends" "$workers" "$kexpr" &
done
wait
grep -hE "^[0-9]+ passed, [0-9]+ failed" "$OUT"/conformance-*.txt
