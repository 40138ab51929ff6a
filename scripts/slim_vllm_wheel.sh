#!/usr/bin/env bash
# Slim vLLM 0.26.0's CUDA wheel into parts that travel to an offline GPU machine (each under
# 64 MiB), for integrations/vllm/gpu_generate.py; scripts/gpu_vllm_install.sh installs them there.
# Run on a machine with a package index, from the repository root; writes .stage/{p1,p2,deps}.
# Kept: every .py file and the kernels a dense model's offline LLM.generate loads (the stable
# custom ops and FlashAttention 3, 10.9 MB once xz-compressed). Dropped: FlashAttention 2 (305 MB;
# vLLM imports it optionally and uses FA3 on Hopper), the MoE ops, the Rust front end (vllm-rs),
# CUTLASS headers and the Swagger UI. deps/ holds the imports of that path the GPU image lacks.
set -euo pipefail
WHEEL_DIR=${WHEEL_DIR:-/tmp/vllm-wheel}
mkdir -p "$WHEEL_DIR" .stage/p1 .stage/p2 .stage/deps
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
     --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64)
"${PIP[@]}" -d "$WHEEL_DIR" vllm==0.26.0
"${PIP[@]}" -d .stage/deps "pydantic==2.12.5" "pydantic-core==2.41.5" annotated-types typing-inspection \
  msgspec pyzmq cbor2 cachetools "openai==2.8.1" jiter distro sniffio openai-harmony pybase64 \
  "llguidance>=1.7,<1.8" "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2" "fastapi==0.136.3" \
  "starlette>=1.0.1,<1.11" partial-json-parser blake3 "typing-extensions>=4.14"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
(cd "$work" && unzip -q "$WHEEL_DIR"/vllm-0.26.0-*.whl)
(cd "$work" && rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
  vllm/third_party/fmha_sm100/cutlass vllm/third_party/deep_gemm/include \
  vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so vllm/entrypoints/serve/instrumentator/static/swagger-ui-bundle.js)
tar -C "$work" -cf - --exclude=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so --exclude=vllm/_C_stable_libtorch.abi3.so \
  vllm vllm-0.26.0.dist-info | xz -T0 -6 > .stage/p1/vllm-py.tar.xz
xz -T0 -6 -c "$work"/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so > .stage/p1/fa3.so.xz
xz -T0 -6 -c "$work"/vllm/_C_stable_libtorch.abi3.so > .stage/p2/c_stable.so.xz
du -sh .stage/p1 .stage/deps .stage/p2
