#!/usr/bin/env bash
# Slim vLLM's CUDA wheel (the release scripts/gpu/vllm_gpu_requirements.txt pins) into parts that travel to an offline GPU machine (each under
# 64 MiB), for integrations/vllm/gpu_generate.py; scripts/gpu/gpu_vllm_install.sh installs them there.
# Run on a machine with a package index, from the repository root; writes .stage/{p1,p2,deps}.
# Kept: every .py file and the kernels a dense model's offline LLM.generate loads (the stable
# custom ops and FlashAttention 3, 10.9 MB once xz-compressed). Dropped: FlashAttention 2 (305 MB;
# vLLM imports it optionally and uses FA3 on Hopper), the MoE ops, the Rust front end (vllm-rs),
# CUTLASS headers and the Swagger UI. deps/ holds the imports of that path the GPU image lacks.
set -euo pipefail
REQUIREMENTS=$(dirname "$0")/vllm_gpu_requirements.txt
VLLM=$(sed -n 's/^vllm==//p' "$REQUIREMENTS")
WHEEL_DIR=${WHEEL_DIR:-/tmp/vllm-wheel}
mkdir -p "$WHEEL_DIR" .stage/p1 .stage/p2 .stage/deps
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64)
"${PIP[@]}" -d "$WHEEL_DIR" "vllm==$VLLM"
grep -v '^vllm==' "$REQUIREMENTS" > "$work/deps.txt"
"${PIP[@]}" -d .stage/deps -r "$work/deps.txt"
(cd "$work" && unzip -q "$WHEEL_DIR"/vllm-"$VLLM"-*.whl)
(cd "$work" && rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
  vllm/third_party/fmha_sm100/cutlass vllm/third_party/deep_gemm/include \
  vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so vllm/entrypoints/serve/instrumentator/static/swagger-ui-bundle.js)
tar -C "$work" -cf - --exclude=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so --exclude=vllm/_C_stable_libtorch.abi3.so \
  vllm vllm-"$VLLM".dist-info | xz -T0 -6 > .stage/p1/vllm-py.tar.xz
xz -T0 -6 -c "$work"/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so > .stage/p1/fa3.so.xz
xz -T0 -6 -c "$work"/vllm/_C_stable_libtorch.abi3.so > .stage/p2/c_stable.so.xz
du -sh .stage/p1 .stage/deps .stage/p2
