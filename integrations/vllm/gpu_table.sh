#!/usr/bin/env bash
# The configurations of integrations/vllm/README.md's GPU table, by set, one process each:
#   bash integrations/vllm/gpu_table.sh SET [SET...]    (sets: smoke check bf16 8bit)
# Rows go to $OUT/rows/ (default /tmp/paged-out); `gpu_generate.py table $OUT/rows/*.json` prints them.
OUT=${OUT:-/tmp/paged-out}; mkdir -p "$OUT/rows"
here=$(dirname "$0")
one() {  # backend mode dtype kv [extra args]
  local tag=${1//:/-}-$2-$3-$4
  timeout "${RUN_TIMEOUT:-300}" python3 "$here/gpu_generate.py" run --backend "$1" --mode "$2" --dtype "$3" \
    --kv-cache-dtype "$4" --out "$OUT/rows/$tag.json" "${@:5}" > "$OUT/rows/$tag.log" 2>&1
  echo "$tag: rc $? $(tail -c 600 "$OUT/rows/$tag.log" | tail -n 1 | cut -c1-400)"
}
for set in "$@"; do case $set in
  smoke) one paged:triton-unified eager bfloat16 auto --layers 2 --prompts 8 --input-len 100 --output-len 8 ;;
  check) for b in vllm:TRITON_ATTN paged:triton-unified; do one $b eager float32 auto --prompts 32; done ;;
  bf16)  for b in paged:triton-unified vllm:TRITON_ATTN vllm:FLASH_ATTN; do one $b graphs bfloat16 auto; done ;;
  8bit)  for b in paged:triton-unified vllm:TRITON_ATTN; do one $b graphs bfloat16 fp8 --prompts 128; done
         for b in paged:triton-unified vllm:TRITON_ATTN; do one $b graphs bfloat16 int8_per_token_head --prompts 128; done ;;
esac; done
