"""Every tolerance of the suite, in one place, with the reason for each number.

Outputs are compared with the reference computed in float64 on the same cache contents (for a
quantized cache: on the same dequantized codes), element by element:
``|out - ref| <= atol + rtol * |ref|``. The test data are unit-normal q, K and V, so outputs are
convex combinations of values of magnitude up to ~4.

:func:`assert_close_to_reference` is the one comparison; its failure message starts with
``[backend/case]`` and says how large the error was, against what tolerance, and where.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = [
    "Tolerance",
    "OUTPUT",
    "KV_DTYPE_FACTOR",
    "LSE",
    "QUANTIZED_VS_FULL_PRECISION",
    "ConformanceFailure",
    "output_tolerance",
    "lse_tolerance",
    "assert_close_to_reference",
    "locate",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise."""

    atol: float
    rtol: float

    def scaled(self, factor: float) -> Tolerance:
        return Tolerance(self.atol * factor, self.rtol * factor)

    def for_values_of(self, magnitude: float) -> Tolerance:
        """The tolerance for data ``magnitude`` times the suite's unit-normal K/V: the absolute
        part scales with the values (a rounded softmax weight errs by ``u * max|v|``), the
        relative part does not."""
        return Tolerance(self.atol * magnitude, self.rtol)

    def __str__(self) -> str:
        return f"{self.atol:.1e} + {self.rtol:.1e}*|ref|"


#: Output vs the float64 reference, per model dtype.
OUTPUT: dict[torch.dtype, Tolerance] = {
    # float16 (10-bit mantissa, unit roundoff u = 2**-11 = 4.9e-4). A flash-style kernel
    # rounds the softmax probabilities P to float16 before the P@V dot: each weight carries a
    # relative error <= u, so the output moves by <= u * max|v| ~ 2e-3 at worst (typically
    # ~1e-4); rounding the output itself adds u * |out|.
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    # bfloat16 (7-bit mantissa, u = 2**-8 = 3.9e-3): the same argument, 8x coarser; vLLM's
    # kernel tests use 1.5e-2 / 1e-2 for bf16 too.
    torch.bfloat16: Tolerance(atol=1.5e-2, rtol=1e-2),
    # float32: GPUs run float32 dots on tensor cores in TF32 (10-bit mantissa) unless told
    # otherwise (Triton's default input_precision, cuBLAS's allow_tf32), which puts a correct
    # float32 kernel at float16-like accuracy; an IEEE kernel is far inside this.
    torch.float32: Tolerance(atol=2e-3, rtol=2e-3),
}

#: Multiplier on the dtype's tolerance per cache format. A kernel reading a quantized cache may
#: round the dequantized K/V (codes * scale, exact in float32) to the model dtype before the dot:
#: one more rounding of each operand than the reference has, which at most doubles the budget.
KV_DTYPE_FACTOR: dict[str, float] = {"auto": 1.0, "int8": 2.0, "fp8": 2.0, "fp8_e5m2": 2.0, "int4": 2.0, "kivi4": 2.0}

#: Log-sum-exp (natural log, float32) vs the reference. The logits are q.k dots accumulated in
#: float32, so their error is tiny for exact float16/bfloat16 operands; TF32 dots (float32) or
#: dequantized keys rounded to the model dtype move a logit by ~u * |logit|. The LSE is ~log of
#: the context length plus the top logit, i.e. of magnitude ~5, hence the small rtol.
LSE: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(atol=2e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1.5e-2, rtol=2e-3),
    torch.float32: Tolerance(atol=2e-3, rtol=1e-3),
}

#: A quantized cache's output vs the float64 reference on the *full-precision* K/V: the price of
#: quantization itself, a stated bound rather than a rounding argument.
QUANTIZED_VS_FULL_PRECISION: dict[str, Tolerance] = {
    # int8: each element is off by at most scale/2 = max|x|/254 (~0.4% of the vector's largest
    # element). Measured with the reference (small size: the table and 300 random batches):
    # max error 3.1e-2.
    "int8": Tolerance(atol=6e-2, rtol=2e-2),
    # fp8 E4M3 (3 mantissa bits): each element is off by up to 2**-4 = 6% of itself, so a row
    # that sees a single key (a first token) is off by up to 6% of |v|. Measured as for int8:
    # max error 0.14 on |out| up to ~4.
    "fp8": Tolerance(atol=0.25, rtol=0.1),
    # fp8 E5M2 (2 mantissa bits): up to 2**-3 = 12.5% of each element, twice E4M3's bound.
    # Measured as for int8: max error 0.29 on |out| up to ~4.
    "fp8_e5m2": Tolerance(atol=0.5, rtol=0.2),
    # int4 (codes -7..7): each element is off by at most scale/2 = max|x|/14 (~7% of the
    # vector's largest element), 18x int8's step. Measured with the reference on the table's
    # int8 cases read as int4: max error 0.37 on |out| up to ~3.6.
    "int4": Tolerance(atol=0.6, rtol=0.2),
    # kivi4: int4 keys with one scale per (block, channel), values as int4. A key element is off
    # by at most half its channel's step, plus half the new step each time a later write of its
    # block raised that channel's scale. Measured as for int4: max error 0.29 on |out| up to ~3.6.
    "kivi4": Tolerance(atol=0.6, rtol=0.2),
}


