"""One GPU call: exactness of the int8/fp8 code conversion, then decode times per cache format.

    python scripts/quant_check.py              # checks, then the timing table (~2 min with autotuning)
    python scripts/quant_check.py --check      # only the checks
    python scripts/quant_check.py --time       # only the timing table (any checkout: no new API used)
    python scripts/quant_check.py --time --fixed   # the default configs, no autotuning (faster)
    TRITON_INTERPRET=1 python scripts/quant_check.py --smoke --check   # CPU: tiny shapes, plumbing only

Checks (a line each, ``ok`` or ``BAD`` with the first offending elements; exit status 1 if any):

* ``convert``: a kernel that only converts (``codes_to_dot``) a tile holding every byte value,
  shuffled, then passes it through the MMA operand layout (``I @ x``, exact), against PyTorch's
  dequantization of the same bytes, bit for bit (through the MMA, -0 reads as +0). It pinpoints
  element-order bugs (a wrong code lands next to the right one). fp8 e4m3 to bf16 maps the two
  NaN codes to +-480 (quantized caches never hold them), so those positions are left out for
  that conversion only.
* ``attention``: triton-unified (a decode-shaped batch: the small tile; a batch with prompts: the
  fused launch's large tiles) and triton-splitkv, q in bf16 and fp16, on caches whose bytes are
  uniform over all 256 values (fp8: NaN codes replaced by +-448), against the float64 reference
  on the same codes with the conformance tolerances (``paged_conformance.tolerances``).

Timing: decode 64 x 4,096 and 16 x 8,192 (Qwen3-8B attention: 32 q heads, 8 KV heads, head dim
128, 16-token blocks), bf16 q, caches bf16 / int8 / fp8, each backend's default path (autotuned;
``--fixed``: the default configs), median of CUDA-graph replays (``scripts/gpu_tune.py``'s cases
and timer), with the int8/bf16 and fp8/bf16 ratios.
"""

from __future__ import annotations

import argparse
import os
import sys

SMOKE = "--smoke" in sys.argv  # gpu_tune reads the same flag at import: tiny shapes, CPU interpreter
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import gpu_tune  # noqa: E402  (scripts/: the cases, the CUDA-graph timer, the launch wrappers)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from paged_conformance.tolerances import ConformanceFailure, assert_close_to_reference, output_tolerance  # noqa: E402
from paged_core import reference_attention  # noqa: E402
from paged_triton_splitkv.kernels import SPLIT_DEFAULT_CONFIG  # noqa: E402
from paged_triton_splitkv.launch import split_decode_attention  # noqa: E402
from paged_triton_unified import unified_attention  # noqa: E402

DEV = gpu_tune.DEV
KV_QUANT = {"int8": 1, "fp8": 2}
# triton-splitkv's default config, fixed for the checks (one compile each, no tuning run).
SPLIT_CONFIG = {"BLOCK_N": SPLIT_DEFAULT_CONFIG.kwargs["BLOCK_N"], "num_warps": SPLIT_DEFAULT_CONFIG.num_warps,
                "num_stages": SPLIT_DEFAULT_CONFIG.num_stages}
FAILED: list[str] = []


try:  # the in-register conversion; an older checkout (timing only) lacks it
    from paged_triton_unified import codes_to_dot
except ImportError:
    codes_to_dot = None


@triton.jit
def convert_kernel(src_ptr, dst_ptr, R: tl.constexpr, C: tl.constexpr, KV: tl.constexpr, F16: tl.constexpr,
                   DOT: tl.constexpr, UPCAST: tl.constexpr):
    """dst = float32(codes_to_dot(src)), [R, C] row-major; DOT: through an MMA operand first."""
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(src_ptr + offs)
    if UPCAST:  # the interpreter (which mishandles bf16) converts as its kernels do: to float32
        y = codes_to_dot(x, tl.float32, KV)
    elif F16:
        y = codes_to_dot(x, tl.float16, KV)
    else:
        y = codes_to_dot(x, tl.bfloat16, KV)
    if DOT:  # the second operand of an MMA, as K and V are: I @ y == y exactly
        eye = (tl.arange(0, R)[:, None] == tl.arange(0, R)[None, :]).to(y.dtype)
        y = tl.dot(eye, y, input_precision="ieee")
    tl.store(dst_ptr + offs, y.to(tl.float32))


