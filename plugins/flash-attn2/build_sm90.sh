#!/usr/bin/env bash
# Build flash-attn 2 (2.8.3) from its PyPI sdist for sm_90 (H100/H200) only, pruned to the kernels
# that paged's flash-attn2 backend calls: the *split-KV forward* kernels (the paged varlen path),
# bf16 + fp16, head dim 128 by default. Offline; no pip, no setup.py.
#
#   bash plugins/flash-attn2/build_sm90.sh [SDIST] [PREFIX]     # default PREFIX=/tmp/fa2
#   export PYTHONPATH=$PREFIX:$PYTHONPATH
#   python plugins/flash-attn2/tests/smoke_flash_attn2_gpu.py [--bench]
#
# Knobs (environment):
#   FA_HEAD_DIMS="64 96 128 256"  head-dim kernels to compile, from 32 64 96 128 192 256. A head dim d
#                             runs on flash-attn's own kernel for it (the next of those sizes >= d),
#                             as in a full build; a d whose kernel is not compiled is refused by the
#                             backend's plan() (the marker paged_pruned_build.json names the kernels).
#                             (Running d on a *larger* compiled kernel is wrong: the split-KV combine
#                             kernel lays out its accumulator rows as kHeadDim wide while flash_api
#                             allocates them round_multiple(d, 32) wide -- src/flash_fwd_kernel.h,
#                             row_offset_oaccum / Stride<Int<kHeadDim>, _1> -- so any call with
#                             num_splits > 1 mixed rows up; seen on the H200 as wrong outputs for
#                             d = 64 on a 128 kernel, single requests only.) Default: what the
#                             conformance suite's head dims need.
#   FA_DTYPES="bf16 fp16"     element types to compile.
#   MAX_JOBS=<cores>          parallel nvcc jobs (each needs ~3-6 GiB; ninja runs them).
#   FA_FULL=1                 no pruning: every kernel file of the sdist (72 files), for comparison.
#   FA_PREPARE_ONLY=1         unpack and patch, print the source list, do not compile.
#   FA_WORK=/tmp/fa2-build    scratch directory (unpacked sdist, ninja build tree).
#
# ---------------------------------------------------------------------------------------------
# Notes (read from the 2.8.3 sdist: setup.py, csrc/flash_attn/flash_api.cpp, src/static_switch.h,
# src/generate_kernels.py):
#
# * What the paged path needs. mha_varlen_fwd calls run_mha_fwd(params, stream, paged_KV) and
#   paged_KV forces the split-KV kernel (run_mha_fwd_splitkv_dispatch), so only the files
#   flash_fwd_split_hdim<D>_<dtype>[_causal]_sm80.cu matter: 4 files per head dim (bf16/fp16 x
#   causal/non-causal; non-causal is needed because flash-attn drops `causal` for max_seqlen_q == 1
#   and runs sliding windows as "local"). The "_sm80" files are the generic Ampere+ kernels that
#   run on sm_90 (FA2 has no Hopper-specific kernels; that is FA3).
# * What is pruned. The sdist has 72 kernel files: fwd (24), fwd_split (24), bwd (24). The
#   non-split forward and the backward are referenced from flash_api.cpp (run_mha_fwd_,
#   run_mha_bwd_), so dropping their files would leave undefined symbols (ImportError on load);
#   instead this script patches those two call sites into a clear TORCH_CHECK error, and
#   HEADDIM_SWITCH / FP16_SWITCH (static_switch.h) down to the compiled head dims / dtypes.
#   Result: 4 x len(FA_HEAD_DIMS) x len(FA_DTYPES)/2 kernel files + flash_api.cpp (default: 16 + 1).
#   Consequence: flash_attn_func / non-paged varlen / backward raise "not in this pruned build".
# * Compile flags: setup.py's nvcc flags, plus FLASHATTENTION_DISABLE_{ALIBI,DROPOUT,BACKWARD}
#   (flags setup.py lists, commented out): each disabled BOOL_SWITCH halves the template
#   instantiations per file. SOFTCAP, LOCAL (sliding window) and UNEVEN_K stay on: the backend
#   claims soft-capping, windows and head dims that are not a kernel size.
#   Arch: TORCH_CUDA_ARCH_LIST=9.0 -> -gencode arch=compute_90,code=sm_90 only (setup.py would use
#   FLASH_ATTN_CUDA_ARCHS="90"; its default 80;90;100;120 compiles everything 4 times).
# * Why torch.utils.cpp_extension.load instead of pip: setup.py imports `wheel`, `packaging` (and
#   `psutil` without MAX_JOBS) and first tries to download a prebuilt wheel from GitHub; the JIT
#   loader needs only torch + ninja + nvcc, and takes the source list as given.
# * The sdist: `pip download --no-deps --no-binary :all: flash-attn==2.8.3` fetches
#   flash_attn-2.8.3.tar.gz, 8.4 MB (8,447,812 bytes), 107 MB unpacked, and it *does* include
#   csrc/cutlass (CUTLASS 4.0.0, 55 MB unpacked) -- no git submodule fetch needed. (pip download
#   builds metadata after fetching: run it with FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE and
#   --no-build-isolation, or it fails for want of torch in the isolated env.) On a build machine
#   without an index, copy the tarball there. composable_kernel (AMD, 48 MB) is not unpacked.
# * Time. Measured on a 2-core CPU machine, nvcc 13.0, -std=c++20, these flags, sm_90 only:
#   flash_fwd_split_hdim128_bf16_causal_sm80.cu 169 s, flash_fwd_split_hdim128_bf16_sm80.cu 248 s
#   (non-causal adds the sliding-window variants); the patched flash_api.cpp compiles (g++, ~30 s)
#   and leaves exactly the 4 compiled run_mha_fwd_splitkv_dispatch<...> symbols undefined. On an
#   NVIDIA H200 host (2026-11-29, nvcc 13.0, torch 2.11.0+cu130, MAX_JOBS=8, beside other work)
#   head dims 128 and 256 (8 files) + flash_api.cpp compiled and linked in 464 s; each extra head
#   dim adds 4 such files. The sdist's 72 files for one arch take tens of minutes (estimate; the
#   backward files are the slowest).
# * Risks: torch 2.11's own flags/-std (torch picks -std; do not force one; c++20 was tested),
#   the final link, and the runtime. A compile error shows within the first minute: run in the
#   background and poll the log:
#     setsid nohup bash plugins/flash-attn2/build_sm90.sh SDIST > /tmp/fa2-build.log 2>&1 &
# ---------------------------------------------------------------------------------------------
set -euo pipefail

