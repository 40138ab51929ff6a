# Source this from the repository root on a GPU machine without a package index: it installs the
# workspace editable (no build isolation, no dependencies: torch, triton and pytest must already be
# there), whatever the wheels folder holds, and exports the environment they need.
#   source scripts/gpu/gpu_install.sh
# The wheels folder (PAGED_WHEELS, default .whl/) is filled beforehand on a machine with an index:
#   pip download --no-deps -d .whl flashinfer-python==0.7.4 apache-tvm-ffi   # FlashInfer
#   FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-build-isolation \
#     --no-binary :all: -d .whl flash-attn==2.8.3                            # flash-attn sdist
# plus, once built, fa2-sm90.tar.xz (a flash-attn build of plugins/flash-attn2/build_sm90.sh,
# which scripts/gpu/gpu_conformance.sh writes to $OUT). Wheels go to PAGED_SITE (default /tmp/site,
# put on PYTHONPATH), so the machine's own Python environment is left as it is.
# Logs and results go to $OUT (default /tmp/paged-out).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/paged-out}; mkdir -p "$OUT"; export OUT
PAGED_WHEELS=${PAGED_WHEELS:-.whl}; export PAGED_WHEELS
if [ -z "${PAGED_GPU_INSTALLED:-}" ]; then  # once per shell, also when sourced twice
if ls "$PAGED_WHEELS"/*.whl >/dev/null 2>&1; then
  PAGED_SITE=${PAGED_SITE:-/tmp/site}
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$PAGED_SITE" "$PAGED_WHEELS"/*.whl
  export PYTHONPATH=$PAGED_SITE${PYTHONPATH:+:$PYTHONPATH}
  # FlashInfer compiles its kernels on first use (JIT), for this GPU's architecture only.
  if [ -z "${FLASHINFER_CUDA_ARCH_LIST:-}" ]; then
    FLASHINFER_CUDA_ARCH_LIST=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); \
print(f'{m}.{n}' + ('a' if m >= 9 else ''))")
  fi
  export FLASHINFER_CUDA_ARCH_LIST MAX_JOBS=${MAX_JOBS:-$(nproc)}
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
fi
if [ -f "$PAGED_WHEELS/fa2-sm90.tar.xz" ]; then  # a flash-attn build (build_sm90.sh), unpacked to /tmp/fa2
  tar -xJf "$PAGED_WHEELS/fa2-sm90.tar.xz" -C /tmp && export PYTHONPATH=/tmp/fa2${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e core -e conformance -e bench \
  -e plugins/triton-common -e plugins/triton-unified -e plugins/triton-splitkv -e plugins/flashinfer -e plugins/flash-attn2 \
  -e integrations/transformers
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
export PAGED_GPU_INSTALLED=1
fi
