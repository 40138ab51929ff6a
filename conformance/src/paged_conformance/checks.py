"""The checks, as plain functions of ``(backend, case, device)``.

The pytest tests (``test_conformance.py``) and ``paged check`` (``runner.py``) call the same
functions through :func:`run`, so they reach the same verdict. A check returns a
:class:`CheckResult` when the backend conforms, raises :class:`~.tolerances.ConformanceFailure`
(an ``AssertionError``) when it does not, and :class:`NotApplicable` with the backend's own
reasons when the backend does not claim what the check needs (or, for a case with a strided
cache or ``sinks`` view, refuses the view with an ``UnsupportedSpecError``).

=========================  =====================================================================
check                      what it proves
=========================  =====================================================================
matches_reference          output within the dtype's tolerance of the float64 reference; every
                           row written (``out=`` is poisoned with NaN first); padding rows exact
                           zeros; K/V of the step written with ``backend.write`` first
lse_matches_reference      the log-sum-exp, for backends that return one: natural log, float32
                           ``[num_tokens, num_heads]``, ``-inf`` exactly where nothing is seen
close_to_full_precision    a quantized cache's output within a stated bound of the reference on
                           the full-precision K/V (equality on the dequantized values is
                           ``matches_reference``: the reference reads the same codes)
write_then_read            ``backend.write`` puts each token at its ``slot_mapping`` slot (read
                           back: exact, or within one code for quantized caches) and touches no
                           other byte: padding rows (slot -1) write nothing
batch_invariance           each request run alone equals its rows in the batch: bitwise if the
                           backend declares ``batch_invariant``, else within tolerance (in
                           batches of more than 16 requests: the first, the last and those at
                           the index boundaries 31-33, 127-129, 255-256)
cuda_graph_replay          (GPU, ``cuda_graphs``) a captured ``forward`` replayed on new q equals
                           an eager call
plan_captured_with_forward (GPU, ``cuda_graphs`` and ``device_plan``) plan + forward captured in
                           one graph on another batch of the same shape, replayed after
                           ``BatchMeta.copy_`` of the case's batch: equal to the reference
non_finite_stays_in_its_slot
                           a NaN / -inf written into one slot: write_kv's bytes, NaN exactly in the
                           rows that read it, every other row equal to the reference (one decode
                           case per cache format)
scale_floor                a row of the dtype's smallest subnormal and zeros reads back finite
                           (scales floored), with write_kv's bytes
kivi4_grown_token_by_token
                           a kivi4 block written one token per write: write_kv's bytes after each
                           write, keys within docs/quantization.md's bound for grown blocks
random_batches             hypothesis draws batches, shapes and features within the backend's
                           capabilities and runs ``matches_reference`` on each
=========================  =====================================================================
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from paged_core import (
    PER_CHANNEL_KEYS,
    Q_MAX,
    Backend,
    BatchMeta,
    Capabilities,
    InputError,
    KVCache,
    UnsupportedSpecError,
    dequantize_kv,
    reference_attention,
    write_kv,
)

from .backends import BackendPool
from .cases import Case
from .tolerances import (
    QUANTIZED_VS_FULL_PRECISION,
    ConformanceFailure,
    Tolerance,
    assert_close_to_reference,
    locate,
    lse_tolerance,
    output_tolerance,
)
from .workload import Workload, build_workload, clear_workloads, storage

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

_T = TypeVar("_T")

__all__ = [
    "CHECKS",
    "RANDOM_BATCHES",
    "Check",
    "CheckResult",
    "NotApplicable",
    "applicable_checks",
    "check_batch_invariance",
    "check_close_to_full_precision",
    "check_cuda_graph_replay",
    "check_lse_matches_reference",
    "check_matches_reference",
    "check_plan_captured_with_forward",
    "check_random_batches",
    "check_write_then_read",
    "run",
]


class NotApplicable(Exception):
    """The backend does not claim what the check needs; ``reasons`` are its own sentences."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """A passed check: the largest error it measured (vs the reference, or between runs)."""

    max_error: float | None = None
    note: str = ""
    #: The block size the case ran at when it is not the case's own (see ``run``), else None.
    block_size: int | None = None


def _forward(
    backend: Backend,
    wl: Workload,
    cache: KVCache,
    *,
    q: torch.Tensor | None = None,
    meta: BatchMeta | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> Any:
    """One attention call the way an engine makes it: plan once, then forward."""
    meta = wl.meta if meta is None else meta
    plan = backend.plan(meta)
    return backend.forward(
        wl.q if q is None else q,
        cache,
        plan,
        scale=wl.case.scale,
        window=wl.case.window,
        softcap=wl.case.softcap,
        sinks=wl.sinks,
        out=out,
        return_lse=return_lse,
    )


def _step(backend: Backend, wl: Workload) -> KVCache:
    """A cache holding the context, with this step's K/V written by the backend itself."""
    cache = wl.fresh_cache(backend)
    backend.write(cache, wl.k_new, wl.v_new, wl.meta)
    return cache


def _poisoned(wl: Workload) -> torch.Tensor:
    """An ``out=`` of the call's output shape (V's head dim), all NaN."""
    n, hq, _ = wl.q.shape
    return torch.full((n, hq, wl.case.dim_v), math.nan, dtype=wl.q.dtype, device=wl.device)


def _where(wl: Workload, row: int, head: int) -> str:
    return locate(row, head, wl.query_start_loc, wl.seq_lens)


def _assert_padding_zero(out: torch.Tensor, wl: Workload, name: str, what: str = "output") -> None:
    pad_rows = wl.padding_rows.nonzero().squeeze(1).to(out.device)
    vals = out[pad_rows].float()  # [padding rows, num_heads, head_dim]
    bad = vals != 0  # NaN != 0 too
    if not bool(bad.any()):
        return
    p, head, _ = (int(i) for i in bad.nonzero()[0])
    row = int(pad_rows[p])
    raise ConformanceFailure(
        f"[{name}/{wl.case.id}] padding rows (requests with seq_len 0) must be exact zeros; "
        f"{int(bad.sum())} of {vals.numel()} {what} elements are not, the first at "
        f"{_where(wl, row, head)} (value {vals[p, head][bad[p, head]][0].item()!r})",
        max_error=float(vals.abs().nan_to_num(math.inf).max()),
    )