SDIST=${1:-flash_attn-2.8.3.tar.gz}
PREFIX=${2:-/tmp/fa2}
WORK=${FA_WORK:-/tmp/fa2-build}
FA_HEAD_DIMS=${FA_HEAD_DIMS:-64 96 128 256}
FA_DTYPES=${FA_DTYPES:-bf16 fp16}
FA_FULL=${FA_FULL:-0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PYTHON=${PYTHON:-python}

[ -f "$SDIST" ] || { echo "sdist not found: $SDIST (pip download --no-deps --no-binary :all: flash-attn==2.8.3)"; exit 2; }
echo "== tools"
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not found (needed unless FA_PREPARE_ONLY=1)"
command -v ninja >/dev/null && echo "ninja $(ninja --version)" || echo "ninja: not found"
$PYTHON -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "head dims: $FA_HEAD_DIMS; dtypes: $FA_DTYPES; full: $FA_FULL; MAX_JOBS=$MAX_JOBS; arch $TORCH_CUDA_ARCH_LIST"

echo "== unpack $SDIST -> $WORK"
rm -rf "$WORK" && mkdir -p "$WORK"
tar -xzf "$SDIST" -C "$WORK" --strip-components=1 --exclude='*/csrc/composable_kernel' --exclude='*/hopper'
cd "$WORK"

echo "== patch and list sources"
FA_HEAD_DIMS="$FA_HEAD_DIMS" FA_DTYPES="$FA_DTYPES" FA_FULL="$FA_FULL" $PYTHON - <<'PY'
import os, re, pathlib

dims = sorted(int(d) for d in os.environ["FA_HEAD_DIMS"].split())
dtypes = os.environ["FA_DTYPES"].split()
full = os.environ["FA_FULL"] == "1"
src = pathlib.Path("csrc/flash_attn/src")
assert set(dims) <= {32, 64, 96, 128, 192, 256}, f"FA_HEAD_DIMS {dims}: kernels exist for 32 64 96 128 192 256"
assert set(dtypes) <= {"bf16", "fp16"} and dtypes, f"FA_DTYPES {dtypes}: accepted bf16, fp16"

def replace_once(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, f"{path}: expected exactly one {old!r} (sdist version changed?)"
    path.write_text(text.replace(old, new))

if full:
    files = sorted(str(p) for p in src.glob("flash_*_sm80.cu"))
else:
    # HEADDIM_SWITCH: flash-attn's own buckets, the uncompiled ones a clear error (never a larger
    # kernel: its split-KV accumulator layout assumes kHeadDim == round_multiple(d, 32 or 64)).
    sw = src / "static_switch.h"
    text = sw.read_text()
    start = text.index("#define HEADDIM_SWITCH")
    end = text.index("}()", start) + len("}()")
    buckets = [32, 64, 96, 128, 192, 256]
    missing = 'TORCH_CHECK(false, "head dim ", HEADDIM, " is not in this pruned flash-attn build (compiled: ' + \
        " ".join(map(str, dims)) + ')");'
    branches = "".join(
        f"    {'if' if i == 0 else '} else if'} (HEADDIM <= {d}) {{ \\\n"
        + (f"      constexpr static int kHeadDim = {d}; \\\n      return __VA_ARGS__(); \\\n" if d in dims
           else f"      {missing} \\\n")
        for i, d in enumerate(buckets))
    new = ("#define HEADDIM_SWITCH(HEADDIM, ...) \\\n  [&] { \\\n"
           + branches
           + f"    }} else {{ \\\n      {missing} \\\n    }} \\\n  }}()")
    sw.write_text(text[:start] + new + text[end:])
    if dtypes != ["bf16", "fp16"] and dtypes != ["fp16", "bf16"]:
        keep_half = dtypes == ["fp16"]
        text = sw.read_text()
        start = text.index("#define FP16_SWITCH")
        end = text.index("}()", start) + len("}()")
        ok = "using elem_type = cutlass::half_t; return __VA_ARGS__();" if keep_half else \
             "using elem_type = cutlass::bfloat16_t; return __VA_ARGS__();"
        err = f'TORCH_CHECK(false, "{"bf16" if keep_half else "fp16"} is not in this pruned flash-attn build");'
        new = (f"#define FP16_SWITCH(COND, ...) \\\n  [&] {{ \\\n    if (COND) {{ {ok if keep_half else err} }} \\\n"
               f"    else {{ {err if keep_half else ok} }} \\\n  }}()")
        sw.write_text(text[:start] + new + text[end:])
    api = pathlib.Path("csrc/flash_attn/flash_api.cpp")
    replace_once(api, "run_mha_fwd_<elem_type, kHeadDim, Is_causal>(params, stream);",
                 'TORCH_CHECK(false, "pruned flash-attn build: only the split-KV (paged) forward kernels are compiled");')
    replace_once(api, "run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);",
                 'TORCH_CHECK(false, "pruned flash-attn build: no backward kernels");')
    files = [str(src / f"flash_fwd_split_hdim{d}_{t}{c}_sm80.cu") for d in dims for t in dtypes for c in ("", "_causal")]
for f in files:
    assert pathlib.Path(f).exists(), f
pathlib.Path("sources.txt").write_text("\n".join(["csrc/flash_attn/flash_api.cpp", *files]) + "\n")
print(f"{len(files)} kernel files + flash_api.cpp")
PY
cat sources.txt

if [ "${FA_PREPARE_ONLY:-0}" = 1 ]; then echo "prepared in $WORK (FA_PREPARE_ONLY=1)"; exit 0; fi

echo "== compile ($(date))"
START=$(date +%s)
mkdir -p build
FA_FULL="$FA_FULL" $PYTHON - <<'PY'
import os, pathlib
from torch.utils.cpp_extension import load

root = pathlib.Path.cwd()
sources = [str(root / s) for s in pathlib.Path("sources.txt").read_text().split()]
disable = [] if os.environ["FA_FULL"] == "1" else [
    "-DFLASHATTENTION_DISABLE_ALIBI", "-DFLASHATTENTION_DISABLE_DROPOUT", "-DFLASHATTENTION_DISABLE_BACKWARD"]
nvcc = [  # setup.py's nvcc_flags (its -std=c++17 left to torch, which knows what its headers need)
    "-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
    "--use_fast_math", *disable,
]
load(
    name="flash_attn_2_cuda",
    sources=sources,
    extra_cflags=["-O3", *disable],
    extra_cuda_cflags=nvcc,
    extra_include_paths=[str(root / "csrc/flash_attn"), str(root / "csrc/flash_attn/src"),
                         str(root / "csrc/cutlass/include")],
    build_directory=str(root / "build"),
    verbose=True,
)
PY
echo "== compiled in $(( $(date +%s) - START )) s"

echo "== install into $PREFIX"
mkdir -p "$PREFIX/flash_attn"
cp build/flash_attn_2_cuda*.so "$PREFIX/"
# flash_attn/__init__.py imports only flash_attn_interface, which imports torch and flash_attn_2_cuda.
cp flash_attn/__init__.py flash_attn/flash_attn_interface.py "$PREFIX/flash_attn/"
# What this build compiled, read by paged-flash-attn2 (backend.PRUNED_BUILD_INFO): plan() then
# refuses a head dim or dtype without a kernel here, instead of flash-attn's TORCH_CHECK mid-call.
if [ "$FA_FULL" != 1 ]; then
  FA_HEAD_DIMS="$FA_HEAD_DIMS" FA_DTYPES="$FA_DTYPES" $PYTHON -c "import json, os; print(json.dumps({
    'head_dims': sorted(int(d) for d in os.environ['FA_HEAD_DIMS'].split()),
    'dtypes': sorted(os.environ['FA_DTYPES'].split()), 'kernels': 'split-KV forward only'}))" \
    > "$PREFIX/flash_attn/paged_pruned_build.json"
fi
PYTHONPATH="$PREFIX${PYTHONPATH:+:$PYTHONPATH}" $PYTHON -c \
  "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__, 'from', flash_attn.__file__)"
echo "done: export PYTHONPATH=$PREFIX:\$PYTHONPATH"
