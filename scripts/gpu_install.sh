# Source this on the offline GPU machine (device tool): installs the workspace editable and
# whatever wheels .whl/ holds (FlashInfer, see shared/GPU.md; a prebuilt flash-attn from
# .whl/fa2-sm90.tar.xz), and exports the environment they need.
#   source scripts/gpu_install.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/paged-out}; mkdir -p "$OUT"; export OUT
if [ -z "${PAGED_GPU_INSTALLED:-}" ]; then  # once per call, also when sourced twice
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_WORKSPACE_BASE=/tmp/fiws
fi
if [ -f .whl/fa2-sm90.tar.xz ]; then  # a flash-attn build from an earlier call (build_sm90.sh)
  tar -xJf .whl/fa2-sm90.tar.xz -C /tmp && export PYTHONPATH=/tmp/fa2:$PYTHONPATH
fi
python3 -m pip install -q --no-build-isolation --no-deps -e core -e conformance \
  -e plugins/triton-unified -e plugins/triton-splitkv -e plugins/flashinfer -e plugins/flash-attn2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
export PAGED_GPU_INSTALLED=1
fi
