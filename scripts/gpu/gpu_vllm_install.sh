# Source from the repository root on the offline GPU machine: installs the slimmed vLLM that
# scripts/gpu/slim_vllm_wheel.sh made, from whichever parts .stage/ holds (p1 with deps/, then p2, in
# consecutive calls on a warm machine), into /tmp/vllm-site, and the workspace with paged-vllm.
# Once both parts are in, it imports vLLM's LLM, and fails (status 1) with the pins to fix if
# that import does.
SITE=/tmp/vllm-site; mkdir -p $SITE
if [ -f .stage/p1/vllm-py.tar.xz ] && [ ! -f $SITE/.p1 ]; then
  tar -xJf .stage/p1/vllm-py.tar.xz -C $SITE
  xz -dc .stage/p1/fa3.so.xz > $SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .stage/deps/*.whl && touch $SITE/.p1
fi
if [ -f .stage/p2/c_stable.so.xz ] && [ ! -f $SITE/.p2 ]; then
  xz -dc .stage/p2/c_stable.so.xz > $SITE/vllm/_C_stable_libtorch.abi3.so && touch $SITE/.p2
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e core -e plugins/triton-unified \
  -e plugins/triton-splitkv -e integrations/vllm $(ls -d plugins/triton-common 2>/dev/null | sed 's/^/-e /')
ls $SITE/.p1 $SITE/.p2 2>/dev/null
if [ -f $SITE/.p1 ] && [ -f $SITE/.p2 ] && ! python3 -c "from vllm import LLM"; then
  echo "gpu_vllm_install.sh: 'from vllm import LLM' failed (traceback above) with the packages of" \
    "scripts/gpu/vllm_gpu_requirements.txt; fix the pin of the package the ImportError names there," \
    "run scripts/gpu/slim_vllm_wheel.sh again, then rm -rf $SITE and install again" >&2
  return 1 2>/dev/null || exit 1  # sourced: return; run with bash: exit
fi