def _against_reference(
    out: torch.Tensor,
    ref: torch.Tensor,
    wl: Workload,
    case: Case,
    name: str,
    *,
    what: str = "output",
    tolerance: Tolerance | None = None,
) -> float:
    """:func:`assert_close_to_reference` over the workload's real rows (padding left out), with
    the case's output tolerance unless given; returns the max abs error."""
    return assert_close_to_reference(
        out,
        ref,
        backend=name,
        case=case.id,
        what=what,
        tolerance=output_tolerance(case.dtype, case.kv_dtype) if tolerance is None else tolerance,
        rows=~wl.padding_rows,
        query_start_loc=wl.query_start_loc,
        seq_lens=wl.seq_lens,
    )


def _assert_rows_written(out: torch.Tensor, wl: Workload, name: str) -> None:
    """No NaN left from the poisoned ``out=`` (or computed) in a real request's rows."""
    real = ~wl.padding_rows.to(out.device)
    nan = torch.isnan(out) & real[:, None, None]
    if not bool(nan.any()):
        return
    row, head, _ = (int(i) for i in nan.nonzero()[0])
    rows = int(nan.reshape(nan.shape[0], -1).any(1).sum())
    raise ConformanceFailure(
        f"[{name}/{wl.case.id}] {rows} output rows hold NaN, the first at {_where(wl, row, head)}: "
        "not written (out= was filled with NaN before the call) or computed as NaN",
        max_error=math.inf,
    )