def _report(name: str, ok: bool, detail: str) -> None:
    print(f"{name:62s} | {'ok ' if ok else 'BAD'} | {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def check_convert() -> None:
    if codes_to_dot is None:
        print("convert: this checkout has no paged_triton_unified.codes_to_dot; skipped", flush=True)
        return
    g = torch.Generator().manual_seed(0)
    for kv in ("int8", "fp8"):
        for f16 in (False, True):
            dtype = torch.float16 if f16 else torch.bfloat16
            for rows, cols in ((128, 128), (32, 128), (16, 64)):
                for dot in (False, True):
                    # Every byte value, rows * cols // 256 times, in a random order.
                    codes = torch.arange(256, dtype=torch.int16).repeat(rows * cols // 256)
                    codes = codes[torch.randperm(codes.numel(), generator=g)].to(torch.uint8).reshape(rows, cols)
                    view = codes.view(torch.int8) if kv == "int8" else codes.view(torch.float8_e4m3fn)
                    want = view.to(torch.float32)  # exact: every code is exact in fp16/bf16
                    src = (codes.view(torch.int8) if kv == "int8" else codes).to(DEV)
                    got = torch.empty(rows, cols, dtype=torch.float32, device=DEV)
                    convert_kernel[(1,)](src, got, R=rows, C=cols, KV=KV_QUANT[kv], F16=f16, DOT=dot, UPCAST=SMOKE)
                    got = got.cpu()
                    compared = torch.ones_like(codes, dtype=torch.bool)
                    if kv == "fp8" and (not f16 or SMOKE):
                        # NaN codes: +-480 by design (see the docstring), and in the interpreter.
                        compared = (codes & 0x7F) != 0x7F
                    same = (got == want) | (got.isnan() & want.isnan()) | ~compared
                    if not dot:  # bit for bit: the signs of zeros too (a dot's sum makes -0 +0)
                        same &= (torch.signbit(got) == torch.signbit(want)) | ~compared
                    name = f"convert {kv}->{str(dtype)[6:]} {rows}x{cols}{' via MMA' if dot else ''}"
                    if bool(same.all()):
                        _report(name, True, f"{int(compared.sum())} codes bit-exact")
                    else:
                        bad = (~same).nonzero()[:6].tolist()
                        _report(name, False, f"{int((~same).sum())} wrong, e.g. " + ", ".join(
                            f"[{r},{c}] code 0x{int(codes[r, c]):02x}: {got[r, c].item():g} (want "
                            f"{want[r, c].item():g})" for r, c in bad))


def _all_bytes_(case: gpu_tune.Case, kv: str, seed: int) -> None:
    """Overwrite the case's codes with bytes uniform over 0..255 (fp8: no NaN code) and give
    them scales that put the dequantized values at about unit size."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    c = case.cache
    for t, s in ((c.k, c.k_scale), (c.v, c.v_scale)):
        b = torch.randint(0, 256, t.shape, generator=g, device=DEV, dtype=torch.int16)
        if kv == "fp8":
            b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # 0x7f/0xff (NaN) -> 0x7e/0xfe (+-448)
        t.view(torch.uint8).copy_(b.to(torch.uint8))
        top = 128.0 if kv == "int8" else 448.0
        s.copy_((torch.rand(s.shape, generator=g, device=DEV) + 0.5) * (2.0 / top))


def _check_attention(name: str, case: gpu_tune.Case, q: torch.Tensor, out: torch.Tensor, kv: str) -> None:
    ref = reference_attention(q, case.cache, case.meta, scale=gpu_tune.SCALE, compute_dtype=torch.float64)
    tol = output_tolerance(q.dtype, kv)
    try:
        err = assert_close_to_reference(out, ref, backend=name.split()[0], case=name, tolerance=tol)
        _report(name, True, f"max err {err:.1e} (tolerance {tol})")
    except ConformanceFailure as exc:
        _report(name, False, str(exc).splitlines()[0][:300])


def check_attention() -> None:
    # Decode: contexts from 1 key (out == that key's V) to a few hundred, so a misplaced code
    # moves the output by far more than the tolerance. Prompts: causal rows see 1 .. 200 keys.
    decode = ([1] * 8, [1, 2, 17, 40, 64, 129, 300, 700])
    prompts = ([1, 1, 200, 37], [90, 300, 200, 140])
    for kv in ("int8", "fp8"):
        for qdtype in (torch.bfloat16, torch.float16):
            label = f"{kv} cache, {str(qdtype)[6:]} q"
            for shape, (qlens, slens) in (("decode tile", decode), ("large tile", prompts)):
                case = gpu_tune.make_case(qlens, slens, kv_dtype=kv, seed=7, check_reqs=[0])
                _all_bytes_(case, kv, seed=11)
                q = case.q.to(qdtype)
                out = torch.full_like(q, float("nan"))
                m, c = case.meta, case.cache
                # The default configs, fixed: one compile per check instead of a tuning run.
                unified_attention(
                    q, c.k, c.v, out, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                    block_table=m.block_table, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
                    scale=gpu_tune.SCALE, k_scale=c.k_scale, v_scale=c.v_scale, config=gpu_tune.cfg())
                _check_attention(f"triton-unified {shape}, {label}", case, q, out, kv)
                if shape == "decode tile":
                    out = torch.full_like(q, float("nan"))
                    split_decode_attention(q, c.k, c.v, out, seq_lens=m.seq_lens, block_table=m.block_table,
                                           max_seq_len=m.max_seq_len, scale=gpu_tune.SCALE, k_scale=c.k_scale,
                                           v_scale=c.v_scale, kernel_config=SPLIT_CONFIG)
                    _check_attention(f"triton-splitkv decode, {label}", case, q, out, kv)
                del case


def time_decode(fixed: bool) -> None:
    """Median CUDA-graph replay per shape, backend and cache format: autotuned (each backend's
    default path, as ``paged bench`` runs it), or with ``fixed`` the default configs."""
    shapes = [(4, 64)] if SMOKE else [(64, 4096), (16, 8192)]
    config = gpu_tune.cfg() if fixed else None
    split_config = SPLIT_CONFIG if fixed else None
    print(f"\n{'decode':12s} {'backend':15s} {'bf16 ms':>9s} {'int8 ms':>9s} {'int8/bf16':>9s} {'fp8 ms':>9s} "
          f"{'fp8/bf16':>9s}", flush=True)
    for b, n in shapes:
        ms: dict[tuple[str, str], float] = {}
        for kv in ("auto", "int8", "fp8"):
            case = gpu_tune.make_case([1] * b, [n] * b, kv_dtype=kv)
            out = torch.empty_like(case.q)
            m, c = case.meta, case.cache
            ms["triton-unified", kv] = gpu_tune.graph_ms(gpu_tune.unified(case, out, config))
            ms["triton-splitkv", kv] = gpu_tune.graph_ms(lambda case=case, out=out, m=m, c=c: split_decode_attention(
                case.q, c.k, c.v, out, seq_lens=m.seq_lens, block_table=m.block_table, max_seq_len=m.max_seq_len,
                scale=gpu_tune.SCALE, k_scale=c.k_scale, v_scale=c.v_scale, kernel_config=split_config))
            del case, out
            if not SMOKE:
                torch.cuda.empty_cache()
        for backend in ("triton-unified", "triton-splitkv"):
            bf16, i8, f8 = (ms[backend, kv] for kv in ("auto", "int8", "fp8"))
            print(f"{f'{b}x{n}':12s} {backend:15s} {bf16:9.4f} {i8:9.4f} {i8 / bf16:9.2f} {f8:9.4f} {f8 / bf16:9.2f}",
                  flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only the exactness checks")
    ap.add_argument("--time", action="store_true", help="only the timing table")
    ap.add_argument("--fixed", action="store_true",
                    help="time the default configs instead of autotuning (faster; not what paged bench runs)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (plumbing only)")
    args = ap.parse_args(argv)
    device = "CPU interpreter (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"# {device} triton {triton.__version__} torch {torch.__version__}", flush=True)
    if not args.time:
        check_convert()
        check_attention()
    if not args.check:
        time_decode(args.fixed)
    if FAILED:
        print(f"# {len(FAILED)} check(s) BAD: {', '.join(FAILED)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
