"""The data of a case: its batch on random, non-contiguous blocks, a cache of random K/V (never
zeros), q, and the float32 reference of a subset of its requests, built once for every backend.
The block tables come from the suite's workload builder (``paged_conformance.allocate_tables``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch
from paged_conformance import Batch, allocate_tables, blocks_needed
from paged_core import (
    PER_CHANNEL_KEYS,
    BatchMeta,
    BlockAllocator,
    KVCache,
    allocate_kv_cache,
    kv_bytes_per_token,
    quantize_kv,
    reference_attention,
)

from .cases import Case
from .config import Config

__all__ = [
    "CaseData",
    "as_bytes",
    "build_pool",
    "count_flops",
    "free",
    "materialize_safely",
    "pick_checked",
    "pool_bytes",
    "recover",
    "unique_kv_tokens",
]


@dataclasses.dataclass
class CaseData:
    """A case made concrete: its batch, a filled cache, q, the reference of the checked rows and
    the bytes and FLOPs the batch needs."""

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
    """Random K/V (never zeros): randn directly, or quantize_kv codes + scales for quantized caches."""
    torch.manual_seed(gen_seed)
    if not cache.quantized:
        cache.k.normal_()
        cache.v.normal_()
        return
    if cache.kv_dtype in PER_CHANNEL_KEYS:
        # Key scales per (block, channel) come from writes; any codes with positive scales are a
        # valid kivi4 cache: random bytes (two codes each) and scales around 2.5 / 7.
        for t in (cache.k, cache.v):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
        for t in cache._scales():
            t.copy_(torch.rand(t.shape, device=t.device) * 0.2 + 0.25)
        return
    nb = cache.num_blocks
    step = max(1, (64 << 20) // max(1, cache.block_size * cache.num_kv_heads * cache.head_dim * 4))
    for dst, sdst, width in ((cache.k, cache.k_scale, cache.head_dim), (cache.v, cache.v_scale, cache.head_dim_v)):
        for a in range(0, nb, step):
            b = min(nb, a + step)
            assert sdst is not None  # a quantized cache has scales
            x = torch.randn((b - a, *dst.shape[1:-1], width), dtype=cache.dtype, device=dst.device)
            # Static scales: codes of x / scale (one per KV head), the scales left as they are.
            codes, scales = quantize_kv(x, cache.kv_dtype, sdst[0, 0] if cache.static_scales else None)
            as_bytes(dst)[a:b].copy_(as_bytes(codes))
            if not cache.static_scales:
                sdst[a:b].copy_(scales)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes viewed as uint8 (the CPU's copy and index kernels lack float8), else ``t``."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


def _index_blocks(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return as_bytes(t).index_select(0, idx).view(t.dtype)


def pick_checked(qlens: Sequence[int], limit_reqs: int = 8, limit_rows: int = 4096) -> list[int]:
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
            chosen += (
                [singles[round(i * (len(singles) - 1) / (room - 1))] for i in range(room)] if room > 1 else [singles[0]]
            )
    return sorted(set(chosen))


def _reference_subset(
    q: torch.Tensor, cache: KVCache, meta: BatchMeta, tables: list[list[int]], reqs: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 reference for requests ``reqs`` on a compact copy of just their blocks."""
    qlens, slens = meta.host()
    bs = cache.block_size
    used = [tables[r][: math.ceil(slens[r] / bs)] for r in reqs]
    uniq = sorted({b for t in used for b in t})
    remap = {b: i for i, b in enumerate(uniq)}
    idx = torch.tensor(uniq or [0], dtype=torch.long, device=cache.device)
    sub = KVCache(
        k=_index_blocks(cache.k, idx),
        v=_index_blocks(cache.v, idx),
        kv_dtype=cache.kv_dtype,
        k_scale=None if cache.k_scale is None else cache.k_scale.index_select(0, idx),
        v_scale=None if cache.v_scale is None else cache.v_scale.index_select(0, idx),
        dtype=cache.dtype,
    )
    sub_meta = BatchMeta.from_lists(
        [qlens[r] for r in reqs],
        [slens[r] for r in reqs],
        [[remap[b] for b in t] for t in used],
        block_size=bs,
        device=cache.device,
    )
    qsl_t = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc
    qsl = qsl_t.tolist()
    rows = torch.tensor([i for r in reqs for i in range(qsl[r], qsl[r + 1])], dtype=torch.long, device=q.device)
    ref = reference_attention(q.index_select(0, rows), sub, sub_meta, compute_dtype=torch.float32)
    return rows, ref