# --------------------------------------------------------------------------------- checks
def check_matches_reference(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """Output vs the float64 reference; every row written; padding rows exact zeros."""
    wl = build_workload(case, device)
    cache = _step(backend, wl)
    out = _poisoned(wl)
    result = _forward(backend, wl, cache, out=out)
    if result.data_ptr() != out.data_ptr():
        raise ConformanceFailure(
            f"[{backend.name}/{case.id}] forward(out=...) returned another tensor instead of writing into out"
        )
    _assert_padding_zero(out, wl, backend.name)
    _assert_rows_written(out, wl, backend.name)
    err = _against_reference(out, wl.ref_out, wl, case, backend.name)
    return CheckResult(max_error=err)


def check_lse_matches_reference(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """The log-sum-exp: float32 [num_tokens, num_heads], natural log, -inf where nothing is seen."""
    wl = build_workload(case, device)
    cache = _step(backend, wl)
    out, lse = _forward(backend, wl, cache, out=_poisoned(wl), return_lse=True)
    want = (case.num_tokens, case.num_heads)
    if lse.dtype != torch.float32 or tuple(lse.shape) != want:
        raise ConformanceFailure(
            f"[{backend.name}/{case.id}] lse is {lse.dtype} {list(lse.shape)}; the convention is "
            f"float32 {list(want)} (num_tokens, num_heads), natural log"
        )
    err = assert_close_to_reference(
        lse,
        wl.ref_lse,
        backend=backend.name,
        case=case.id,
        what="lse",
        tolerance=lse_tolerance(case.dtype, case.kv_dtype),
        query_start_loc=wl.query_start_loc,
        seq_lens=wl.seq_lens,
    )
    # The output must not change when the LSE is asked for.
    _assert_padding_zero(out, wl, backend.name)
    _against_reference(out, wl.ref_out, wl, case, backend.name, what="output (with return_lse=True)")
    return CheckResult(max_error=err)


def check_close_to_full_precision(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """A quantized cache's output stays within a stated bound of full-precision attention."""
    wl = build_workload(case, device)
    full = build_workload(dataclasses.replace(case, kv_dtype="auto", kv_scales="per_slot"), device)
    out = _forward(backend, wl, _step(backend, wl))
    err = _against_reference(
        out,
        full.ref_out,
        wl,
        case,
        backend.name,
        what=f"output on the {case.kv_dtype} cache (vs full-precision K/V)",
        tolerance=_quantization_bound(case, wl, full),
    )
    return CheckResult(max_error=err)


def _quantization_bound(case: Case, wl: Workload, full: Workload) -> Tolerance:
    """The stated bound for the case's format. It is stated for per-slot scales; int8 with static
    scales rounds to a coarser step (one scale covers every token's largest element, a per-slot
    scale only its own vector's), so its bound grows by how much coarser the largest static step is
    than the median per-slot step on this data (about 3x for the suite's scales). fp8 rounds
    relative to each element, so its static scales keep the bound."""
    bound = QUANTIZED_VS_FULL_PRECISION[case.kv_dtype]
    if wl.static_scales is None or case.kv_dtype != "int8":
        return bound
    per_slot_steps = torch.cat([t.abs().amax(-1).flatten() for t in (full.k_new, full.v_new)]) / Q_MAX["int8"]
    static_step = max(float(s.max()) for s in wl.static_scales)
    return bound.scaled(max(1.0, static_step / float(per_slot_steps.float().median())))


def _per_channel_write_is_write_kv(backend: Backend, wl: Workload, cache: KVCache, tag: str) -> CheckResult:
    """A write to a cache whose key scales are per block and channel (``kivi4``) rescales the
    written blocks' earlier keys, so it is defined by what ``paged_core.write_kv`` stores: the
    backend's write must leave every byte as write_kv leaves it (the other blocks untouched)."""
    want = wl.fresh_cache(backend)
    write_kv(want, wl.k_new, wl.v_new, wl.meta.slot_mapping)
    for name, t in storage(cache).items():
        ref = storage(want)[name]
        if not torch.equal(t, ref):
            where = (t != ref).nonzero()[0].tolist()
            raise ConformanceFailure(
                f"{tag} write() of a {wl.case.kv_dtype} cache left cache.{name} different from "
                f"paged_core.write_kv's at index {where}; its writes rescale each written block's keys, "
                "and a backend's write must store exactly what write_kv stores"
            )
    return CheckResult(max_error=0.0)


#: One code of each fp8 format: (relative spacing of its normals, 2**-mantissa bits; the
#: spacing of its subnormals).
_FP8_STEP = {"fp8": (2**-3, 2**-9), "fp8_e5m2": (2**-2, 2**-16)}


def check_write_then_read(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """``backend.write`` lands each token at its slot and touches nothing else."""
    wl = build_workload(case, device)
    cache = wl.fresh_cache(backend)
    before = {n: t.clone() for n, t in storage(cache).items()}
    backend.write(cache, wl.k_new, wl.v_new, wl.meta)
    tag = f"[{backend.name}/{case.id}]"
    if case.kv_dtype in PER_CHANNEL_KEYS:
        return _per_channel_write_is_write_kv(backend, wl, cache, tag)
    after = storage(cache)
    slot_mapping = wl.meta.slot_mapping.cpu()
    src_rows = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[src_rows]
    num_slots = wl.num_blocks * case.block_size

    # 1. Nothing outside this step's slots changed: padding rows (slot -1) write nothing.
    for name, t in after.items():
        changed = (t != before[name]).reshape(num_slots, -1).any(1).cpu()
        changed[slots] = False
        if bool(changed.any()):
            slot = int(changed.nonzero()[0, 0])
            raise ConformanceFailure(
                f"{tag} write() changed cache.{name} in {int(changed.sum())} slot(s) that no token of "
                f"this step maps to, the first slot {slot} (block {slot // case.block_size}, offset "
                f"{slot % case.block_size}); padding rows have slot -1 and must not be written"
            )

    # 2. Read the written slots back.
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(num_slots, *t.shape[2:])[slots.to(t.device)]

    k_src, v_src = wl.k_new[src_rows.to(wl.device)], wl.v_new[src_rows.to(wl.device)]
    if not cache.quantized:
        for name, t, src in (("k", cache.k, k_src), ("v", cache.v, v_src)):
            got = rows(t)
            if not torch.equal(got, src):
                diff = (got.double() - src.double()).abs()
                tok = int(diff.reshape(diff.shape[0], -1).amax(1).argmax())
                raise ConformanceFailure(
                    f"{tag} cache.{name} read back through slot_mapping differs from what was written: "
                    f"max abs difference {float(diff.max()):.1e} at token row {int(src_rows[tok])} "
                    f"(slot {int(slots[tok])}); a full-precision cache must store values exactly",
                    max_error=float(diff.max()),
                )
        return CheckResult(max_error=0.0)

    # Quantized: the scales as paged_core computes them (max|x| / q_max, float32), or the static
    # scales left as they were, and each dequantized element within one code of paged_core's own
    # quantization of the same row.
    ref = wl.cache_after
    # A quantized cache has both scales (KVCache.check refuses one without).
    assert cache.k_scale is not None and cache.v_scale is not None
    assert ref.k_scale is not None and ref.v_scale is not None
    if wl.static_scales is not None:
        for name, fixed, want in (
            ("k_scale", cache.k_scale, wl.static_scales[0]),
            ("v_scale", cache.v_scale, wl.static_scales[1]),
        ):
            if not cache.static_scales or not torch.equal(fixed[0, 0], want.expand(case.num_kv_heads)):
                raise ConformanceFailure(
                    f"{tag} write() changed the static cache.{name} (it holds {fixed[0, 0].tolist()}, "
                    f"was {want.tolist()}); static scales are fixed: writes quantize with them"
                )
    worst = 0.0
    for name, codes, scale, ref_codes, ref_scale, src in (
        ("k", cache.k, cache.k_scale, ref.k, ref.k_scale, k_src),
        ("v", cache.v, cache.v_scale, ref.v, ref.v_scale, v_src),
    ):
        got_scale, want_scale = rows(scale).double(), rows(ref_scale).double()
        if wl.static_scales is None and not torch.allclose(got_scale, want_scale, rtol=1e-5, atol=0):
            raise ConformanceFailure(
                f"{tag} cache.{name}_scale read back differs from max|x| / {Q_MAX[case.kv_dtype]:g} "
                f"per (token, KV head): max relative error "
                f"{float(((got_scale - want_scale).abs() / want_scale).max()):.1e} (tolerance 1e-5)",
                max_error=float((got_scale - want_scale).abs().max()),
            )
        got = dequantize_kv(rows(codes), rows(scale)).double()
        want = dequantize_kv(rows(ref_codes), rows(ref_scale)).double()
        # One code step: the scale for int8 and int4; for fp8 one ulp (2**-m relative for m mantissa
        # bits, plus the subnormal spacing in units of the scale).
        if case.kv_dtype in ("int8", "int4"):
            step = want_scale[..., None] * (1 + 1e-5)
        else:
            ulp, subnormal = _FP8_STEP[case.kv_dtype]
            step = want.abs() * ulp + want_scale[..., None] * subnormal
        diff = (got - want).abs()
        if bool((diff > step).any()):
            raise ConformanceFailure(
                f"{tag} cache.{name} read back (dequantized) is more than one code away from "
                f"paged_core.quantize_kv of the written values: max abs difference {float(diff.max()):.1e}",
                max_error=float(diff.max()),
            )
        worst = max(worst, float((got - src.double()).abs().max()) if got.numel() else 0.0)
    return CheckResult(max_error=worst, note="max |dequantized - written|")


#: One decode case per cache format with per-slot scales: where non-finite input and tiny rows
#: are written. Static scales are left out: int8/int4 have neither a NaN code nor a scale of the
#: slot's own (docs/reliability.md §4), and static fp8 keeps the NaN in the element's code, which
#: the Triton tiles (fp8 codes converted by bit arithmetic) still read as a finite value.
NON_FINITE_CASES = frozenset(
    {
        "decode_only",
        "kv_int8-decode_only",
        "kv_fp8-decode_only",
        "kv_fp8_e5m2-decode_only",
        "kv_int4-decode_only",
        "kv_kivi4-decode_only",
    }
)


def _same_bytes_as_write_kv(
    backend: Backend, wl: Workload, cache: KVCache, k: torch.Tensor, v: torch.Tensor, tag: str, what: str
) -> None:
    want = wl.fresh_cache(backend)
    write_kv(want, k, v, wl.meta.slot_mapping)
    for name, t in storage(cache).items():
        ref = storage(want)[name]
        # Bitwise, NaN included (fp8 codes are bytes already; a NaN scale is one bit pattern).
        a, b = (x.view(torch.int32) if x.dtype == torch.float32 else x for x in (t, ref))
        if not torch.equal(a, b):
            where = (a != b).nonzero()[0].tolist()
            raise ConformanceFailure(
                f"{tag} write() of {what} left cache.{name} different from paged_core.write_kv's at "
                f"index {where}; every write path must store the same bytes (docs/reliability.md §4)"
            )


def check_non_finite_stays_in_its_slot(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """A NaN or -inf written into one slot (one KV head) reaches exactly the rows that read it.

    The first real request's newest key gets -inf in KV head 0 (NaN for a full-precision cache,
    where -inf may legitimately be ignored by a positive query element), the second request's
    newest value NaN in its last KV head. ``backend.write`` must store write_kv's bytes; the
    output rows of those requests' query heads of that KV head must hold NaN (decode: every row
    sees its newest key) and every other row must match the reference on the clean data."""
    wl = build_workload(case, device)
    tag = f"[{backend.name}/{case.id}]"
    real = case.real_requests
    group = case.num_heads // case.num_kv_heads
    k, v = wl.k_new.clone(), wl.v_new.clone()
    expect = torch.zeros(wl.q.shape[:2], dtype=torch.bool)
    for i, (r, head, tensor, value) in enumerate(
        (
            (real[0], 0, k, -math.inf if case.kv_dtype != "auto" else math.nan),
            (real[-1], case.num_kv_heads - 1, v, math.nan),
        )
    ):
        if i == 1 and r == real[0]:
            break
        rows = wl.rows_of(r)
        tensor[rows.stop - 1, head, i] = value
        expect[rows, head * group : (head + 1) * group] = True
    cache = wl.fresh_cache(backend)
    backend.write(cache, k, v, wl.meta)
    _same_bytes_as_write_kv(backend, wl, cache, k, v, tag, "non-finite K/V")
    out = _forward(backend, wl, cache)
    got = torch.isnan(out).any(-1).cpu()
    if not torch.equal(got, expect):
        diff = (got != expect).nonzero()[0].tolist()
        want = "NaN" if bool(expect[diff[0], diff[1]]) else "finite"
        raise ConformanceFailure(
            f"{tag} a non-finite element written into one slot must make exactly the rows that read it NaN "
            f"(as a full-precision cache does) and no other: {_where(wl, diff[0], diff[1])} should be {want}",
            max_error=math.inf,
        )
    clean = out.clone()
    clean[expect.to(out.device)] = wl.ref_out[expect.to(out.device)].to(out.dtype)
    err = _against_reference(clean, wl.ref_out, wl, case, backend.name)
    return CheckResult(max_error=err, note="NaN exactly in the rows reading the slot")


def check_scale_floor(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """A key and a value of the dtype's smallest subnormal and zeros (max / q_max underflows)
    read back finite: every write path floors its scales; and the bytes are write_kv's."""
    wl = build_workload(case, device)
    tag = f"[{backend.name}/{case.id}]"
    tiny = torch.finfo(case.dtype).smallest_normal * torch.finfo(case.dtype).eps
    k, v = wl.k_new.clone(), wl.v_new.clone()
    last = wl.rows_of(case.real_requests[0]).stop - 1
    for t in (k, v):
        t[last] = 0
        t[last, :, 0] = tiny
    cache = wl.fresh_cache(backend)
    backend.write(cache, k, v, wl.meta)
    _same_bytes_as_write_kv(backend, wl, cache, k, v, tag, f"a row of {tiny:.1e} and zeros")
    kd, vd = cache.dequantized()
    if not (bool(torch.isfinite(kd).all()) and bool(torch.isfinite(vd).all())):
        raise ConformanceFailure(f"{tag} a row of {tiny:.1e} and zeros reads back non-finite: a scale was 0")
    out = _forward(backend, wl, cache)
    _assert_rows_written(out, wl, backend.name)
    return CheckResult(max_error=0.0)


#: Keys of one request grown one token a step through a whole block: unit-normal, then 2 % and
#: 1/15 (the worst growth for 16-token blocks: no rescale moves a code of 7) a token.
_GROWTH = (0.0, 0.02, 1 / 15)


def check_kivi4_grown_token_by_token(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """A kivi4 block written one token per ``write`` (decode) stores write_kv's bytes after each
    step, and each key is within the bound docs/quantization.md states: half of each channel
    scale it lived through, the scales being the running ``max |k| / 7`` (float64 model here)."""
    tag = f"[{backend.name}/{case.id}]"
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    g = torch.Generator().manual_seed(case.seed or 0)
    worst = 0.0
    for rate in _GROWTH:
        keys = torch.randn(bs, hkv, d, generator=g, dtype=torch.float64)
        if rate:
            keys = (1 + rate) ** torch.arange(bs, dtype=torch.float64)[:, None, None] * (1 + 0.01 * keys.abs())
        keys = keys.to(case.dtype)
        cache = backend.allocate(2, bs, hkv, d, dtype=case.dtype, kv_dtype="kivi4", device=device)
        want = backend.allocate(2, bs, hkv, d, dtype=case.dtype, kv_dtype="kivi4", device=device)
        for t in range(bs):
            meta = BatchMeta.from_lists([1], [t + 1], [[1]], block_size=bs, device=device)
            row = keys[t : t + 1].to(device)
            backend.write(cache, row, row, meta)
            write_kv(want, row, row, meta.slot_mapping)
            for name, got in storage(cache).items():
                if not torch.equal(got, storage(want)[name]):
                    raise ConformanceFailure(
                        f"{tag} after {t + 1} single-token writes of a kivi4 block, cache.{name} differs from "
                        "paged_core.write_kv's; each write rescales the block's earlier keys exactly as write_kv does"
                    )
        k = keys.double()
        scales = torch.stack([k[: t + 1].abs().amax(0) / Q_MAX["kivi4"] for t in range(bs)]).clamp_min(2.0**-126)
        bound = torch.stack([scales[t:].unique_consecutive(dim=0).sum(0) / 2 for t in range(bs)])
        err = (cache.dequantized()[0][1].double().cpu() - k).abs()
        if bool((err > bound * (1 + 1e-5) + 1e-30).any()):
            raise ConformanceFailure(
                f"{tag} a kivi4 key grown token by token ({rate:.0%} a token) is "
                f"{float((err - bound).max()):.2e} beyond half the sum of its channel's scales",
                max_error=float(err.max()),
            )
        worst = max(worst, float((err / scales[-1]).max()))
    return CheckResult(max_error=worst, note="max |key error| in final channel steps")


#: Cases the layers check runs on: every launch path of the backends (decode, mixed, split,
#: a quantized cache, sinks, strided q, padding, cascade).
LAYER_CASES = frozenset(
    {
        "mixed_prefill_and_decode-g4",
        "decode_only-long_and_short",
        "padding_rows",
        "kv_int8-decode_only",
        "sinks",
        "qkv_view",
        "split_3",
        "cascade-shared_prefix",
        # Each layer its own static scales (as each vLLM layer has its _k_scale): a plan replaying
        # the first layer's scale pointer for the second shows.
        "kv_fp8-static-kv_interleaved",
    }
)
#: The second layer's static scales, relative to the first's.
_LAYER_STATIC_FACTOR = 1.5
#: Two layers show a layer that reuses the other's tensors: outputs are compared after both ran.
NUM_LAYERS = 2


def _layer_inputs(wl: Workload, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Another layer's q and new K/V for the workload's batch: same shapes and layout, other values."""
    c = wl.case
    assert c.seed is not None  # Case.__post_init__ derives it from the id
    g = torch.Generator().manual_seed(c.seed * 1000 + layer)
    n, hq, hkv, d = c.num_tokens, c.num_heads, c.num_kv_heads, c.head_dim
    if c.q_layout == "qkv_view":
        q = torch.randn(n, hq + 2 * hkv, d, generator=g).to(device=wl.device, dtype=c.dtype)[:, :hq]
    else:
        q = torch.randn(n, hq, d, generator=g).to(device=wl.device, dtype=c.dtype)
    k = torch.randn(n, hkv, d, generator=g).to(device=wl.device, dtype=c.dtype)
    v = torch.randn(n, hkv, c.dim_v, generator=g).to(device=wl.device, dtype=c.dtype)
    return q, k, v


def check_layers_share_a_plan(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """One plan, several layers (as an engine calls it): each layer writes its own K/V into its
    own cache and reads it with its own q; every layer's output matches the reference for that
    layer, checked after all of them ran (a layer that reused another's tensors shows)."""
    wl = build_workload(case, device)
    plan = backend.plan(wl.meta)
    layers = []
    for i in range(NUM_LAYERS):
        q, k, v = (wl.q, wl.k_new, wl.v_new) if i == 0 else _layer_inputs(wl, i)
        cache = wl.fresh_cache(backend, static_factor=_LAYER_STATIC_FACTOR**i)
        backend.write(cache, k, v, plan)
        out = _poisoned(wl)
        backend.forward(
            q, cache, plan, scale=case.scale, window=case.window, softcap=case.softcap, sinks=wl.sinks, out=out
        )
        layers.append((q, k, v, out))
    worst = 0.0
    for i, (q, k, v, out) in enumerate(layers):
        name = f"{backend.name}, layer {i} of {NUM_LAYERS} sharing one plan"
        _assert_padding_zero(out, wl, name)
        _assert_rows_written(out, wl, name)
        if i == 0:
            ref = wl.ref_out
        else:
            # cache_before's contents (the layer's own static scales), then the trusted writer
            after = wl.fresh_cache(backend, static_factor=_LAYER_STATIC_FACTOR**i)
            write_kv(after, k, v, wl.meta.slot_mapping)
            ref = reference_attention(
                q,
                after,
                wl.meta,
                scale=case.scale,
                window=case.window,
                softcap=case.softcap,
                sinks=wl.sinks,
                compute_dtype=torch.float64,
            )
        worst = max(
            worst,
            _against_reference(out, ref, wl, case, name),
        )
    return CheckResult(max_error=worst, note=f"{NUM_LAYERS} layers, one plan")


#: The cases a false plan declaration is made on: several requests, each with blocks of its own.
DECLARATION_CASES = frozenset({"mixed_prefill_and_decode-g4", "decode_only-long_and_short"})


def _declaration_reasons(backend: Backend, case: Case, device: torch.device) -> list[str]:
    params = inspect.signature(type(backend)._plan).parameters
    if "shared_prefix_blocks" not in params:
        return [f"{backend.name}'s plan takes no shared_prefix_blocks (nothing of the batch is declared to it)"]
    return []


def check_false_plan_declaration(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """A plan keyword that declares something of the batch (``shared_prefix_blocks=k``: the first
    ``k`` block ids of every request with keys are the same) is a promise the batch can break.
    With validation on (as the suite runs every backend), a false one is refused with an
    ``InputError``, or, if accepted, changes nothing: the output still matches the reference."""
    wl = build_workload(case, device)
    rows = [r for r in range(wl.meta.num_reqs) if int(wl.seq_lens[r]) > 0]
    firsts = {int(wl.meta.block_table[r, 0]) for r in rows}
    if len(firsts) < 2:
        raise NotApplicable([f"case {case.id} has no two requests with different first blocks"])
    try:
        plan = backend.plan(wl.meta, shared_prefix_blocks=1)
    except InputError:
        return CheckResult(max_error=0.0, note="a false shared_prefix_blocks=1 is refused")
    cache = _step(backend, wl)
    out = _poisoned(wl)
    backend.forward(
        wl.q, cache, plan, scale=case.scale, window=case.window, softcap=case.softcap, sinks=wl.sinks, out=out
    )
    name = f"{backend.name}, planned with a false shared_prefix_blocks=1 under validation"
    _assert_rows_written(out, wl, name)
    worst = _against_reference(out, wl.ref_out, wl, case, name)
    return CheckResult(max_error=worst, note="a false shared_prefix_blocks=1 is accepted and changes nothing")


def check_batch_invariance(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """Each request alone (``meta.select([r])``) equals its rows in the whole batch."""
    wl = build_workload(case, device)
    cache = _step(backend, wl)
    batch_out = _forward(backend, wl, cache)
    bitwise = backend.capabilities.batch_invariant
    tol = output_tolerance(case.dtype, case.kv_dtype)
    worst = 0.0
    for r in _alone_requests(case):
        rows = wl.rows_of(r)
        alone = _forward(backend, wl, cache, q=wl.q[rows], meta=wl.meta.select([r]))
        diff = (alone.double() - batch_out[rows].double()).abs().nan_to_num(math.inf)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if bitwise and not torch.equal(alone, batch_out[rows]):
            i, head, _ = (int(x) for x in (diff == diff.max()).nonzero()[0])
            row = rows.start + i
            raise ConformanceFailure(
                f"[{backend.name}/{case.id}] request {r} run alone differs from its rows in the batch "
                f"by up to {float(diff.max()):.1e} (at head {head}, row {row}); the backend declares "
                "capabilities.batch_invariant=True, which promises bitwise equality",
                max_error=float(diff.max()),
            )
        if not bitwise:
            assert_close_to_reference(
                alone,
                batch_out[rows],
                backend=backend.name,
                case=case.id,
                tolerance=tol,
                what=f"request {r} run alone (vs in the batch)",
            )
    return CheckResult(max_error=worst, note="bitwise" if bitwise else f"within {tol}")


#: Request indices where index arithmetic breaks (5-, 7- and 8-bit fields, grid dimensions).
_INDEX_BOUNDARIES = (31, 32, 33, 127, 128, 129, 255, 256)
#: Up to this many real requests, batch invariance runs every one alone.
_ALL_ALONE = 16


def _alone_requests(case: Case) -> list[int]:
    """The requests batch invariance runs alone: all of them in small batches; in large ones
    (each run costs a kernel call) the first, the last and those at the index boundaries."""
    real = case.real_requests
    if len(real) <= _ALL_ALONE:
        return real
    chosen = {real[0], real[-1], *(r for r in real if r in _INDEX_BOUNDARIES)}
    return sorted(chosen)


# --------------------------------------------------------------------------------- random batches
#: How many random batches per backend, per size.
RANDOM_EXAMPLES = {"small": 12, "full": 50}


def _menu(caps: Capabilities, candidates: Iterable[_T], allowed: Collection[_T] | None) -> list[_T]:
    if allowed is None:
        return list(candidates)
    return [c for c in candidates if c in allowed] or sorted(allowed, key=str)[:2]


def random_cases(
    caps: Capabilities, size: str
) -> tuple[SearchStrategy[Case], tuple[list[int], list[int], list[int], list[torch.dtype], list[str]]]:
    """A hypothesis strategy of cases drawn within ``caps`` (tiny at size "small"), and what it
    draws from: ``(group sizes, head dims, block sizes, dtypes, cache formats)``.

    At size "small" (CPU, Triton under its interpreter: nothing to compile) the draws roam the
    shape space too: group sizes, head dims, block sizes, dtypes, cache formats, soft-cap. At
    "full" (GPU) each new shape costs a kernel compile (Triton: seconds; FlashInfer's JIT: a
    minute or more), and the case table covers the shapes already; there the draws vary what an
    engine varies from step to step, on one model shape: the mix of request kinds, their
    lengths, padding, windows and sinks.
    """
    from hypothesis import strategies as st

    small = size == "small"
    groups = _menu(caps, (1, 2, 3, 4) if small else (1, 4), caps.group_sizes)
    head_dims = _menu(caps, (64, 96, 128) if small else (128,), caps.head_dims)
    block_sizes = (
        [b for b in (16, 32, 64) if caps.accepts_block_size(b)]
        or [b for b in _LARGER_BLOCK_SIZES if caps.accepts_block_size(b)][:1]
        or sorted(caps.block_sizes or ())[:2]
    )
    dtypes = [d for d in (torch.float16, torch.bfloat16, torch.float32) if d in caps.dtypes]
    kv_dtypes: list[str] = [k for k in ("auto", "int8", "fp8", "fp8_e5m2") if k in caps.kv_dtypes]
    if not small:
        block_sizes, kv_dtypes = block_sizes[:1], kv_dtypes[:1]
        dtypes = [torch.bfloat16] if torch.bfloat16 in dtypes else dtypes[:1]
    kinds = ["decode", "padding"]
    if caps.mixed_batches:
        kinds += ["chunk", "prompt", "verify"]
    max_ctx, max_reqs = (160, 5) if size == "small" else (4096, 24)

    @st.composite
    def draw_case(draw: st.DrawFn) -> Case:
        group = draw(st.sampled_from(groups))
        num_kv_heads = draw(st.sampled_from([1, 2]))
        query_lens, seq_lens = [], []
        for _ in range(draw(st.integers(1, max_reqs))):
            kind = draw(st.sampled_from(kinds))
            if kind == "padding":
                q, s = draw(st.integers(1, 1 if not caps.mixed_batches else 3)), 0
            elif kind == "decode":
                q, s = 1, draw(st.integers(1, max_ctx))
            elif kind == "prompt":
                s = draw(st.integers(1, min(48, max_ctx)))
                q = s
            elif kind == "verify":
                s = draw(st.integers(1, max_ctx))
                q = min(s, draw(st.integers(2, 6)))
            else:  # a chunk of a longer prompt, after cached context
                s = draw(st.integers(2, max_ctx))
                q = draw(st.integers(1, min(s, 32)))
            query_lens.append(q)
            seq_lens.append(s)
        return Case(
            id="random_batches",
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
            num_heads=group * num_kv_heads,
            num_kv_heads=num_kv_heads,
            head_dim=draw(st.sampled_from(head_dims)),
            block_size=draw(st.sampled_from(block_sizes)),
            dtype=draw(st.sampled_from(dtypes)),
            kv_dtype=draw(st.sampled_from(kv_dtypes)),
            window=draw(st.sampled_from([0, 0, 1, 7, 33])) if caps.sliding_window else 0,
            softcap=draw(st.sampled_from([0.0, 2.0])) if caps.softcap and small else 0.0,
            sinks=draw(st.booleans()) if caps.sinks else False,
            seed=draw(st.integers(0, 2**31 - 1)),
        )

    return draw_case(), (groups, head_dims, block_sizes, dtypes, kv_dtypes)


#: Cases the CUDA-graph check runs on: a decode batch, a mixed batch, padding (graph-padded).
GRAPH_CASES = frozenset({"decode_only-long_and_short", "mixed_prefill_and_decode-g4", "padding_rows"})


def _graph_reasons(backend: Backend, case: Case, device: torch.device) -> list[str]:
    reasons = []
    if not backend.capabilities.cuda_graphs:
        reasons.append(f"{backend.name} does not claim CUDA-graph safety (capabilities.cuda_graphs)")
    if torch.device(device).type != "cuda":
        reasons.append("CUDA graphs need a CUDA device")
    return reasons


def _graph_workload(
    backend: Backend, case: Case, device: torch.device, reasons_of: Callable[[Backend, Case, torch.device], list[str]]
) -> tuple[Workload, KVCache, dict]:
    """The case's workload and cache (K/V written by the backend) and forward's keywords, for a
    graph check whose claims ``reasons_of(backend, case, device)`` tests."""
    reasons = reasons_of(backend, case, device)
    if reasons:
        raise NotApplicable(reasons)
    wl = build_workload(case, device)
    kw = dict(scale=case.scale, window=case.window, softcap=case.softcap, sinks=wl.sinks)
    return wl, _step(backend, wl), kw


def _captured(backend: Backend, case: Case, call: Callable[[], Any], what: str, claims: str) -> torch.cuda.CUDAGraph:
    """``call()`` captured in a CUDA graph; a failure to capture is the backend's (it claims it)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            call()
    except Exception as exc:
        raise ConformanceFailure(
            f"[{backend.name}/{case.id}] {what} could not be captured in a CUDA graph although the "
            f"backend claims {claims}: {type(exc).__name__}: {exc}",
            max_error=math.inf,
        ) from exc
    return graph


def check_cuda_graph_replay(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """Plan outside, capture ``forward`` in a CUDA graph, replay it on new q: equal to eager.

    What an engine does for decode steps; a backend that syncs with the host, allocates, or
    reads host state inside ``forward`` fails the capture or replays stale results.
    """
    wl, cache, kw = _graph_workload(backend, case, device, _graph_reasons)
    plan = backend.plan(wl.meta)
    static_q = wl.q.clone()
    static_out = _poisoned(wl)
    backend.forward(static_q, cache, plan, out=static_out, **kw)  # compiles / autotunes, not captured
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        backend.forward(static_q, cache, plan, out=static_out, **kw)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = _captured(
        backend, case, lambda: backend.forward(static_q, cache, plan, out=static_out, **kw), "forward", "cuda_graphs"
    )
    assert case.seed is not None  # Case.__post_init__ derives it from the id
    new_q = torch.randn(tuple(wl.q.shape), generator=torch.Generator().manual_seed(case.seed + 1))
    static_q.copy_(new_q.to(device=device, dtype=wl.q.dtype))
    static_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize(device)
    eager = backend.forward(static_q.clone(), cache, backend.plan(wl.meta), **kw)
    _assert_padding_zero(static_out, wl, backend.name, "replayed output")
    _assert_rows_written(static_out, wl, backend.name)
    err = _against_reference(
        static_out, eager.double(), wl, case, backend.name, what="CUDA-graph replay on new q (vs an eager call)"
    )
    return CheckResult(max_error=err)


def _plan_in_graph_reasons(backend: Backend, case: Case, device: torch.device) -> list[str]:
    reasons = _graph_reasons(backend, case, device)
    if not backend.capabilities.device_plan:
        reasons.append(
            f"{backend.name} plans on the host (capabilities.device_plan is False): engines plan it outside the capture"
        )
    return reasons


def check_plan_captured_with_forward(backend: Backend, case: Case, device: torch.device) -> CheckResult:
    """Capture ``plan`` *and* ``forward`` in one CUDA graph on another batch of the same shape,
    copy the case's batch into it (``BatchMeta.copy_``), replay: equal to the float64 reference.

    What transformers' continuous batching does (it captures whole steps); a backend claiming
    ``device_plan`` must plan from the metadata tensors' contents at replay time, not from
    what they held at capture.
    """
    wl, cache, kw = _graph_workload(backend, case, device, _plan_in_graph_reasons)
    # Another batch of the same shape: every real request sees about half its keys (at least its
    # own rows); the host bounds stay the case's, as an engine captures with its largest.
    meta = wl.meta
    real = meta.seq_lens > 0
    qlens = torch.diff(meta.query_start_loc)
    shorter = torch.where(real, torch.maximum(meta.seq_lens // 2, qlens), meta.seq_lens)
    # Its new tokens sit at the shorter positions: the slots the block table gives them there.
    rows = torch.arange(meta.num_tokens, device=meta.device)
    req = torch.searchsorted(
        meta.query_start_loc[1:].contiguous(), rows.to(meta.query_start_loc.dtype), right=True
    ).clamp_(max=max(meta.num_reqs - 1, 0))
    pos = (shorter[req] - qlens[req] + rows - meta.query_start_loc[req]).long()
    slots = meta.block_table[req, pos.clamp(min=0) // meta.block_size].long() * meta.block_size + pos % meta.block_size
    slots = torch.where(real[req], slots, meta.slot_mapping.long()).to(meta.slot_mapping.dtype)
    static = dataclasses.replace(
        meta,
        query_start_loc=meta.query_start_loc.clone(),
        seq_lens=shorter.to(meta.seq_lens.dtype),
        block_table=meta.block_table.clone(),
        slot_mapping=slots,
        query_start_loc_cpu=None if meta.query_start_loc_cpu is None else meta.query_start_loc_cpu.clone(),
        seq_lens_cpu=None if meta.seq_lens_cpu is None else shorter.cpu().to(meta.seq_lens_cpu.dtype),
    )
    static_out = _poisoned(wl)
    backend.forward(wl.q, cache, backend.plan(static), out=static_out, **kw)  # compiles, not captured
    torch.cuda.synchronize(device)
    graph = _captured(
        backend,
        case,
        lambda: backend.forward(wl.q, cache, backend.plan(static), out=static_out, **kw),
        "plan + forward",
        "cuda_graphs and device_plan",
    )
    static.copy_(meta)
    static_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize(device)
    _assert_padding_zero(static_out, wl, backend.name, "replayed output")
    _assert_rows_written(static_out, wl, backend.name)
    err = _against_reference(
        static_out,
        wl.ref_out,
        wl,
        case,
        backend.name,
        what="plan + forward captured on another batch, replayed on this one",
    )
    return CheckResult(max_error=err)


def check_random_batches(
    backend: Backend, device: torch.device, size: str = "small", *, max_examples: int | None = None
) -> CheckResult:
    """Hypothesis-drawn batches within the backend's capabilities, each run as matches_reference.

    Derandomized (the same examples every run, so pytest and ``paged check`` agree) and bounded;
    on the CPU shrinking is off too, since every example may cost a Triton interpreter run.
    """
    from hypothesis import HealthCheck, Phase, assume, given, settings

    strategy, (groups, head_dims, block_sizes, dtypes, kv_dtypes) = random_cases(backend.capabilities, size)
    if not dtypes or not kv_dtypes or not block_sizes:
        raise NotApplicable(["declares no dtype, cache format or block size the suite draws from"])
    # The simplest drawable case: if the backend refuses it (e.g. it cannot run on this device),
    # every draw would be refused too; skip with its reasons instead.
    baseline = Case(
        id="random_batches",
        query_lens=(1,),
        seq_lens=(1,),
        num_heads=groups[0],
        num_kv_heads=1,
        head_dim=head_dims[0],
        block_size=block_sizes[0],
        dtype=dtypes[0],
        kv_dtype=kv_dtypes[0],
    )
    reasons = backend.reasons(baseline.spec(device))
    if reasons:
        raise NotApplicable(reasons)
    worst = [0.0]

    @settings(
        max_examples=max_examples or RANDOM_EXAMPLES[size],
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate) if size == "small" else tuple(Phase),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=strategy)
    def property_(case: Case) -> None:
        assume(not backend.reasons(case.spec(device)))
        worst[0] = max(worst[0], check_matches_reference(backend, case, device).max_error or 0.0)

    try:
        property_()
    finally:
        clear_workloads(RANDOM_BATCHES)  # each random example is used once
    return CheckResult(max_error=worst[0], note=f"{max_examples or RANDOM_EXAMPLES[size]} random batches")


# --------------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Check:
    """A check of one (backend, case): its function, the cases it applies to, extra skip reasons."""

    name: str
    func: Callable[[Backend, Case, torch.device], CheckResult]
    applies: Callable[[Case], bool] = lambda case: True
    #: Reasons beyond the case's spec, e.g. the spec with ``return_lse=True``.
    reasons: Callable[[Backend, Case, torch.device], list[str]] = lambda backend, case, device: []


#: Every per-case check, by name (the pytest test is ``test_<name>``).
CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("matches_reference", check_matches_reference),
        Check(
            "lse_matches_reference",
            check_lse_matches_reference,
            reasons=lambda b, case, device: b.reasons(case.spec(device, return_lse=True)),
        ),
        Check("close_to_full_precision", check_close_to_full_precision, applies=lambda case: case.kv_dtype != "auto"),
        Check("write_then_read", check_write_then_read),
        Check("layers_share_a_plan", check_layers_share_a_plan, applies=lambda case: case.id in LAYER_CASES),
        Check(
            "false_plan_declaration",
            check_false_plan_declaration,
            applies=lambda case: case.id in DECLARATION_CASES,
            reasons=_declaration_reasons,
        ),
        Check("batch_invariance", check_batch_invariance, applies=lambda case: len(case.real_requests) >= 2),
        Check(
            "non_finite_stays_in_its_slot",
            check_non_finite_stays_in_its_slot,
            applies=lambda case: case.id in NON_FINITE_CASES,
        ),
        Check(
            "scale_floor",
            check_scale_floor,
            applies=lambda case: case.id in NON_FINITE_CASES and case.kv_dtype != "auto",
        ),
        Check(
            "kivi4_grown_token_by_token",
            check_kivi4_grown_token_by_token,
            applies=lambda case: case.id == "kv_kivi4-decode_only",
        ),
        Check(
            "cuda_graph_replay",
            check_cuda_graph_replay,
            applies=lambda case: case.id in GRAPH_CASES,
            reasons=_graph_reasons,
        ),
        Check(
            "plan_captured_with_forward",
            check_plan_captured_with_forward,
            applies=lambda case: case.id in GRAPH_CASES,
            reasons=_plan_in_graph_reasons,
        ),
    )
}
#: The per-backend property test's name; its row in the report.
RANDOM_BATCHES = "random_batches"


def applicable_checks(case: Case) -> list[str]:
    return [name for name, c in CHECKS.items() if c.applies(case)]


def run(
    pool: BackendPool, backend_name: str, check: str, case: Case | None, device: torch.device, size: str = "small"
) -> CheckResult:
    """Run one check of one backend (``case`` None for ``random_batches``).

    Raises :class:`NotApplicable` with the backend's reasons (cannot run here, does not take a
    case's option, does not claim the case's spec) and whatever the check raises on failure.
    """
    refused = pool.refused(backend_name)
    if refused is not None:
        case_id = case.id if case is not None else RANDOM_BATCHES
        raise ConformanceFailure(f"[{backend_name}/{case_id}] {refused}")
    reasons = pool.unavailable(backend_name)
    if not reasons and case is not None:
        reasons = pool.option_reasons(backend_name, case.options)
    if reasons:
        raise NotApplicable(reasons)
    backend = pool.get(backend_name, case.options if case is not None else ())
    if case is None:
        return check_random_batches(backend, device, size)
    spec_reasons = _case_reasons(backend, check, case, device)
    if spec_reasons:
        rebased = _at_accepted_block_size(backend, check, case, device)
        if rebased is None:
            raise NotApplicable(spec_reasons)
        note = f"at block_size {rebased.block_size} ({backend.name} does not take blocks of {case.block_size})"
        try:
            result = _refusing_views(backend, rebased, lambda: CHECKS[check].func(backend, rebased, device))
        except ConformanceFailure as exc:
            raise ConformanceFailure(f"{exc} [{note}]", max_error=exc.max_error, tolerance=exc.tolerance) from exc
        return dataclasses.replace(
            result, note="; ".join(x for x in (note, result.note) if x), block_size=rebased.block_size
        )
    return _refusing_views(backend, case, lambda: CHECKS[check].func(backend, case, device))


def _refusing_views(backend: Backend, case: Case, call: Callable[[], CheckResult]) -> CheckResult:
    """``call()``, where a backend may refuse a strided cache or ``sinks`` view.

    Capabilities do not state memory layouts; the contract lets a backend refuse a view with
    an :class:`~paged_core.UnsupportedSpecError` (never copy it silently), which skips the case
    with the backend's own message. In any other case that error is a failure like any other.
    """
    if case.cache_layout == "nhd" and case.sinks_layout == "contiguous":
        return call()
    try:
        return call()
    except UnsupportedSpecError as exc:
        raise NotApplicable([f"{backend.name} refuses this view: {exc}"]) from exc


def _case_reasons(backend: Backend, check: str, case: Case, device: torch.device) -> list[str]:
    return backend.reasons(case.spec(device)) or CHECKS[check].reasons(backend, case, device)


def _at_accepted_block_size(backend: Backend, check: str, case: Case, device: torch.device) -> Case | None:
    """``case`` at the smallest larger block size the backend takes, if that is all that kept it out.

    A case about its block size (``block_size_fixed``), or with a shared prefix (counted in blocks),
    is not moved. Any other case tests the same thing at another block size: flash-attn 2, whose
    paged path needs multiples of 256, then runs the windows, soft-caps, mixed batches ... too.
    """
    if case.block_size_fixed or case.shared_prefix_blocks:
        return None
    caps = backend.capabilities
    size = next((b for b in _LARGER_BLOCK_SIZES if b > case.block_size and caps.accepts_block_size(b)), None)
    if size is None:
        return None
    rebased = dataclasses.replace(case, block_size=size)
    return None if _case_reasons(backend, check, rebased, device) else rebased


#: The block sizes a case may be moved to (powers of two; the cases' contexts are a few thousand).
_LARGER_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
