"""``paged bench``: every installed backend, side by side, against the bandwidth floor.

For each case the batch (random, non-contiguous blocks) and the cache (random data, never zeros)
are built once; then, in this one process, every backend in turn:

1. is skipped with its own reasons if it cannot serve the case's :class:`AttentionSpec`;
2. plans once (outside the timed region; a nontrivial ``plan`` is timed on its own);
3. runs once into a NaN-poisoned output, which is **checked against the reference** (float32, on
   a subset of the requests): a wrong answer is reported ``WRONG`` and never timed;
4. is timed: ``triton.testing.do_bench`` (median, L2 flushed before each repetition), CUDA events
   without Triton, a host clock on the CPU.

The floors come from the same run: the read bandwidth of a streaming-read kernel and the dense
matrix rate (see :mod:`.floor`). Each row reports ms, GB/s of the K/V (and scales, Q and O) the
batch must move, the percentage of the bandwidth floor, TFLOP/s where the case computes, and the
ratio to the fastest row of the case. PyTorch's ``scaled_dot_product_attention`` (flash and
cuDNN) on the same data laid out contiguously runs beside them, labelled non-paged.

The correctness check uses the suite's output tolerances (:mod:`.tolerances`) and the cases'
per-request lengths are the suite's :class:`.cases.Batch`; the batches themselves are the
benchmark's own (large, timed), not the suite's (small, exhaustive).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from paged_conformance import Batch, Tolerance, allocate_tables, blocks_needed, check_writable, output_tolerance
from paged_core import (
    AttentionSpec,
    Backend,
    BatchMeta,
    BlockAllocator,
    InputError,
    KVCache,
    PagedError,
    Registry,
    allocate_kv_cache,
    kv_bytes_per_token,
    quantize_kv,
    reference_attention,
)

from . import floor as _floor

__all__ = ["add_arguments", "main", "run", "CASE_IDS"]

#: Case ids in the order they run; ``--cases`` takes any of these ("sweep" = every sweep point).
CASE_IDS = (
    "decode", "decode-long", "decode-short", "decode-medium", "decode-single",
    "mixed", "prefill", "decode-int8", "decode-fp8", "decode-fp8-static", "cascade", "sweep",
)
#: What runs on a machine without a GPU unless ``--cases`` says otherwise (minuscule sizes).
CPU_CASES = ("decode", "mixed", "prefill", "decode-int8", "decode-fp8", "decode-fp8-static", "cascade", "sweep")
#: The static scale of the ``decode-fp8-static`` case, for K and V: unit-normal K/V reach 448 codes
#: at 4 sigma (|x| > 4: p ~ 6e-5 saturate), as a calibrated per-tensor scale would put them.
STATIC_SCALE = 4.0 / 448
SDPA_BASELINES = ("sdpa-flash", "sdpa-cudnn")

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
_CPU_NOTE = "CPU timings — not representative; run on a GPU for real numbers"


# ============================================================================================ options
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Time every installed backend (or --backend A,B) on the benchmark cases against the "
        "read-bandwidth floor measured in the same run; each result is checked against the "
        "reference before it is timed. Without a GPU it runs minuscule cases on the CPU."
    )
    p.add_argument("--backend", action="append", metavar="A,B",
                   help="only these backends (repeatable or comma-separated); the non-paged "
                        "baselines are named sdpa-flash and sdpa-cudnn")
    p.add_argument("--cases", action="append", metavar="A,B",
                   help=f"only these cases (repeatable or comma-separated): {', '.join(CASE_IDS)}")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; CPU 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; CPU 1)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; CPU 64)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES),
                   help="model dtype (default bfloat16)")
    p.add_argument("--sweep-len", action="append", metavar="L,L",
                   help="context length(s) of the batch-size sweep (default 4096; e.g. 4096,32768)")
    p.add_argument("--sweep-batches", default=None, metavar="B,B",
                   help="batch sizes of the sweep (default 1,2,4,8,16,32,64,128,256)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every result (env + rows) as JSON")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: achieved bandwidth vs the floor across the sweep (matplotlib)")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="time nothing: print the table of a run recorded with --json (and --plot its sweep)")
    p.add_argument("--quick", action="store_true",
                   help="shorter timing and a thinner sweep (implied without a GPU, with tiny sizes)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="where to run (default: cuda if available)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up per timing, ms (default 25)")
    p.add_argument("--rep", type=float, default=None, help="timed repetitions per timing, ms (default 100)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="time eager calls only. By default, backends that claim cuda_graphs are also "
                        "timed as CUDA-graph replays (as engines run decode) and 'ms' is the replay time; "
                        "'eager ms' always includes the host-side launch cost")
    p.add_argument("--no-baselines", action="store_true", help="skip the non-paged SDPA baselines")
    p.add_argument("--seed", type=int, default=0, help="random seed of data and block placement")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def _positive_ints(option: str, values: Sequence[str] | None) -> list[int]:
    """``--option 1,2`` as ints, or a PagedError naming the option (exit 2, not a traceback)."""
    out = []
    for v in _split(values):
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise PagedError(f"{option} has {v!r}; accepted: positive ints separated by commas")
        out.append(n)
    return out


@dataclasses.dataclass
class Config:
    device: torch.device
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    cases: list[str]
    sweep_lens: list[int]
    sweep_batches: list[int]
    tiny: bool
    quick: bool
    warmup_ms: float
    rep_ms: float
    cuda_graph: bool
    seed: int
    min_pool_bytes: int

    def public(self) -> dict:
        d = dataclasses.asdict(self)
        d["device"] = str(self.device)
        d["dtype"] = _dtype_name(self.dtype)
        return d


def _config(args: argparse.Namespace) -> Config:
    want = getattr(args, "device", "auto") or "auto"
    if want == "cuda" and not torch.cuda.is_available():
        raise PagedError("--device cuda was asked for but torch sees no CUDA device")
    cuda = torch.cuda.is_available() and want != "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tiny = not cuda
    quick = bool(args.quick) or tiny
    cases = _split(args.cases) or list(CASE_IDS if not tiny else CPU_CASES)
    unknown = [c for c in cases if c not in CASE_IDS and c != "all"]
    if unknown:
        raise PagedError(f"unknown case(s) {', '.join(unknown)}; accepted: {', '.join(CASE_IDS)}, all")
    if "all" in cases:
        cases = list(CASE_IDS)
    for opt in ("heads", "kv_heads", "head_dim", "block_size"):
        val = getattr(args, opt, None)
        if val is not None and val < 1:
            raise PagedError(f"--{opt.replace('_', '-')} is {val}; accepted: a positive int")
    if args.sweep_batches:
        batches = _positive_ints("--sweep-batches", [args.sweep_batches])
    elif tiny:
        batches = [1, 2, 4]
    elif quick:
        batches = [1, 4, 16, 64, 256]
    else:
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sweep_lens = _positive_ints("--sweep-len", args.sweep_len) or ([64] if tiny else [4096])
    heads = args.heads or (4 if tiny else 32)
    kv_heads = args.kv_heads or (1 if tiny else 8)
    if heads % kv_heads:
        raise PagedError(
            f"--heads {heads} is not a multiple of --kv-heads {kv_heads}; accepted: "
            "heads = group_size * kv_heads"
        )
    return Config(
        device=device,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=args.head_dim or (64 if tiny else 128),
        block_size=args.block_size,
        dtype=_DTYPES[args.dtype],
        cases=cases,
        sweep_lens=sweep_lens,
        sweep_batches=batches,
        tiny=tiny,
        quick=quick,
        warmup_ms=args.warmup if args.warmup is not None else (10 if quick else 25),
        rep_ms=args.rep if args.rep is not None else (40 if quick else 100),
        cuda_graph=bool(getattr(args, "cuda_graph", True)) and cuda,
        seed=args.seed,
        # Random blocks spread over at least this much memory (well past H200's 50 MB of L2).
        min_pool_bytes=0 if tiny else 256 * 1024 * 1024,
    )


# ============================================================================================ cases
@dataclasses.dataclass
class Case:
    """One timed batch: its per-request lengths (the suite's :class:`.cases.Batch`) and labels."""

    id: str
    kind: str  # decode | mixed | prefill | cascade
    shape: str
    #: ``query_lens[r]`` new tokens of ``seq_lens[r]`` in all, and the blocks every request shares.
    lengths: Batch
    kv_dtype: str = "auto"
    #: A quantized cache with one static scale per tensor (``STATIC_SCALE``), vLLM's fp8 format,
    #: instead of one scale per slot.
    static_scales: bool = False
    group: str = ""  # "sweep" for sweep points
    batch: int = 0
    description: str = ""

    @property
    def query_lens(self) -> tuple[int, ...]:
        return self.lengths.query_lens

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.lengths.seq_lens

    @property
    def uniform(self) -> bool:
        """One context length, and either one query per request or whole prompts (SDPA can run it)."""
        if len(set(self.seq_lens)) != 1 or self.kv_dtype != "auto":
            return False
        pairs = zip(self.query_lens, self.seq_lens, strict=True)
        return all(q == 1 for q in self.query_lens) or all(q == s for q, s in pairs)


def _cases(cfg: Config) -> list[Case]:
    t = cfg.tiny
    g = torch.Generator().manual_seed(cfg.seed + 1)

    def decode(cid, b, n, desc, kv="auto"):
        return Case(cid, "decode", f"{b}x{n}", Batch((1,) * b, (n,) * b), kv_dtype=kv, description=desc)

    out: list[Case] = []
    for cid in CASE_IDS:
        if cid not in cfg.cases:
            continue
        if cid == "decode":
            b, n = (2, 64) if t else (64, 4096)
            out.append(decode(cid, b, n, "headline decode"))
        elif cid == "decode-long":
            b, n = (1, 256) if t else (4, 32768)
            out.append(decode(cid, b, n, "few long contexts (split-KV territory)"))
        elif cid == "decode-short":
            b, n = (4, 32) if t else (256, 1024)
            out.append(decode(cid, b, n, "many short contexts"))
        elif cid == "decode-medium":
            b, n = (2, 128) if t else (16, 8192)
            out.append(decode(cid, b, n, "medium batch, medium context"))
        elif cid == "decode-single":
            n = 512 if t else 131072
            out.append(decode(cid, 1, n, "one very long context"))
        elif cid == "mixed":
            chunk, ctxs, ndec, dlen, spread = (
                (8, [8, 24], 2, 40, 8) if t else (512, [1024, 3072], 30, 2000, 100))
            dec = [dlen + int(x) for x in torch.randint(-spread, spread + 1, (ndec,), generator=g)]
            qlens = (1,) * ndec + (chunk,) * len(ctxs)
            slens = (*dec, *(c + chunk for c in ctxs))
            out.append(Case(cid, "mixed", f"{len(ctxs)}x{chunk}+{ndec}x~{dlen}", Batch(qlens, slens),
                            description=f"{len(ctxs)} prefill chunks of {chunk} (context {ctxs}) + "
                                        f"{ndec} decodes at ~{dlen}"))
        elif cid == "prefill":
            b, n = (2, 16) if t else (8, 2048)
            out.append(Case(cid, "prefill", f"{b}x{n}", Batch((n,) * b, (n,) * b),
                            description="whole prompts, causal"))
        elif cid in ("decode-int8", "decode-fp8"):
            b, n = (2, 64) if t else (64, 4096)
            kv = cid.rsplit("-", 1)[1]
            out.append(decode(cid, b, n, f"headline decode, {kv} cache", kv=kv))
        elif cid == "decode-fp8-static":
            b, n = (2, 64) if t else (64, 4096)
            out.append(dataclasses.replace(
                decode(cid, b, n, "headline decode, fp8 cache with one static scale per tensor (vLLM's)", kv="fp8"),
                static_scales=True))
        elif cid == "cascade":
            b, prefix, suffix = (4, 32, 8) if t else (64, 4000, 100)
            shared = prefix // cfg.block_size * cfg.block_size
            out.append(Case(cid, "cascade", f"{b}x({prefix}+{suffix})",
                            Batch((1,) * b, (prefix + suffix,) * b,
                                  shared_prefix_blocks=prefix // cfg.block_size),
                            description=f"{b} decodes sharing a {prefix}-token prefix ({shared} tokens "
                                        f"in the same physical blocks) + {suffix}-token suffixes"))
        elif cid == "sweep":
            for n in cfg.sweep_lens:
                for b in cfg.sweep_batches:
                    c = decode(f"sweep-b{b}-l{n}", b, n, f"sweep: batch {b} at {n} tokens")
                    c.group, c.batch = "sweep", b
                    out.append(c)
    return out


# ============================================================================================ data
@dataclasses.dataclass
class CaseData:
    meta: BatchMeta
    cache: KVCache
    tables: list[list[int]]
    q: torch.Tensor
    rows: torch.Tensor  # q rows checked against the reference
    ref: torch.Tensor  # float32 [len(rows), Hq, D]
    checked_reqs: list[int]
    kv_bytes: int
    kv_bytes_logical: int
    qo_bytes: int
    flops: int


def _fill_cache(cache: KVCache, gen_seed: int) -> None:
    """Random K/V (never zeros): randn directly, or quantize_kv codes + scales for int8/fp8."""
    torch.manual_seed(gen_seed)
    if not cache.quantized:
        cache.k.normal_()
        cache.v.normal_()
        return
    nb = cache.num_blocks
    step = max(1, (64 << 20) // max(1, cache.block_size * cache.num_kv_heads * cache.head_dim * 4))
    for dst, sdst in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        for a in range(0, nb, step):
            b = min(nb, a + step)
            x = torch.randn((b - a, *dst.shape[1:]), dtype=cache.dtype, device=dst.device)
            # Static scales: codes of x / scale (one per KV head), the scales left as they are.
            codes, scales = quantize_kv(x, cache.kv_dtype, sdst[0, 0] if cache.static_scales else None)
            if dst.dtype == torch.float8_e4m3fn:  # CPU index/copy kernels lack float8: move bytes
                dst.view(torch.uint8)[a:b].copy_(codes.view(torch.uint8))
            else:
                dst[a:b].copy_(codes)
            if not cache.static_scales:
                sdst[a:b].copy_(scales)


def _index_blocks(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).index_select(0, idx).view(torch.float8_e4m3fn)
    return t.index_select(0, idx)


def _pick_checked(qlens: list[int], limit_reqs: int = 8, limit_rows: int = 4096) -> list[int]:
    """Requests checked against the reference: every prefill (within a row budget), spread decodes."""
    R = len(qlens)
    multi = [r for r in range(R) if qlens[r] > 1]
    chosen: list[int] = []
    rows = 0
    for r in multi:
        if len(chosen) < limit_reqs and (not chosen or rows + qlens[r] <= limit_rows):
            chosen.append(r)
            rows += qlens[r]
    singles = [r for r in range(R) if qlens[r] <= 1]
    room = max(limit_reqs - len(chosen), 2 if singles else 0)
    if singles:
        if len(singles) <= room:
            chosen += singles
        else:
            chosen += [singles[round(i * (len(singles) - 1) / (room - 1))] for i in range(room)] if room > 1 \
                else [singles[0]]
    return sorted(set(chosen))


def _reference_subset(q, cache, meta, tables, reqs) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 reference for requests ``reqs`` on a compact copy of just their blocks."""
    qlens, slens = meta.host()
    bs = cache.block_size
    used = [tables[r][: math.ceil(slens[r] / bs)] for r in reqs]
    uniq = sorted({b for t in used for b in t})
    remap = {b: i for i, b in enumerate(uniq)}
    idx = torch.tensor(uniq or [0], dtype=torch.long, device=cache.device)
    sub = KVCache(
        k=_index_blocks(cache.k, idx), v=_index_blocks(cache.v, idx), kv_dtype=cache.kv_dtype,
        k_scale=None if cache.k_scale is None else cache.k_scale.index_select(0, idx),
        v_scale=None if cache.v_scale is None else cache.v_scale.index_select(0, idx),
        dtype=cache.dtype,
    )
    sub_meta = BatchMeta.from_lists([qlens[r] for r in reqs], [slens[r] for r in reqs],
                                    [[remap[b] for b in t] for t in used], block_size=bs, device=cache.device)
    qsl_t = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc
    qsl = qsl_t.tolist()
    rows = torch.tensor([i for r in reqs for i in range(qsl[r], qsl[r + 1])], dtype=torch.long,
                        device=q.device)
    ref = reference_attention(q.index_select(0, rows), sub, sub_meta, compute_dtype=torch.float32)
    return rows, ref


def _flops(qlens: list[int], slens: list[int], heads: int, head_dim: int) -> int:
    """Exact causal count: each query sees (its position + 1) keys; QK^T and PV are 2 FLOPs each."""
    visible = sum(t * (s - t) + t * (t + 1) // 2 for t, s in zip(qlens, slens, strict=True) if s)
    return 4 * head_dim * heads * visible


def _unique_kv_tokens(tables: list[list[int]], slens: list[int], bs: int) -> int:
    """Tokens of K/V the batch must read at least once (a block shared by several requests counts once)."""
    used: dict[int, int] = {}
    for t, s in zip(tables, slens, strict=True):
        for j in range(math.ceil(s / bs)):
            n = min(bs, s - j * bs)
            if n > used.get(t[j], 0):
                used[t[j]] = n
    return sum(used.values())


def _build_pool(cfg: Config, case: Case, seed: int):
    """The meta (random, non-contiguous blocks; the prefix shared for cascade) and a filled cache."""
    bs = cfg.block_size
    pb = case.lengths.shared_prefix_blocks
    need = blocks_needed(case.seq_lens, bs, shared_prefix_blocks=pb)
    per_block = bs * _bytes_per_token(cfg, case)
    num_blocks = max(need + 1, cfg.min_pool_bytes // per_block)
    alloc = BlockAllocator(num_blocks, shuffle=True, seed=seed)
    tables = allocate_tables(case.seq_lens, bs, alloc, shared_prefix_blocks=pb)
    meta = BatchMeta.from_lists(list(case.query_lens), list(case.seq_lens), tables, block_size=bs,
                                device=cfg.device)
    cache = allocate_kv_cache(num_blocks, bs, cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype,
                              kv_dtype=case.kv_dtype, device=cfg.device, **_static(case))
    _fill_cache(cache, seed)
    return meta, cache, tables


def _static(case: Case) -> dict:
    """``allocate_kv_cache``'s static-scale keywords for ``case`` (none for per-slot scales)."""
    return dict(k_scale=STATIC_SCALE, v_scale=STATIC_SCALE) if case.static_scales else {}


def _bytes_per_token(cfg: Config, case: Case) -> int:
    """K/V bytes a token of ``case``'s cache takes (per-slot scales included; static ones are
    one value for the whole cache)."""
    per_tok = kv_bytes_per_token(cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype, kv_dtype=case.kv_dtype)
    return per_tok - (2 * cfg.kv_heads * 4 if case.static_scales else 0)


def _case_data(cfg: Config, case: Case, meta: BatchMeta, cache: KVCache, tables, seed: int) -> CaseData:
    torch.manual_seed(seed + 7)
    qlens, slens = case.query_lens, case.seq_lens
    n = sum(qlens)
    q = torch.randn(n, cfg.heads, cfg.head_dim, dtype=cfg.dtype, device=cfg.device)
    reqs = _pick_checked(qlens)
    rows, ref = _reference_subset(q, cache, meta, tables, reqs)
    per_tok = _bytes_per_token(cfg, case)
    elem = torch.tensor([], dtype=cfg.dtype).element_size()
    return CaseData(
        meta=meta, cache=cache, tables=tables, q=q, rows=rows, ref=ref, checked_reqs=reqs,
        kv_bytes=_unique_kv_tokens(tables, slens, cfg.block_size) * per_tok,
        kv_bytes_logical=sum(slens) * per_tok,
        qo_bytes=2 * n * cfg.heads * cfg.head_dim * elem,
        flops=_flops(qlens, slens, cfg.heads, cfg.head_dim),
    )


def _materialize(cfg: Config, cases: list[Case]):
    """Yield ``(case, data)``; the sweep points of one length share one pool built for the largest batch."""
    sweep_pools: dict[int, tuple] = {}
    for i, case in enumerate(cases):
        seed = cfg.seed * 1000 + i
        if case.group == "sweep":
            n = case.seq_lens[0]
            if n not in sweep_pools:
                sweep_pools.clear()
                _free(cfg.device)
                bmax = max(c.batch for c in cases if c.group == "sweep" and c.seq_lens[0] == n)
                big = Case("sweep-pool", "decode", f"{bmax}x{n}", Batch((1,) * bmax, (n,) * bmax))
                sweep_pools[n] = _build_pool(cfg, big, seed)
            meta_all, cache, tables_all = sweep_pools[n]
            b = case.batch
            meta = meta_all.select(range(b)) if b < meta_all.num_reqs else meta_all
            yield case, _case_data(cfg, case, meta, cache, tables_all[:b], seed)
        else:
            sweep_pools.clear()
            _free(cfg.device)
            meta, cache, tables = _build_pool(cfg, case, seed)
            yield case, _case_data(cfg, case, meta, cache, tables, seed)
            del meta, cache, tables


def _materialize_safely(cfg: Config, cases: list[Case]):
    """Like ``_materialize``, but a case that cannot be built (out of memory) yields its error."""
    built = {c.id for c in cases}
    gen = _materialize(cfg, cases)
    done: set[str] = set()
    while True:
        try:
            case, data = next(gen)
        except StopIteration:
            return
        except Exception as exc:
            _recover(cfg.device)
            failed = next(c for c in cases if c.id in built - done)
            done.add(failed.id)
            yield failed, exc
            # Resume after the failed case with a fresh generator over the rest.
            rest = [c for c in cases if c.id not in done]
            gen = _materialize(cfg, rest)
            continue
        done.add(case.id)
        yield case, data


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ============================================================================================ checking
def _tolerance_label(tol: Tolerance) -> str:
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
        return False, rel, (f"WRONG: |out-ref| reaches {over:.3g}x the tolerance {_tolerance_label(tol)} "
                            f"(max|out-ref|/max|ref| = {rel:.3g})")
    return True, rel, "ok"


# ============================================================================================ runners
@dataclasses.dataclass
class Row:
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


#: Calls behind the "host us" column: enough for a stable mean, few enough that a tiny batch
#: never fills the launch queue (then the column would time the GPU, not the host).
HOST_CALLS = 200


def _host_us(fn, device: torch.device, calls: int = HOST_CALLS) -> float:
    """Host time of one ``fn()`` in microseconds: ``calls`` calls timed with no sync between
    them (what an engine's Python pays per layer), the device synchronised only at the end."""
    _floor.sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    _floor.sync(device)
    return (t1 - t0) / calls * 1e6


def _short(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def _graph_fn(fn, device):
    """A CUDA graph of ``fn`` (already warmed up) and its replay, or None with why."""
    try:
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream(device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize(device)
        return g.replay, None
    except Exception as exc:
        try:
            torch.cuda.synchronize(device)
        except Exception:
            pass
        return None, _short(exc)


def _run_backend(cfg: Config, case: Case, data: CaseData, name: str, backend: Backend, tol: Tolerance) -> Row:
    row = Row(case.id, case.shape, case.kind, case.group, case.batch, name, name, True,
              tolerance=_tolerance_label(tol))
    spec = AttentionSpec(
        num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, block_size=cfg.block_size,
        dtype=cfg.dtype, kv_dtype=case.kv_dtype, kv_scales="per_tensor" if case.static_scales else "per_slot",
        device=cfg.device.type, decode_only=data.meta.decode_only,
    )
    try:
        reasons = backend.reasons(spec)
    except Exception as exc:
        row.status = f"error: reasons() raised {_short(exc)}"
        return row
    if reasons:
        row.status = "skip: " + "; ".join(reasons)
        return row
    cache = data.cache
    if type(backend).allocate is not Backend.allocate:
        # A backend with its own cache layout: allocate through it and copy if the layout matches.
        try:
            own = backend.allocate(cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim,
                                   dtype=cache.dtype, kv_dtype=cache.kv_dtype, device=cfg.device, **_static(case))
            if own.k.shape != cache.k.shape or own.k.dtype != cache.k.dtype:
                row.status = (f"skip: {name} allocates its cache as {list(own.k.shape)} {own.k.dtype}; "
                              "paged bench fills NHD caches only")
                return row
            for a, b in ((own.k, cache.k), (own.v, cache.v), (own.k_scale, cache.k_scale),
                         (own.v_scale, cache.v_scale)):
                if a is not None and not (own.static_scales and a.dim() == 3):  # static: given above
                    (a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a).copy_(
                        b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
            cache = own
        except Exception as exc:
            row.status = f"error: allocate: {_short(exc)}"
            return row
    q, meta = data.q, data.meta
    try:
        plan = backend.plan(meta)
        out = torch.full_like(q, float("nan"))
        backend.forward(q, cache, plan, out=out)  # first call: compiles / autotunes here
        _floor.sync(cfg.device)
        ok, err, status = _check(out.index_select(0, data.rows), data.ref, tol)
        row.max_rel_err = err if math.isfinite(err) else None
        if not ok:
            row.status = status
            return row
        if type(backend).plan is not Backend.plan:
            row.plan_ms = _floor.host_time_ms(lambda: backend.plan(meta), cfg.device)
        fn = lambda: backend.forward(q, cache, plan, out=out)  # noqa: E731
        row.ms, row.timing = _floor.time_fn(fn, cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
        row.eager_ms = row.ms
        row.host_us = _host_us(fn, cfg.device)
        if cfg.cuda_graph and backend.capabilities.cuda_graphs:
            # Engines replay decode steps from CUDA graphs: the replay time is the kernel's own,
            # without the host-side launch cost that the eager time includes.
            replay, why = _graph_fn(fn, cfg.device)
            if replay is not None:
                row.ms, row.timing = _floor.time_fn(replay, cfg.device, warmup_ms=cfg.warmup_ms,
                                                    rep_ms=cfg.rep_ms)
                row.note = "CUDA graph"
            else:
                row.note = f"graph capture failed ({why}); eager"
    except Exception as exc:
        row.status = f"error: {_short(exc)}"
        if os.environ.get("PAGED_BENCH_TRACEBACK"):
            traceback.print_exc()
        _recover(cfg.device)
    return row


def _bridge_row(cfg: Config, case: Case, data: CaseData, name: str, backend: Backend, tol: Tolerance) -> Row | None:
    """A backend of 256-token blocks only (flash-attn 2) on this workload of smaller blocks,
    through the block-size bridge (``paged_flash_attn2.bridge``), as an engine with 16-token
    blocks runs it: the same K/V re-placed in aligned runs of blocks, the 256-token view of that
    pool, and the table converted in every step's plan (its host time is in the row's plan
    column). None where the bridge does not apply (the backend takes the workload's block size,
    or not 256; a shared prefix)."""
    caps = backend.capabilities
    if 256 % cfg.block_size or caps.accepts_block_size(cfg.block_size) or not caps.accepts_block_size(256) \
            or case.lengths.shared_prefix_blocks:
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
        meta16 = BatchMeta.from_lists(list(case.query_lens), list(case.seq_lens), tables, block_size=bs,
                                      device=cfg.device)
        cache16 = allocate_kv_cache(need + ratio, bs, old.num_kv_heads, old.head_dim, dtype=old.dtype,
                                    kv_dtype=old.kv_dtype, device=cfg.device, **_static(case))
        # Every request's tokens, moved from the workload's random blocks to their aligned runs.
        src, dst = [], []
        for s, t_old, t_new in zip(case.seq_lens, data.tables, tables, strict=True):
            j = torch.arange(s)
            src.append(torch.tensor(t_old[: math.ceil(s / bs)])[j // bs] * bs + j % bs)
            dst.append(torch.tensor(t_new[: math.ceil(s / bs)])[j // bs] * bs + j % bs)
        src_i, dst_i = (torch.cat(x).to(cfg.device) for x in (src, dst))
        for a, b in ((cache16.k, old.k), (cache16.v, old.v), (cache16.k_scale, old.k_scale),
                     (cache16.v_scale, old.v_scale)):
            if a is not None and not (cache16.static_scales and a.dim() == 3):  # static: given above
                a.view(-1, *a.shape[2:])[dst_i] = b.view(-1, *b.shape[2:])[src_i]
        bridged = dataclasses.replace(data, meta=bridge_meta(meta16), cache=bridge_cache(cache16), tables=[])
        row = _run_backend(dataclasses.replace(cfg, block_size=256), case, bridged, name, backend, tol)
        if row.status == "ok" and row.plan_ms is not None:
            row.plan_ms += _floor.host_time_ms(lambda: bridge_meta(meta16), cfg.device)
    except Exception as exc:
        row = Row(case.id, case.shape, case.kind, case.group, case.batch, name, label, True,
                  status=f"error: bridge: {_short(exc)}")
    row.label = label
    return row


def _recover(device: torch.device) -> None:
    try:
        _free(device)
    except Exception:  # a sticky CUDA error: later rows will report it too
        pass


def _contiguous(t: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, n, D] of a uniform-length batch, gathered through the block table."""
    nblk = math.ceil(n / t.shape[1])
    x = t[block_table[:, :nblk].long()]  # [B, nblk, bs, H, D]
    return x.reshape(x.shape[0], nblk * t.shape[1], *t.shape[2:])[:, :n].transpose(1, 2).contiguous()


def _sdpa_rows(cfg: Config, case: Case, data: CaseData, wanted: list[str], tol: Tolerance) -> list[Row]:
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:  # a torch without the context manager
        return [Row(case.id, case.shape, case.kind, case.group, case.batch, b, f"{b} (non-paged)", False,
                    status=f"skip: torch.nn.attention unavailable ({_short(exc)})") for b in wanted]
    kinds = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    B, n = len(case.seq_lens), case.seq_lens[0]
    lq = case.query_lens[0]
    causal = lq > 1
    rows = []
    elem = data.cache.k.element_size()
    need = 2 * B * cfg.kv_heads * n * cfg.head_dim * elem * (1 + cfg.heads // cfg.kv_heads)
    if cfg.device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(cfg.device)[0]:
        return [Row(case.id, case.shape, case.kind, case.group, case.batch, b, f"{b} (non-paged)", False,
                    status="skip: not enough free memory for the contiguous copy") for b in wanted]
    k = _contiguous(data.cache.k, data.meta.block_table, n)  # gathered outside the timed region
    v = _contiguous(data.cache.v, data.meta.block_table, n)
    q = data.q.view(B, lq, cfg.heads, cfg.head_dim).transpose(1, 2)
    group = cfg.heads // cfg.kv_heads
    rep_kv: tuple | None = None
    for b in wanted:
        row = Row(case.id, case.shape, case.kind, case.group, case.batch, b, f"{b} (non-paged)", False,
                  tolerance=_tolerance_label(tol))
        rows.append(row)
        if b not in kinds:
            row.status = f"skip: unknown baseline {b}"
            continue
        if b == "sdpa-cudnn" and cfg.device.type != "cuda":
            row.status = "skip: cuDNN attention needs a CUDA device"
            continue
        def gqa(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        attempts = [("gqa", gqa)]
        if group > 1:
            def repeated(q=q, k=k, v=v):
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
                    _floor.sync(cfg.device)
                    flat = o.transpose(1, 2).reshape(-1, cfg.heads, cfg.head_dim)
                    ok, err, status = _check(flat.index_select(0, data.rows), data.ref, tol)
                    row.max_rel_err = err if math.isfinite(err) else None
                    if not ok:
                        row.status = status
                        break
                    row.ms, row.timing = _floor.time_fn(fn, cfg.device, warmup_ms=cfg.warmup_ms,
                                                        rep_ms=cfg.rep_ms)
                    row.status = "ok"
                    if how != "gqa":
                        row.note = f"{how}: it reads {group}x the K/V"
                break
            except Exception as exc:
                why.append(f"{how}: {_short(exc)}")
                _recover(cfg.device)
        else:
            row.status = "skip: SDPA refused (" + "; ".join(why) + ")"
    return rows


# ============================================================================================ metrics
def _metrics(rows: list[Row], case_info: dict, bw: float, mm: float) -> None:
    total_bytes = case_info["kv_bytes"] + case_info["qo_bytes"]
    floor_bw = total_bytes / bw * 1000
    floor_mm = case_info["flops"] / mm * 1000
    case_info.update(floor_ms_bw=floor_bw, floor_ms_mm=floor_mm, floor_ms=max(floor_bw, floor_mm),
                     bytes=total_bytes)
    ok = [r for r in rows if r.status == "ok" and r.ms]
    best = min((r.ms for r in ok), default=None)
    for r in ok:
        s = r.ms / 1000
        r.gbps = total_bytes / s / 1e9
        r.pct_bw_floor = 100 * floor_bw / r.ms
        r.tflops = case_info["flops"] / s / 1e12
        r.pct_mm_floor = 100 * floor_mm / r.ms
        r.pct_floor = 100 * max(floor_bw, floor_mm) / r.ms
        r.x_fastest = r.ms / best if best else None


# ============================================================================================ output
def _env(cfg: Config, bw: dict, mm: dict, backends: dict) -> dict:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(cfg.device),
        "device_name": "CPU (" + (platform.processor() or platform.machine()) + ")",
        "triton": None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "read_bandwidth_Bps": bw["value"],
        "read_bandwidth_method": bw["method"],
        "read_bandwidth_all_GBps": bw.get("all"),
        "matmul_flops": mm["value"],
        "matmul_method": mm["method"],
        "backends": backends,
        "cpu_note": _CPU_NOTE if cfg.device.type != "cuda" else None,
    }
    if "triton_error" in bw:
        env["read_bandwidth_triton_error"] = bw["triton_error"]
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    if cfg.device.type == "cuda":
        p = torch.cuda.get_device_properties(cfg.device)
        env.update(device_name=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                   memory_GB=round(p.total_memory / 1e9, 1),
                   l2_MB=round(getattr(p, "L2_cache_size", 0) / 1e6, 1),
                   driver=_driver())
    return env


def _driver() -> str | None:
    try:
        import subprocess

        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except Exception:
        return None


def _fmt(v: float | None, width: int, digits: int = 1, suffix: str = "") -> str:
    """Right-aligned number (more decimals for small values), or "-"."""
    if v is None:
        return "-".rjust(width)
    if 0 < abs(v) < 0.01:
        s = f"{v:.1e}"
    elif 0 < abs(v) < 10 ** -digits * 100:
        s = f"{v:.3g}"
    else:
        s = f"{v:.{max(digits, 0)}f}"
    return (s + suffix).rjust(width)


def _print_table(env: dict, cfg: Config, cases: list[dict], rows: list[Row], not_run: dict, out=None) -> None:
    w = (out or sys.stdout).write
    w(f"paged bench — {env['device_name']} · torch {env['torch']}"
      + (f" (CUDA {env['cuda']})" if env.get("cuda") and cfg.device.type == "cuda" else "")
      + f" · triton {env['triton'] or 'absent'} · {env['date']}\n")
    w(f"floor: read {env['read_bandwidth_Bps'] / 1e12:.3f} TB/s ({env['read_bandwidth_method']}) · "
      f"matmul {env['matmul_flops'] / 1e12:.1f} TFLOP/s ({env['matmul_method']})\n")
    w(f"shape: {cfg.heads}/{cfg.kv_heads} heads x {cfg.head_dim}, {_dtype_name(cfg.dtype)}, "
      f"block {cfg.block_size}"
      + ("  (tiny CPU sizes)" if cfg.tiny else "") + "\n")
    if cfg.device.type != "cuda":
        w(f"*** {_CPU_NOTE} ***\n")
    w("GB/s counts the K/V (+ scales, Q, O) the batch must move (a shared prefix once); "
      "%BW = floor(bytes / read bandwidth) / time; %MM = floor(FLOPs / matmul rate) / time.\n\n")
    w("ms: CUDA-graph replay where the backend claims graph safety (as engines run decode), else eager; "
      "eager ms: one forward() call from Python, host launch cost included; host us: the host's own "
      f"time per forward() ({HOST_CALLS} calls, synchronised only at the end).\n\n")
    head = f"{'case':<18} {'shape':<16} {'backend':<24} {'ms':>9} {'eager ms':>9} {'host us':>8} " \
           f"{'GB/s':>8} {'%BW':>6} {'TFLOP/s':>8} {'%MM':>6} {'x best':>7}  status\n"
    w(head)
    w("-" * (len(head) + 10) + "\n")
    info = {c["id"]: c for c in cases}
    last = None
    for r in rows:
        c = info[r.case]
        compute = c["kind"] in ("prefill", "mixed")
        if last is not None and r.case != last:
            w("\n" if not (r.group == "sweep" and info[last]["group"] == "sweep") else "")
        last = r.case
        status = r.status if len(r.status) <= 110 else r.status[:107] + "..."
        if r.status == "ok":
            extra = []
            if r.plan_ms is not None:
                extra.append(f"plan {r.plan_ms:.3f} ms")
            if r.note:
                extra.append(r.note)
            status = "ok" + (f" ({'; '.join(extra)})" if extra else "")
        w(f"{r.case:<18} {r.shape:<16} {r.label:<24} {_fmt(r.ms, 9, 4)} {_fmt(r.eager_ms, 9, 4)} "
          f"{_fmt(r.host_us, 8, 1)} {_fmt(r.gbps, 8, 0)} "
          f"{_fmt(r.pct_bw_floor, 6, 1, '%')} {_fmt(r.tflops if compute else None, 8, 1)} "
          f"{_fmt(r.pct_mm_floor if compute else None, 6, 1, '%')} {_fmt(r.x_fastest, 7, 2, 'x')}"
          f"  {status}\n")
    w("\nfloors per case: " + "; ".join(
        f"{c['id']} {c['floor_ms_bw']:.4f} ms" + (f" (compute {c['floor_ms_mm']:.4f})" if c["kind"] in
                                                  ("prefill", "mixed") else "")
        for c in cases if "floor_ms_bw" in c and c["group"] != "sweep") + "\n")
    if not_run:
        w("not run on this machine:\n")
        for name, why in not_run.items():
            w(f"  {name}: {why}\n")
    if cfg.device.type != "cuda":
        w(f"*** {_CPU_NOTE} ***\n")


def _plot(path: str, env: dict, cfg: Config, rows: list[Row]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"--plot needs matplotlib ({_short(exc)}); pip install matplotlib"
    sweep = [r for r in rows if r.group == "sweep"]
    lens = sorted({int(r.shape.split("x")[1]) for r in sweep})
    if not lens:
        return "--plot draws the batch-size sweep; it was not run (add --cases sweep)"
    fig, axes = plt.subplots(1, len(lens), figsize=(7 * len(lens), 4.8), squeeze=False)
    bw = env["read_bandwidth_Bps"] / 1e9
    for ax, n in zip(axes[0], lens, strict=True):
        pts = [r for r in sweep if int(r.shape.split("x")[1]) == n]
        for label in dict.fromkeys(r.label for r in pts):
            xs = [(r.batch, r.gbps) for r in pts if r.label == label and r.gbps]
            if xs:
                ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o",
                        linestyle="--" if "non-paged" in label else "-", label=label)
        ax.axhline(bw, color="black", linestyle=":", label=f"floor: read bandwidth {bw:.0f} GB/s")
        ax.set_xscale("log", base=2)
        batches = sorted({r.batch for r in pts})
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("decode batch size (requests)")
        ax.set_ylabel("achieved GB/s of K/V needed")
        ax.set_title(f"decode at {n} tokens · {cfg.heads}/{cfg.kv_heads}x{cfg.head_dim} "
                     f"{_dtype_name(cfg.dtype)} block {cfg.block_size}")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"paged bench · {env['device_name']} · {env['date'][:10]}"
                 + (" · CPU timings, not representative" if cfg.device.type != "cuda" else ""), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ============================================================================================ main
def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, *, registry: Registry | None = None) -> dict:
    """Run the benchmark and return everything (what ``--json`` writes); prints the table."""
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # No GPU: the Triton backends can only run under Triton's interpreter (set before any
        # kernel module is imported, which happens lazily in registry.get below). With
        # --device cpu on a GPU machine it stays off: Triton backends then skip with their reason.
        os.environ["TRITON_INTERPRET"] = "1"
    if registry is None:
        from paged_core import registry as default_registry

        registry = default_registry
    cfg = _config(args)

    # ---- which backends
    asked = _split(args.backend)
    names = registry.names()
    baselines = [] if args.no_baselines else [b for b in SDPA_BASELINES if not asked or b in asked]
    not_run: dict[str, str] = {}
    if cfg.device.type != "cuda" and "sdpa-cudnn" in baselines:
        baselines.remove("sdpa-cudnn")
        not_run["sdpa-cudnn"] = "cuDNN attention needs a CUDA device"
    if asked:
        missing = [a for a in asked if a not in names and a not in SDPA_BASELINES]
        if missing:
            registry.registration(missing[0])  # raises BackendNotFoundError: which, and what to install
        chosen = [a for a in asked if a in names]
    else:
        chosen = [n for n in names if not (n == "reference" and cfg.device.type == "cuda")]
    if not asked and "reference" in names and cfg.device.type == "cuda":
        not_run["reference"] = ("the oracle (host loops, slow) is not timed on a GPU; "
                                "--backend reference times it")
    backends: dict[str, Backend] = {}
    versions: dict[str, Any] = {}
    for name in chosen:
        reg = registry.registration(name)
        versions[name] = {"distribution": reg.distribution or reg.plugin, "version": reg.version}
        try:
            reasons = registry.unavailable(name)
            if reasons:
                not_run[name] = "; ".join(reasons)
                continue
            backends[name] = registry.get(name)
        except Exception as exc:
            not_run[name] = _short(exc)
    for name, why in not_run.items():
        _progress(f"[bench] {name}: not run: {why}")

    # ---- ceilings
    _progress(f"[bench] device {cfg.device}; measuring the read bandwidth and the matmul rate ...")
    bw = _floor.read_bandwidth(cfg.device, gbytes=1.0 if cfg.quick else 4.0)
    mm = _floor.matmul_rate(cfg.device, cfg.dtype)
    env = _env(cfg, bw, mm, versions)
    _progress(f"[bench] read {bw['value'] / 1e9:.0f} GB/s ({bw['method']}); "
              f"matmul {mm['value'] / 1e12:.1f} TFLOP/s ({mm['method']})")
    if cfg.device.type != "cuda":
        _progress(f"[bench] {_CPU_NOTE}; Triton backends run under TRITON_INTERPRET=1 (slow)")

    # ---- cases
    cases = _cases(cfg)
    rows: list[Row] = []
    case_infos: list[dict] = []
    result: dict[str, Any] = {"env": env, "config": cfg.public(), "complete": False}

    def snapshot(complete: bool) -> dict:
        result.update(
            cases=case_infos, rows=[dataclasses.asdict(r) for r in rows], not_run=not_run, complete=complete,
            problems=[{"source": p.source, "stage": p.stage, "message": p.message}
                      for p in registry.problems()],
        )
        if args.json:  # rewritten after every case: a run cut short still leaves its results
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)
        return result

    for i, (case, data) in enumerate(_materialize_safely(cfg, cases)):
        if isinstance(data, BaseException):
            msg = f"error: building the case failed: {_short(data)}"
            _progress(f"[{i + 1}/{len(cases)}] {case.id:<16} {case.shape:<14} {msg}")
            case_infos.append({"id": case.id, "kind": case.kind, "shape": case.shape, "group": case.group,
                               "batch": case.batch, "description": case.description, "error": msg})
            rows.append(Row(case.id, case.shape, case.kind, case.group, case.batch, "-", "-", True,
                            status=msg))
            snapshot(False)
            continue
        info = {
            "id": case.id, "kind": case.kind, "shape": case.shape, "group": case.group, "batch": case.batch,
            "description": case.description, "num_reqs": len(case.seq_lens),
            "num_tokens": sum(case.query_lens),
            "max_seq_len": max(case.seq_lens), "total_context": sum(case.seq_lens), "kv_dtype": case.kv_dtype,
            "kv_scales": "static" if case.static_scales else "per_slot",
            "prefix_tokens": case.lengths.shared_prefix_blocks * cfg.block_size, "kv_bytes": data.kv_bytes,
            "kv_bytes_logical": data.kv_bytes_logical, "qo_bytes": data.qo_bytes, "flops": data.flops,
            "checked_requests": data.checked_reqs, "pool_bytes": _pool_bytes(data.cache),
        }
        case_infos.append(info)
        case_rows: list[Row] = []
        tol = output_tolerance(cfg.dtype, case.kv_dtype)
        info["tolerance"] = _tolerance_label(tol)
        for name, backend in backends.items():
            row = _run_backend(cfg, case, data, name, backend, tol)
            case_rows.append(row)
            _progress(f"[{i + 1}/{len(cases)}] {case.id:<16} {case.shape:<14} {name:<24} "
                      + (f"{row.ms:.4f} ms" if row.status == "ok" else row.status[:140]))
        if case.kind == "cascade":
            # Cascade attention is opt-in (it reads the block table once per step in plan()):
            # time it as an extra row for every backend whose constructor offers it.
            for name in backends:
                if "cascade" not in inspect.signature(type(backends[name]).__init__).parameters:
                    continue
                try:
                    variant = registry.get(name, cascade=True)
                except Exception as exc:
                    row = Row(case.id, case.shape, case.kind, case.group, case.batch, name,
                              f"{name} (cascade)", True, status=f"error: {_short(exc)}")
                else:
                    row = _run_backend(cfg, case, data, name, variant, tol)
                    row.label = f"{name} (cascade)"
                case_rows.append(row)
                _progress(f"[{i + 1}/{len(cases)}] {case.id:<16} {case.shape:<14} {row.label:<24} "
                          + (f"{row.ms:.4f} ms" if row.status == "ok" else row.status[:140]))
        for name, backend in backends.items():
            bridged = _bridge_row(cfg, case, data, name, backend, tol)
            if bridged is not None:
                case_rows.append(bridged)
                _progress(f"[{i + 1}/{len(cases)}] {case.id:<16} {case.shape:<14} {bridged.label:<24} "
                          + (f"{bridged.ms:.4f} ms" if bridged.status == "ok" else bridged.status[:140]))
        if baselines and case.uniform:
            for row in _sdpa_rows(cfg, case, data, baselines, tol):
                case_rows.append(row)
                _progress(f"[{i + 1}/{len(cases)}] {case.id:<16} {case.shape:<14} {row.label:<24} "
                          + (f"{row.ms:.4f} ms" if row.status == "ok" else row.status[:140]))
        _metrics(case_rows, info, bw["value"], mm["value"])
        rows.extend(case_rows)
        del data
        snapshot(False)
    _free(cfg.device)

    snapshot(True)
    _print_table(env, cfg, case_infos, rows, not_run)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        err = _plot(args.plot, env, cfg, rows)
        print(f"plot not written: {err}" if err else f"wrote {args.plot}")
        result["plot_error"] = err
    return result


def replay(path: str, plot: str | None = None) -> dict:
    """The table (and with ``plot`` the sweep's plot) of a run recorded with ``--json``; times nothing."""
    try:
        with open(path) as f:
            result = json.load(f)
        env, conf, cases, rows = result["env"], result["config"], result["cases"], result["rows"]
        fields = {f.name for f in dataclasses.fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in rows]
        conf = {k: v for k, v in conf.items() if k in {f.name for f in dataclasses.fields(Config)}}
        cfg = Config(**{**conf, "device": torch.device(conf["device"]), "dtype": _DTYPES[conf["dtype"]]})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--from-json {path}: not a run written by paged bench --json ({_short(exc)})") from exc
    if not result.get("complete", True):
        print(f"(a run cut short: {path} holds the cases it finished)")
    _print_table(env, cfg, cases, rows, result.get("not_run", {}))
    if plot:
        err = _plot(plot, env, cfg, rows)
        print(f"plot not written: {err}" if err else f"wrote {plot}")
        result["plot_error"] = err
    return result


def _pool_bytes(cache: KVCache) -> int:
    n = cache.k.numel() * cache.k.element_size() * 2
    if cache.k_scale is not None:
        n += cache.k_scale.numel() * 4 * 2
    return n


def main(args: argparse.Namespace, *, registry: Registry | None = None) -> int:
    """``paged bench``. Exit status 0; 1 if any backend was WRONG or raised; 2 on bad options."""
    try:
        for option in ("json", "plot"):
            if getattr(args, option, None):
                check_writable(f"--{option}", getattr(args, option))
        if getattr(args, "from_json", None):
            result = replay(args.from_json, args.plot)
        else:
            result = run(args, registry=registry)
    except PagedError as exc:
        print(f"paged bench: {exc}", file=sys.stderr)
        return 2
    bad = [r for r in result["rows"] if r["status"].startswith(("WRONG", "error"))]
    if bad:
        print(f"paged bench: {len(bad)} result(s) WRONG or failed (see status); they were not timed",
              file=sys.stderr)
        return 1
    return 0
