#!/usr/bin/env bash
# The whole conformance suite at full size on the GPU machine, in one device call:
#   device run: bash scripts/gpu_conformance.sh      (carry: .whl, see scripts/gpu_install.sh)
# Backends run in concurrent pytest sessions of pytest-xdist workers (Triton compiles and
# FlashInfer's JIT are CPU-bound; the GPU is mostly idle), each writing
# $OUT/conformance-<name>.{md,json,txt}. If .whl holds the flash-attn 2.8.3 sdist and no prebuilt
# copy, flash-attn is built in the background first (plugins/flash-attn2/build_sm90.sh), and
# comes back as $OUT/fa2-sm90.tar.xz to carry in .whl/ next time.
# Knobs: SESSIONS, ";"-separated "name|backends|workers|pytest -k expression" (default: one
# session of every backend); CONF_S, the seconds after which every session is interrupted (each
# still writes its matrix of what ran).
set -uo pipefail
source scripts/gpu_install.sh
FA2_SDIST=.whl/flash_attn-2.8.3.tar.gz
if [ -f "$FA2_SDIST" ] && [ ! -d /tmp/fa2 ]; then
  MAX_JOBS=${FA_JOBS:-8} PYTHON=python3 \
    bash plugins/flash-attn2/build_sm90.sh "$FA2_SDIST" /tmp/fa2 > "$OUT/fa2-build.log" 2>&1
  echo "flash-attn build rc=$?"; grep -E "compiled in|error:" "$OUT/fa2-build.log" | tail -4
  [ -d /tmp/fa2/flash_attn ] && tar -cJf "$OUT/fa2-sm90.tar.xz" -C /tmp fa2 && export PYTHONPATH=/tmp/fa2:$PYTHONPATH
fi
paged list > "$OUT/list.txt" 2>&1; cat "$OUT/list.txt"

session() {  # session NAME BACKENDS WORKERS [K-EXPRESSION]
  PAGED_AUTOTUNE=0 MAX_JOBS=4 timeout -s INT "${CONF_S:-420}" python3 -m pytest --pyargs paged_conformance \
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
