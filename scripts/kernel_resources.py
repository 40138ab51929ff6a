"""Registers, spills, shared memory and loop instructions of the Triton kernels per config, for sm_90a, offline.

No GPU needed: Triton compiles the kernel to a cubin with its bundled ptxas and cuobjdump reads
the resource usage and the SASS. It answers "does this config spill?" and "how many instructions
does one key step cost?" before any GPU time is spent on it:
    python scripts/kernel_resources.py              # Qwen3-8B shape: bf16, d 128, group 4, block 16
    python scripts/kernel_resources.py --head-dim 256 --group 8
    python scripts/kernel_resources.py --head-dim 192 --head-dim-v 128 --group 1   # DeepSeek-V3's MLA shape
    python scripts/kernel_resources.py --tiles fused --configs 64/8/2,64/8/3
    python scripts/kernel_resources.py --tiles split   # triton-unified's split-KV kernel
    python scripts/kernel_resources.py --tiles cascade --kv bf16,int8   # cascade attention's prefix pass
    python scripts/kernel_resources.py --kv bf16,int8,fp8,int4,kivi4 --configs 128/4/2   # quantized caches, bf16 q

Loop columns: the SASS instructions of each of the kernel's loops (one BLOCK_N-key step of the
attention each), in address order. triton-unified's key ranges compile a loop each: per tile
class, the bulk of the context (no causal mask) and then the causal diagonal (masked; the
window's edge, a third, is compiled only with a window); the fused kernel lists its large
tiles' loops, then its small tiles'. Then, over all loops, the shared-memory loads of single bytes (LDS.U8/S8: 8-bit
codes gathered one at a time, as when they are converted after the layout change into the MMA
operand) and the local (spill) loads and stores. Which loop is the bulk matters: on a long
context it is nearly every step (offline, sm_90a, Triton 3.9, the 128-row prefill tile at 64
keys / 8 warps: 675 instructions in the bulk, 813 on the diagonal).

The arguments get the specialisation they get at run time (pointers and strides divisible by
16, a last-dim stride equal to 1; the kernel's do_not_specialize ints nothing), otherwise
Triton cannot vectorise the K/V loads and the numbers describe a kernel that never runs. The
Triton here may not be the one on the GPU machine (register allocation moves between
versions): compare configs, not absolutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import warnings

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("kernel_resources.py compiles for the GPU: unset TRITON_INTERPRET")

import triton
from paged_triton_unified import kernels, split_kernels, split_launch
from paged_triton_unified.launch import FUSED_BLOCK_N_SMALL
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REGISTERS_PER_SM = 65536
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _signature(fn, constexprs: dict, kv: str = "bf16") -> tuple[dict, dict]:
    names = fn.arg_names
    missing = [names[i] for i in fn.constexprs if names[i] not in constexprs]
    if missing:
        raise SystemExit(f"kernel_resources.py does not set the kernel's constexprs {missing}: add them to `base`")
    skip = {names[i] if isinstance(i, int) else i for i in (fn.do_not_specialize or ())}
    sig, attrs = {}, {}
    # fp8 codes travel as uint8; 4-bit codes two to a uint8
    cache = {"bf16": "*bf16", "int8": "*i8", "fp8": "*u8", "fp8_e5m2": "*u8", "int4": "*u8", "kivi4": "*u8"}[kv]
    for i, name in enumerate(names):
        if name.startswith("stride") and name.endswith("d"):  # a last-dim stride: 1, specialised
            constexprs[name] = 1
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in ("k_cache_ptr", "v_cache_ptr"):
                sig[name] = cache
            elif name in ("q_ptr", "out_ptr"):
                sig[name] = "*bf16"
            elif name in (
                "query_start_loc_ptr",
                "seq_lens_ptr",
                "block_table_ptr",
                "tile_end_ptr",
                "tile_end_large_ptr",
                "counter_ptr",
            ):
                sig[name] = "*i32"
            else:
                sig[name] = "*fp32"
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name] != "constexpr" and name not in skip and (name.endswith("_ptr") or name.startswith("stride")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


# Both kernels' cache-format constexprs, with bf16 q (quantized codes take fp16 dots): what the
# launchers pass.
KV_FLAGS = {
    kv: {"KV_QUANT": code, "QDOT16": code != 0}
    for kv, code in (("bf16", 0), ("int8", 1), ("fp8", 2), ("fp8_e5m2", 3), ("int4", 4), ("kivi4", 5))
}


def loop_stats(sass: str, min_len: int = 64) -> dict:
    """The loops of a cuobjdump -sass listing (a backward branch and its target) of at least
    ``min_len`` instructions, in address order: their instruction counts, and over all of them
    the single-byte shared loads and the local-memory (spill) accesses; and the instructions
    before the first of them (a program's prologue: what a short program, a small decode's split,
    pays besides its few key steps). A loop nested in another
    is counted in both. The default length keeps the key steps (hundreds of instructions) and
    leaves out small loops (a binary search over the tiles, the merge's)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    addrs = [int(a, 16) for a, _ in ins]
    loops: list[list[str]] = []
    first = len(ins)  # the index of the first loop's first instruction
    for i, (_, text) in enumerate(ins):
        m = re.search(r"\bBRA (?:\S+ )?(0x[0-9a-f]+)", text)
        if m and int(m[1], 16) <= addrs[i] and int(m[1], 16) in addrs:
            start = addrs.index(int(m[1], 16))
            body = [t for _, t in ins[start : i + 1]]
            if len(body) >= min_len:
                loops.append(body)
                first = min(first, start)
    ops = [[re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body] for body in loops]
    flat = [o for body in ops for o in body]
    return {
        "loops": [len(body) for body in ops],
        "lds8": sum(o.startswith(("LDS.U8", "LDS.S8")) for o in flat),
        "local": sum(o.startswith(("LDL", "STL")) for o in flat),
        "prologue": first if loops else None,
    }


def compile_stats(
    fn, sig: dict, constexprs: dict, attrs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None
) -> dict:
    """Compile a jitted kernel for sm_90a and read its resources and loops (see the module doc);
    ``maxnreg`` caps the registers per thread, as a ``triton.Config``'s does."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = triton.compile(
            ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sass = subprocess.run(
            [os.path.join(_BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs = int(re.search(r"REG:(\d+)", usage)[1])
    stack = int(re.search(r"STACK:(\d+)", usage)[1])
    return {
        "regs": regs,
        "spill": stack,
        "smem": kernel.metadata.shared,
        "ctas_by_regs": REGISTERS_PER_SM // (regs * 32 * num_warps),
        **loop_stats(sass),
    }


def resources(
    constexprs: dict,
    block_n: int,
    num_warps: int,
    num_stages: int,
    kernel=None,
    kv: str = "bf16",
    maxnreg: int | None = None,
) -> dict:
    fn = kernel if kernel is not None else kernels.unified_attention_kernel
    fn = getattr(fn, "fn", fn)  # the jitted kernel under the autotuner
    constexprs = {k: v for k, v in {**constexprs, **KV_FLAGS[kv], "BLOCK_N": block_n}.items() if k in fn.arg_names}
    sig, attrs = _signature(fn, constexprs, kv)
    return compile_stats(fn, sig, constexprs, attrs, num_warps, num_stages, maxnreg)


def row(r: dict) -> str:
    """The resource columns of one compiled config."""
    flag = "  SPILLS" if r["spill"] else ""
    loops = " ".join(str(n) for n in r["loops"]) or "-"
    prologue = "-" if r["prologue"] is None else str(r["prologue"])
    return (
        f"{r['regs']:5d} {r['spill']:8d} {r['smem'] / 1024:8.1f} {r['ctas_by_regs']:8d} {loops:>15s} "
        f"{r['lds8']:6d} {r['local']:5d} {prologue:>8s}{flag}"
    )


def _config(text: str) -> tuple:
    """``BLOCK_N/warps/stages[/maxnreg]`` as (BLOCK_N, warps, stages, maxnreg or None)."""
    parts = [int(x) for x in text.split("/")]
    if len(parts) not in (3, 4):
        raise ValueError(text)
    return (*parts, None)[:4]


def _uncapped(configs) -> set:
    return {(*c, None) for c in configs}


HEADER = (
    f"{'regs':>5s} {'spill B':>8s} {'smem KB':>8s} {'CTAs/SM':>8s} {'loops':>15s} {'LDS.U8':>6s} {'local':>5s} "
    f"{'prologue':>8s}"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-v", type=int, default=None, help="V's head dim (default: --head-dim)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--block-q-large", type=int, default=32, help="query tokens per large tile")
    ap.add_argument(
        "--tiles",
        default="decode,fused",
        help="which of decode, fused, split (triton-unified's split-KV kernel) and cascade (its prefix pass)",
    )
    ap.add_argument(
        "--configs",
        default="",
        help="BLOCK_N/warps/stages[/maxnreg],... (default: the search space, register caps included)",
    )
    ap.add_argument("--kv", default="bf16", help="cache formats, of bf16,int8,fp8,fp8_e5m2,int4,kivi4 (q is bf16)")
    args = ap.parse_args()
    try:
        only = {_config(c) for c in args.configs.split(",") if c}
    except ValueError as exc:
        ap.error(
            f"--configs entry {str(exc)!r}: accepted BLOCK_N/warps/stages or BLOCK_N/warps/stages/maxnreg (integers)"
        )
    group_pad = 1 << max(0, args.group - 1).bit_length()
    head_dim_pad = max(16, 1 << max(0, args.head_dim - 1).bit_length())
    head_dim_v = args.head_dim_v or args.head_dim
    head_dim_v_pad = max(16, 1 << max(0, head_dim_v - 1).bit_length())
    base = dict(
        GROUP=args.group,
        GROUP_PAD=group_pad,
        HEAD_DIM=args.head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=head_dim_v_pad,
        BLOCK_SIZE=args.block_size,
        BLOCK_Q=max(1, 16 // group_pad),
        BLOCK_Q_LARGE=args.block_q_large,
        BLOCK_N_SMALL=FUSED_BLOCK_N_SMALL,
        FOLD_SCALE=True,
        USE_WINDOW=False,
        USE_SOFTCAP=False,
        HAS_SINKS=False,
        HAS_LSE=False,
        UPCAST=False,
        DOT_PRECISION="tf32",
    )
    tiles = {
        "decode": ("decode (direct)", {"FUSED": False}, _uncapped(kernels._DECODE_CONFIGS)),
        # A batch with any prefill runs fused: its configs are timed by the large tiles.
        "fused": (
            f"fused ({args.block_q_large * group_pad}-row large)",
            {"FUSED": True},
            _uncapped(kernels._PREFILL_CONFIGS) | kernels._PREFILL_CAPPED,
        ),
    }
    split_base = dict(
        GROUP=args.group,
        GROUP_PAD=group_pad,
        BLOCK_Q=1,
        BLOCK_M=max(16, group_pad),
        HEAD_DIM=args.head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=head_dim_v_pad,
        BLOCK_SIZE=args.block_size,
        HAS_QSL=False,
        FIXED_SPLITS=False,
        USE_SOFTCAP=False,
        USE_WINDOW=False,
        UPCAST=False,
        DOT_PRECISION="tf32",
        DIRECT_OUT=False,
        FUSED_MERGE=True,
        HAS_SINKS=False,
        STORE_LSE=False,
        MERGE_PARTS_CHUNK=split_launch._MERGE_PARTS_CHUNK,
    )
    split_configs = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg) for c in split_kernels._SPLIT_CONFIGS}
    tiles["split"] = ("split-KV decode", split_base, split_configs, split_kernels.split_kv_attention_kernel)
    # Cascade attention's pass over the shared prefix, at its 64-row tiles (the split kernel's
    # constexprs it lacks are left out when it compiles).
    prefix_base = {**split_base, "BLOCK_M": 64}
    prefix_configs = {
        (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg)
        for c in split_kernels._PREFIX_CONFIGS
        if c.kwargs["BLOCK_M"] == 64
    }
    tiles["cascade"] = ("cascade prefix (64 rows)", prefix_base, prefix_configs, split_kernels.cascade_prefix_kernel)
    unknown = set(args.tiles.split(",")) - set(tiles)
    if unknown:
        ap.error(f"unknown tiles {sorted(unknown)} (accepted: {', '.join(tiles)})")
    kvs = args.kv.split(",")
    if set(kvs) - set(KV_FLAGS):
        ap.error(f"unknown --kv {sorted(set(kvs) - set(KV_FLAGS))} (accepted: {', '.join(KV_FLAGS)})")
    dims = f"head_dim {args.head_dim}" + (f"/v {head_dim_v}" if head_dim_v != args.head_dim else "")
    print(f"sm_90a, triton {triton.__version__}, {dims}, group {args.group}, block {args.block_size}, bf16 q")
    print(f"{'tile':24s} {'kv':>8s} {'BLOCK_N/warps/stages[/cap]':>26s} {HEADER}")
    for key in args.tiles.split(","):
        name, spec, configs, *kernel = tiles[key]
        for kv in kvs:
            for block_n, warps, stages, cap in sorted(only or configs, key=lambda c: (*c[:3], c[3] or 0)):
                label = f"{block_n}/{warps}/{stages}" + (f"/{cap}" if cap else "")
                try:
                    if kernel:
                        r = resources(dict(spec), block_n, warps, stages, kernel=kernel[0], kv=kv, maxnreg=cap)
                    else:
                        r = resources({**base, **spec}, block_n, warps, stages, kv=kv, maxnreg=cap)
                except Exception as exc:  # out of shared memory and the like: say so, go on
                    print(
                        f"{name:24s} {kv:>8s} {label:>26s}  {type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0][:80]}"
                    )
                    continue
                print(f"{name:24s} {kv:>8s} {label:>26s} {row(r)}")


if __name__ == "__main__":
    main()
