"""The rows of a case: each backend, then the variants some backends offer (cascade, the
block-size bridge), then the non-paged SDPA baselines. Every row is first checked against the
reference with the suite's tolerance (``paged_conformance.output_tolerance``); a wrong result is
reported ``WRONG`` and never timed.

A row producer takes the :class:`Lineup` (what runs on every case), the case, its data and its
tolerance, and yields rows as they finish; :data:`PRODUCERS` lists them in the order they run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from paged_conformance import Tolerance
from paged_core import AttentionSpec, Backend, BatchMeta, Registry, allocate_kv_cache

from .cases import Case
from .config import Config
from .data import CaseData, as_bytes, recover
from .timing import graph_replay, host_time_ms, host_us, sync, time_fn

__all__ = ["PRODUCERS", "SDPA_BASELINES", "Lineup", "Row", "RowProducer", "run_backend", "short", "tolerance_label"]

#: The non-paged baselines, by the names ``--backend`` takes.
SDPA_BASELINES = ("sdpa-flash", "sdpa-cudnn")


def tolerance_label(tol: Tolerance) -> str:
    """How rows and case infos name the tolerance (the suite's, elementwise against the reference)."""
    return f"{tol} (paged_conformance)"


def _check(out_rows: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[bool, float, str]:
    """(passed, max|out-ref| / max|ref|, status). NaN or inf anywhere fails (poisoned rows unwritten)."""
    o = out_rows.float()
    if not bool(torch.isfinite(o).all()):
        bad = int((~torch.isfinite(o)).sum())
        return False, math.inf, f"WRONG: {bad} non-finite output values (NaN-poisoned rows not written?)"
    diff = (o - ref).abs()
    rel = float(diff.max()) / float(ref.abs().max().clamp_min(1e-6))
    over = float((diff / (tol.atol + tol.rtol * ref.abs())).max())
    if over > 1.0:
        return (
            False,
            rel,
            (
                f"WRONG: |out-ref| reaches {over:.3g}x the tolerance {tolerance_label(tol)} "
                f"(max|out-ref|/max|ref| = {rel:.3g})"
            ),
        )
    return True, rel, "ok"


@dataclasses.dataclass
class Row:
    """One result: a backend (or a variant of it, or a baseline) on one case; ``--json`` writes
    every field, the table the most of them."""

    case: str
    shape: str
    kind: str
    group: str
    batch: int
    backend: str
    label: str
    paged: bool
    status: str = "ok"
    ms: float | None = None
    eager_ms: float | None = None
    #: Host microseconds per forward: HOST_CALLS eager calls, synchronised only at the end.
    host_us: float | None = None
    plan_ms: float | None = None
    gbps: float | None = None
    pct_bw_floor: float | None = None
    tflops: float | None = None
    pct_mm_floor: float | None = None
    pct_floor: float | None = None
    x_fastest: float | None = None
    max_rel_err: float | None = None
    tolerance: str | None = None
    timing: str | None = None
    note: str = ""

    @classmethod
    def of(cls, case: Case, backend: str, label: str, paged: bool, **fields: Any) -> Row:
        """A row of ``case`` (its id, shape, kind, group and batch)."""
        return cls(case.id, case.shape, case.kind, case.group, case.batch, backend, label, paged, **fields)


def short(exc: BaseException) -> str:
    """An exception as a status: its type and the first line of its message."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def run_backend(cfg: Config, case: Case, data: CaseData, name: str, backend: Backend, tol: Tolerance) -> Row:
    """Skip (its reasons), check against the reference, then time ``backend`` on ``case``."""
    row = Row.of(case, name, name, True, tolerance=tolerance_label(tol))
    spec = AttentionSpec(
        num_heads=cfg.heads,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        block_size=cfg.block_size,
        dtype=cfg.dtype,
        kv_dtype=case.kv_dtype,
        kv_scales="per_tensor" if case.static_scales else "per_slot",
        device=cfg.device.type,
        decode_only=data.meta.decode_only,
        head_dim_v=cfg.dim_v,
    )
    try:
        reasons = backend.reasons(spec)
    except Exception as exc:
        row.status = f"error: reasons() raised {short(exc)}"
        return row
    if reasons:
        row.status = "skip: " + "; ".join(reasons)
        return row
    cache = data.cache
    if type(backend).allocate is not Backend.allocate:
        # A backend with its own cache layout: allocate through it and copy if the layout matches.
        try:
            own = backend.allocate(
                cache.num_blocks,
                cache.block_size,
                cache.num_kv_heads,
                cache.head_dim,
                dtype=cache.dtype,
                kv_dtype=cache.kv_dtype,
                device=cfg.device,
                head_dim_v=cache.head_dim_v,
                **case.allocate_kwargs(),
            )
            if own.k.shape != cache.k.shape or own.v.shape != cache.v.shape or own.k.dtype != cache.k.dtype:
                row.status = (
                    f"skip: {name} allocates its cache as {list(own.k.shape)} {own.k.dtype}; "
                    "paged bench fills NHD caches only"
                )
                return row
            for a, b in (
                (own.k, cache.k),
                (own.v, cache.v),
                (own.k_scale, cache.k_scale),
                (own.v_scale, cache.v_scale),
            ):
                if a is not None and not (own.static_scales and a.dim() == 3):  # static: given above
                    assert b is not None  # the same kv_dtype: the same scales
                    as_bytes(a).copy_(as_bytes(b))
            cache = own
        except Exception as exc:
            row.status = f"error: allocate: {short(exc)}"
            return row
    q, meta = data.q, data.meta
    try:
        plan = backend.plan(meta)
        out = q.new_full((q.shape[0], q.shape[1], cache.head_dim_v), float("nan"))
        backend.forward(q, cache, plan, out=out)  # first call: compiles / autotunes here
        sync(cfg.device)
        ok, err, status = _check(out.index_select(0, data.rows), data.ref, tol)
        row.max_rel_err = err if math.isfinite(err) else None
        if not ok:
            row.status = status
            return row
        if type(backend).plan is not Backend.plan:
            row.plan_ms = host_time_ms(lambda: backend.plan(meta), cfg.device)
        fn = lambda: backend.forward(q, cache, plan, out=out)
        row.ms, row.timing = time_fn(fn, cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
        row.eager_ms = row.ms
        row.host_us = host_us(fn, cfg.device)
        if cfg.cuda_graph and backend.capabilities.cuda_graphs:
            # Engines replay decode steps from CUDA graphs: the replay time is the kernel's own,
            # without the host-side launch cost that the eager time includes.
            replay, why = graph_replay(fn, cfg.device)
            if replay is not None:
                row.ms, row.timing = time_fn(replay, cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
                row.note = "CUDA graph"
            else:
                row.note = f"graph capture failed ({why}); eager"
    except Exception as exc:
        row.status = f"error: {short(exc)}"
        if os.environ.get("PAGED_BENCH_TRACEBACK"):
            traceback.print_exc()
        recover(cfg.device)
    return row


def _bridge_row(cfg: Config, case: Case, data: CaseData, name: str, backend: Backend, tol: Tolerance) -> Row | None:
    """A backend of 256-token blocks only (flash-attn 2) on this workload of smaller blocks,
    through the block-size bridge (``paged_flash_attn2.bridge``), as an engine with 16-token
    blocks runs it: the same K/V re-placed in aligned runs of blocks, the 256-token view of that
    pool, and the table converted in every step's plan (its host time is in the row's plan
    column). None where the bridge does not apply (the backend takes the workload's block size,
    or not 256; a shared prefix)."""
    caps = backend.capabilities
    if (
        256 % cfg.block_size
        or caps.accepts_block_size(cfg.block_size)
        or not caps.accepts_block_size(256)
        or case.lengths.shared_prefix_blocks
    ):
        return None
    try:
        from paged_flash_attn2.bridge import BridgedAllocator, bridge_cache, bridge_meta
    except ImportError:
        return None
    ratio = 256 // cfg.block_size
    label = f"{name} (bridge)"
    try:
        bs, old = cfg.block_size, data.cache
        need = sum(math.ceil(math.ceil(s / bs) / ratio) * ratio for s in case.seq_lens)
        alloc = BridgedAllocator(need + ratio, ratio=ratio, seed=cfg.seed)
        tables = [alloc.allocate(max(1, math.ceil(s / bs))) for s in case.seq_lens]
        meta16 = BatchMeta.from_lists(
            list(case.query_lens), list(case.seq_lens), tables, block_size=bs, device=cfg.device
        )
        cache16 = allocate_kv_cache(
            need + ratio,
            bs,
            old.num_kv_heads,
            old.head_dim,
            dtype=old.dtype,
            kv_dtype=old.kv_dtype,
            device=cfg.device,
            head_dim_v=old.head_dim_v,
            **case.allocate_kwargs(),
        )
        # Every request's tokens, moved from the workload's random blocks to their aligned runs.
        src, dst = [], []
        for s, t_old, t_new in zip(case.seq_lens, data.tables, tables, strict=True):
            j = torch.arange(s)
            src.append(torch.tensor(t_old[: math.ceil(s / bs)])[j // bs] * bs + j % bs)
            dst.append(torch.tensor(t_new[: math.ceil(s / bs)])[j // bs] * bs + j % bs)
        src_i, dst_i = (torch.cat(x).to(cfg.device) for x in (src, dst))
        for a, b in (
            (cache16.k, old.k),
            (cache16.v, old.v),
            (cache16.k_scale, old.k_scale),
            (cache16.v_scale, old.v_scale),
        ):
            if a is not None and not (cache16.static_scales and a.dim() == 3):  # static: given above
                assert b is not None  # the same kv_dtype: the same scales
                a.view(-1, *a.shape[2:])[dst_i] = b.view(-1, *b.shape[2:])[src_i]
        bridged = dataclasses.replace(data, meta=bridge_meta(meta16), cache=bridge_cache(cache16), tables=[])
        row = run_backend(dataclasses.replace(cfg, block_size=256), case, bridged, name, backend, tol)
        if row.status == "ok" and row.plan_ms is not None:
            row.plan_ms += host_time_ms(lambda: bridge_meta(meta16), cfg.device)
    except Exception as exc:
        row = Row.of(
            case,
            name,
            label,
            True,
            status=f"error: bridge: {short(exc)}",
        )
    row.label = label
    return row


def _contiguous(t: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, n, D] of a uniform-length batch, gathered through the block table."""
    nblk = math.ceil(n / t.shape[1])
    x = t[block_table[:, :nblk].long()]  # [B, nblk, bs, H, D]
    return x.reshape(x.shape[0], nblk * t.shape[1], *t.shape[2:])[:, :n].transpose(1, 2).contiguous()


def _sdpa_rows(cfg: Config, case: Case, data: CaseData, wanted: list[str], tol: Tolerance) -> list[Row]:
    """PyTorch's ``scaled_dot_product_attention`` on the same K/V gathered contiguously."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:  # a torch without the context manager
        return [
            Row.of(
                case,
                b,
                f"{b} (non-paged)",
                False,
                status=f"skip: torch.nn.attention unavailable ({short(exc)})",
            )
            for b in wanted
        ]
    kinds = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    B, n = len(case.seq_lens), case.seq_lens[0]
    lq = case.query_lens[0]
    causal = lq > 1
    rows = []
    if cfg.dim_v != cfg.head_dim:
        return [
            Row.of(
                case,
                b,
                f"{b} (non-paged)",
                False,
                status=f"skip: {b} needs V of the QK head dim ({cfg.head_dim}), not {cfg.dim_v}",
            )
            for b in wanted
        ]
    elem = data.cache.k.element_size()
    need = 2 * B * cfg.kv_heads * n * cfg.head_dim * elem * (1 + cfg.heads // cfg.kv_heads)
    if cfg.device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(cfg.device)[0]:
        return [
            Row.of(
                case,
                b,
                f"{b} (non-paged)",
                False,
                status="skip: not enough free memory for the contiguous copy",
            )
            for b in wanted
        ]
    k = _contiguous(data.cache.k, data.meta.block_table, n)  # gathered outside the timed region
    v = _contiguous(data.cache.v, data.meta.block_table, n)
    q = data.q.view(B, lq, cfg.heads, cfg.head_dim).transpose(1, 2)
    group = cfg.heads // cfg.kv_heads
    rep_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    for b in wanted:
        row = Row.of(
            case,
            b,
            f"{b} (non-paged)",
            False,
            tolerance=tolerance_label(tol),
        )
        rows.append(row)
        if b not in kinds:
            row.status = f"skip: unknown baseline {b}"
            continue
        if b == "sdpa-cudnn" and cfg.device.type != "cuda":
            row.status = "skip: cuDNN attention needs a CUDA device"
            continue

        def gqa(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        attempts = [("gqa", gqa)]
        if group > 1:

            def repeated(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
                nonlocal rep_kv
                if rep_kv is None:  # outside the timed region, once
                    rep_kv = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
                return F.scaled_dot_product_attention(q, rep_kv[0], rep_kv[1], is_causal=causal)

            attempts.append(("kv heads repeated", repeated))
        why = []
        for how, fn in attempts:
            try:
                with warnings.catch_warnings(), sdpa_kernel(kinds[b]):
                    warnings.simplefilter("ignore")
                    o = fn()
                    sync(cfg.device)
                    flat = o.transpose(1, 2).reshape(-1, cfg.heads, cfg.head_dim)
                    ok, err, status = _check(flat.index_select(0, data.rows), data.ref, tol)
                    row.max_rel_err = err if math.isfinite(err) else None
                    if not ok:
                        row.status = status
                        break
                    row.ms, row.timing = time_fn(fn, cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
                    row.status = "ok"
                    if how != "gqa":
                        row.note = f"{how}: it reads {group}x the K/V"
                break
            except Exception as exc:
                why.append(f"{how}: {short(exc)}")
                recover(cfg.device)
        else:
            row.status = "skip: SDPA refused (" + "; ".join(why) + ")"
    return rows


# ---------------------------------------------------------------------------------- row producers
@dataclasses.dataclass
class Lineup:
    """What runs on every case: the backends that can run here, and the baselines asked for."""

    cfg: Config
    registry: Registry
    backends: dict[str, Backend]
    baselines: list[str]


RowProducer = Callable[[Lineup, Case, CaseData, Tolerance], Iterator[Row]]


def backend_rows(lineup: Lineup, case: Case, data: CaseData, tol: Tolerance) -> Iterator[Row]:
    """Each backend as it is registered."""
    for name, backend in lineup.backends.items():
        yield run_backend(lineup.cfg, case, data, name, backend, tol)


def cascade_rows(lineup: Lineup, case: Case, data: CaseData, tol: Tolerance) -> Iterator[Row]:
    """On the cascade case, each backend whose constructor offers ``cascade``, built with it."""
    if case.kind != "cascade":
        return
    # Cascade attention is opt-in (it reads the block table once per step in plan()):
    # time it as an extra row for every backend whose constructor offers it.
    for name, backend in lineup.backends.items():
        if "cascade" not in inspect.signature(type(backend).__init__).parameters:
            continue
        try:
            variant = lineup.registry.get(name, cascade=True)
        except Exception as exc:
            row = Row.of(
                case,
                name,
                f"{name} (cascade)",
                True,
                status=f"error: {short(exc)}",
            )
        else:
            row = run_backend(lineup.cfg, case, data, name, variant, tol)
            row.label = f"{name} (cascade)"
        yield row


def bridge_rows(lineup: Lineup, case: Case, data: CaseData, tol: Tolerance) -> Iterator[Row]:
    """Each backend of 256-token blocks only, through the block-size bridge (:func:`_bridge_row`)."""
    for name, backend in lineup.backends.items():
        row = _bridge_row(lineup.cfg, case, data, name, backend, tol)
        if row is not None:
            yield row


def baseline_rows(lineup: Lineup, case: Case, data: CaseData, tol: Tolerance) -> Iterator[Row]:
    """The SDPA baselines, on cases SDPA can run (:attr:`Case.uniform`)."""
    if lineup.baselines and case.uniform:
        yield from _sdpa_rows(lineup.cfg, case, data, lineup.baselines, tol)


#: The rows of every case, in this order.
PRODUCERS: tuple[RowProducer, ...] = (backend_rows, cascade_rows, bridge_rows, baseline_rows)