def count_flops(
    qlens: Sequence[int], slens: Sequence[int], heads: int, head_dim: int, head_dim_v: int | None = None
) -> int:
    """Exact causal count: each query sees (its position + 1) keys; QK^T and PV are 2 FLOPs per
    element of their head dims (V's own when given)."""
    visible = sum(t * (s - t) + t * (t + 1) // 2 for t, s in zip(qlens, slens, strict=True) if s)
    return 2 * (head_dim + (head_dim if head_dim_v is None else head_dim_v)) * heads * visible


def unique_kv_tokens(tables: list[list[int]], slens: Sequence[int], bs: int) -> int:
    """Tokens of K/V the batch must read at least once (a block shared by several requests counts once)."""
    used: dict[int, int] = {}
    for t, s in zip(tables, slens, strict=True):
        for j in range(math.ceil(s / bs)):
            n = min(bs, s - j * bs)
            if n > used.get(t[j], 0):
                used[t[j]] = n
    return sum(used.values())


def build_pool(cfg: Config, case: Case, seed: int) -> tuple[BatchMeta, KVCache, list[list[int]]]:
    """The meta (random, non-contiguous blocks; the prefix shared for cascade) and a filled cache."""
    bs = cfg.block_size
    pb = case.lengths.shared_prefix_blocks
    need = blocks_needed(case.seq_lens, bs, shared_prefix_blocks=pb)
    per_block = bs * _bytes_per_token(cfg, case)
    num_blocks = max(need + 1, cfg.min_pool_bytes // per_block)
    alloc = BlockAllocator(num_blocks, shuffle=True, seed=seed)
    tables = allocate_tables(case.seq_lens, bs, alloc, shared_prefix_blocks=pb)
    meta = BatchMeta.from_lists(list(case.query_lens), list(case.seq_lens), tables, block_size=bs, device=cfg.device)
    cache = allocate_kv_cache(
        num_blocks,
        bs,
        cfg.kv_heads,
        cfg.head_dim,
        dtype=cfg.dtype,
        kv_dtype=case.kv_dtype,
        device=cfg.device,
        head_dim_v=cfg.dim_v,
        **case.allocate_kwargs(),
    )
    _fill_cache(cache, seed)
    return meta, cache, tables


def _bytes_per_token(cfg: Config, case: Case) -> int:
    """K/V bytes a token of ``case``'s cache takes (per-slot scales included; static ones are
    one value for the whole cache)."""
    per_tok = kv_bytes_per_token(
        cfg.kv_heads,
        cfg.head_dim,
        dtype=cfg.dtype,
        kv_dtype=case.kv_dtype,
        head_dim_v=cfg.dim_v,
        block_size=cfg.block_size,
    )
    return per_tok - (2 * cfg.kv_heads * 4 if case.static_scales else 0)


def _case_data(
    cfg: Config, case: Case, meta: BatchMeta, cache: KVCache, tables: list[list[int]], seed: int
) -> CaseData:
    torch.manual_seed(seed + 7)
    qlens, slens = case.query_lens, case.seq_lens
    n = sum(qlens)
    q = torch.randn(n, cfg.heads, cfg.head_dim, dtype=cfg.dtype, device=cfg.device)
    reqs = pick_checked(qlens)
    rows, ref = _reference_subset(q, cache, meta, tables, reqs)
    per_tok = _bytes_per_token(cfg, case)
    elem = torch.tensor([], dtype=cfg.dtype).element_size()
    return CaseData(
        meta=meta,
        cache=cache,
        tables=tables,
        q=q,
        rows=rows,
        ref=ref,
        checked_reqs=reqs,
        kv_bytes=unique_kv_tokens(tables, slens, cfg.block_size) * per_tok,
        kv_bytes_logical=sum(slens) * per_tok,
        qo_bytes=n * cfg.heads * (cfg.head_dim + cfg.dim_v) * elem,
        flops=count_flops(qlens, slens, cfg.heads, cfg.head_dim, cfg.dim_v),
    )


def _materialize(cfg: Config, cases: list[Case]) -> Iterator[tuple[Case, CaseData]]:
    """Yield ``(case, data)``; the sweep points of one length share one pool built for the largest batch."""
    sweep_pools: dict[int, tuple[BatchMeta, KVCache, list[list[int]]]] = {}
    for i, case in enumerate(cases):
        seed = cfg.seed * 1000 + i
        if case.group == "sweep":
            n = case.seq_lens[0]
            if n not in sweep_pools:
                sweep_pools.clear()
                free(cfg.device)
                bmax = max(c.batch for c in cases if c.group == "sweep" and c.seq_lens[0] == n)
                big = Case("sweep-pool", "decode", f"{bmax}x{n}", Batch((1,) * bmax, (n,) * bmax))
                sweep_pools[n] = build_pool(cfg, big, seed)
            meta_all, cache, tables_all = sweep_pools[n]
            b = case.batch
            meta = meta_all.select(range(b)) if b < meta_all.num_reqs else meta_all
            yield case, _case_data(cfg, case, meta, cache, tables_all[:b], seed)
        else:
            sweep_pools.clear()
            free(cfg.device)
            meta, cache, tables = build_pool(cfg, case, seed)
            yield case, _case_data(cfg, case, meta, cache, tables, seed)
            del meta, cache, tables


def materialize_safely(cfg: Config, cases: list[Case]) -> Iterator[tuple[Case, CaseData | Exception]]:
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
            recover(cfg.device)
            failed = next(c for c in cases if c.id in built - done)
            done.add(failed.id)
            yield failed, exc
            # Resume after the failed case with a fresh generator over the rest.
            rest = [c for c in cases if c.id not in done]
            gen = _materialize(cfg, rest)
            continue
        done.add(case.id)
        yield case, data


def free(device: torch.device) -> None:
    """Give the device's cached memory back between cases (a large pool must fit next)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def recover(device: torch.device) -> None:
    """:func:`free` after a failure, which must not raise in turn."""
    try:
        free(device)
    except Exception:  # a sticky CUDA error: later rows will report it too
        pass


def pool_bytes(cache: KVCache) -> int:
    """Bytes the whole cache (K, V and per-slot scales) occupies."""
    n = cache.k.numel() * cache.k.element_size() * 2
    if cache.k_scale is not None:
        n += cache.k_scale.numel() * 4 * 2
    return n