def output_tolerance(dtype: torch.dtype, kv_dtype: str = "auto") -> Tolerance:
    """The tolerance of an output of ``dtype`` computed from a ``kv_dtype`` cache."""
    return OUTPUT[dtype].scaled(KV_DTYPE_FACTOR[kv_dtype])


def lse_tolerance(dtype: torch.dtype, kv_dtype: str = "auto") -> Tolerance:
    """The tolerance of a log-sum-exp computed from ``dtype`` inputs and a ``kv_dtype`` cache."""
    return LSE[dtype].scaled(KV_DTYPE_FACTOR[kv_dtype])


class ConformanceFailure(AssertionError):
    """A check failed. ``max_error``: the largest error found (``inf`` for NaN), or None when the
    failure is not a numeric one (a wrong shape, a stray write)."""

    def __init__(self, message: str, *, max_error: float | None = None, tolerance: str = "") -> None:
        super().__init__(message)
        self.max_error = max_error
        self.tolerance = tolerance


def locate(row: int, head: int, query_start_loc: Sequence[int] | None, seq_lens: Sequence[int] | None) -> str:
    """Where flat query row ``row`` is: "request 2, head 1, row 17 (token 5 of 21, position 5
    of seq_len 21)"; just "row 17, head 1" without ``query_start_loc``."""
    if query_start_loc is None:
        return f"row {row}, head {head}"
    r = max(i for i in range(len(query_start_loc) - 1) if query_start_loc[i] <= row)
    token = row - query_start_loc[r]
    qlen = query_start_loc[r + 1] - query_start_loc[r]
    where = f"request {r}, head {head}, row {row} (token {token} of {qlen}"
    if seq_lens is not None:
        s = seq_lens[r]
        where += f", position {s - qlen + token} of seq_len {s}" if s else ", a padding request"
    return where + ")"


def assert_close_to_reference(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    backend: str,
    case: str,
    tolerance: Tolerance,
    what: str = "output",
    rows: torch.Tensor | None = None,
    query_start_loc: Sequence[int] | None = None,
    seq_lens: Sequence[int] | None = None,
) -> float:
    """Assert ``out`` (any dtype) is within ``tolerance`` of ``ref``; return the max abs error.

    ``out`` and ``ref`` are ``[num_tokens, num_heads, ...]``; ``rows`` (bool ``[num_tokens]``)
    limits the comparison to some rows (e.g. not the padding ones) without renumbering them.
    With ``query_start_loc`` (and ``seq_lens``) the failure names the request, head and
    position of the largest error. NaN and inf count as infinite errors. Equal infinities (an
    LSE of ``-inf`` for a row that sees nothing) match.

    >>> ref = torch.zeros(2, 1, 3, dtype=torch.float64); out = ref.clone(); out[1, 0, 2] = 0.5
    >>> assert_close_to_reference(out, ref, backend="b", case="c",
    ...                           tolerance=Tolerance(1e-3, 0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    paged_conformance.tolerances.ConformanceFailure: [b/c] output differs from the float64 reference: \
max abs error 5.0e-01 (got 0.5, expected 0) at row 1, head 0 (tolerance 1.0e-03 + 0.0e+00*|ref|, ...
    """
    if out.shape != ref.shape:
        raise ConformanceFailure(f"[{backend}/{case}] {what} has shape {list(out.shape)}; expected {list(ref.shape)}")
    o = out.detach().to(device="cpu", dtype=torch.float64)
    e = ref.detach().to(device="cpu", dtype=torch.float64)
    if rows is not None:
        keep = rows.to("cpu").bool()
        o, e = o.clone(), e.clone()
        o[~keep] = 0.0
        e[~keep] = 0.0
    same_inf = torch.isinf(o) & torch.isinf(e) & (torch.sign(o) == torch.sign(e))
    err = (o - e).abs()
    err = torch.where(same_inf, torch.zeros_like(err), err)
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    bound = tolerance.atol + tolerance.rtol * torch.where(torch.isinf(e), torch.zeros_like(e), e.abs())
    bad = err > bound
    max_error = float(err.max()) if err.numel() else 0.0
    if not bool(bad.any()):
        return max_error
    flat = int(torch.argmax(err.flatten()))
    idx = torch.unravel_index(torch.tensor(flat), err.shape)
    row, head = int(idx[0]), int(idx[1]) if err.dim() > 1 else 0
    counted = err.numel() if rows is None else int(rows.sum()) * (err.numel() // max(err.shape[0], 1))
    finite = err[torch.isfinite(err)]
    mean = float(finite.mean()) if finite.numel() else math.inf
    got, want = float(o.flatten()[flat]), float(e.flatten()[flat])
    raise ConformanceFailure(
        f"[{backend}/{case}] {what} differs from the float64 reference: max abs error "
        f"{max_error:.1e} (got {got:.4g}, expected {want:.4g}) at "
        f"{locate(row, head, query_start_loc, seq_lens)} "
        f"(tolerance {tolerance}, exceeded by {int(bad.sum())} of {counted} elements); "
        f"mean abs error {mean:.1e}",
        max_error=max_error,
        tolerance=str(tolerance),
    )
