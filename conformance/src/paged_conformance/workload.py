"""The data of a case: random q/K/V, a paged cache full of context and garbage, the reference.

Everything is drawn on the CPU from the case's seed (so the CPU and a GPU see the same numbers)
and never zero. Blocks come from a shuffled pool with block 0 reserved (``BlockAllocator``), and
a few spare blocks exist, so every request's blocks are non-contiguous and a kernel that reads
a block it should not (block 0, a neighbour's, one past the table) picks up garbage. Slots that
hold no token are filled with garbage too, not zeros: reading past ``seq_len`` shows.

Block tables are what an engine's reused tables look like: wider than the batch needs
(:data:`STALE_COLUMNS` more columns than its longest request), with every column past a
request's own blocks holding a *stale, valid* block id (random, never 0), whose block holds
garbage. A kernel that trusts a zero pad to end a request's blocks reads that garbage.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from paged_core import (
    PACKED_CODES,
    PER_CHANNEL_KEYS,
    Q_MAX,
    QUANT_FORMATS,
    Backend,
    BatchMeta,
    BlockAllocator,
    KVCache,
    allocate_kv_cache,
    reference_attention,
    static_scale,
    write_kv,
)

from .cases import Case
from .tolerances import ConformanceFailure

__all__ = [
    "Workload",
    "build_workload",
    "strided_views",
    "clear_workloads",
    "storage",
    "SPARE_BLOCKS",
    "STALE_COLUMNS",
    "allocate_tables",
    "blocks_needed",
    "with_stale_ids",
    "laid_out_cache",
]

#: Blocks in the pool beyond what the batch needs (plus the reserved block 0): garbage to catch
#: reads through the wrong block id.
SPARE_BLOCKS = 2
#: Block-table columns beyond the longest request's blocks (filled with stale ids, like the rest
#: of every row past its request's blocks): even the longest request has a block "one past".
STALE_COLUMNS = 2


def storage(cache: KVCache) -> dict[str, torch.Tensor]:
    """The cache's per-slot tensors by name, fp8 as uint8 so they can be copied and compared
    bytewise (static scales are not per slot: they are fixed with the cache)."""
    out = {"k": cache.k, "v": cache.v}
    if cache.k_scale is not None and not cache.static_scales:
        out["k_scale"] = cache.k_scale
    if cache.v_scale is not None and not cache.static_scales:
        out["v_scale"] = cache.v_scale
    return {
        n: t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t for n, t in out.items()
    }


@dataclasses.dataclass
class Workload:
    """One case's inputs and expected outputs on one device. Treat every tensor as read-only."""

    case: Case
    device: torch.device
    meta: BatchMeta
    num_blocks: int
    #: [num_tokens, num_heads, head_dim] in the case dtype (a strided view for q_layout="qkv_view").
    q: torch.Tensor
    #: [num_tokens, num_kv_heads, head_dim]: the step's new K/V (padding rows too: never written).
    k_new: torch.Tensor
    v_new: torch.Tensor
    #: float32 [num_heads] or None.
    sinks: torch.Tensor | None
    #: The cache before the step: every request's earlier context, garbage everywhere else.
    cache_before: KVCache
    #: ``cache_before`` with the step written by ``paged_core.write_kv``, the trusted writer.
    cache_after: KVCache
    #: float64 [num_tokens, num_heads, head_dim]: the reference output on ``cache_after``.
    ref_out: torch.Tensor
    #: float64 [num_tokens, num_heads]: the reference log-sum-exp (natural log; -inf for padding).
    ref_lse: torch.Tensor
    #: The static scales (k, v) of a case with ``kv_scales`` "per_head" or "per_tensor":
    #: float32 ``[num_kv_heads]`` or ``[1]``; None for per-slot scales.
    static_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def query_start_loc(self) -> list[int]:
        qsl = self.meta.query_start_loc_cpu
        return (qsl if qsl is not None else self.meta.query_start_loc).tolist()

    @property
    def seq_lens(self) -> list[int]:
        return list(self.case.seq_lens)

    @property
    def padding_rows(self) -> torch.Tensor:
        """bool [num_tokens]: rows of padding requests (must come out as exact zeros)."""
        rows = torch.zeros(self.case.num_tokens, dtype=torch.bool)
        qsl = self.query_start_loc
        for r in self.case.padding_requests:
            rows[qsl[r] : qsl[r + 1]] = True
        return rows

    def rows_of(self, r: int) -> slice:
        qsl = self.query_start_loc
        return slice(qsl[r], qsl[r + 1])

    def fresh_cache(self, backend: Backend, *, static_factor: float = 1.0) -> KVCache:
        """A cache holding ``cache_before``'s contents: allocated by ``backend``, or for a case
        with another ``cache_layout`` a view of a pool laid out that way (an engine's own pool).
        ``static_factor`` multiplies a static-scale case's scales (another layer's scales)."""
        c = self.case
        # Each cache its own copy of the static scales: a backend that wrote into them would
        # change its own cache only, and the checks compare them with these.
        ks, vs = ((t * static_factor).clone() for t in self.static_scales) if self.static_scales else (None, None)
        if c.cache_layout != "nhd":
            cache = laid_out_cache(
                c.cache_layout,
                self.num_blocks,
                c.block_size,
                c.num_kv_heads,
                c.head_dim,
                dtype=c.dtype,
                kv_dtype=c.kv_dtype,
                device=self.device,
                k_scale=ks,
                v_scale=vs,
                head_dim_v=c.dim_v,
            )
        else:
            static: dict[str, Any] = {} if ks is None else {"k_scale": ks, "v_scale": vs}
            # head_dim_v only where it differs: a backend that takes no such keyword stays callable.
            wide = {} if c.dim_v == c.head_dim else {"head_dim_v": c.dim_v}
            cache = backend.allocate(
                self.num_blocks,
                c.block_size,
                c.num_kv_heads,
                c.head_dim,
                dtype=c.dtype,
                kv_dtype=c.kv_dtype,
                device=self.device,
                **static,
                **wide,
            )
        src, dst = storage(self.cache_before), storage(cache)
        for name, t in src.items():
            if name not in dst or dst[name].shape != t.shape or dst[name].dtype != t.dtype:
                got = "nothing" if name not in dst else f"{dst[name].dtype} {list(dst[name].shape)}"
                raise ConformanceFailure(
                    f"[{backend.name}/{c.id}] allocate() returned cache.{name} as {got}; the suite "
                    f"fills caches in the NHD layout of paged_core.allocate_kv_cache "
                    f"({t.dtype} {list(t.shape)})"
                )
            dst[name].copy_(t)
        return cache


def blocks_needed(seq_lens: Sequence[int], block_size: int, *, shared_prefix_blocks: int = 0) -> int:
    """KV blocks a batch occupies: the shared prefix once, then each request's own blocks.

    >>> blocks_needed([40, 36, 0], 16, shared_prefix_blocks=2)  # 3 + 3 blocks, 2 of them shared
    4
    """
    pb = shared_prefix_blocks
    return pb + sum(max(0, math.ceil(s / block_size) - pb) for s in seq_lens)


def allocate_tables(
    seq_lens: Sequence[int], block_size: int, allocator: BlockAllocator, *, shared_prefix_blocks: int = 0
) -> list[list[int]]:
    """Each request's block table, drawn from ``allocator``: the first ``shared_prefix_blocks``
    logical blocks are the same physical blocks in every request (a prefix cached once, as
    parallel sampling and cascade attention see it), the rest its own. The suite's workloads
    and ``paged bench`` build their batches with it. A padding request (seq_len 0) gets ``[]``.
    """
    pb = shared_prefix_blocks
    prefix = allocator.allocate(pb) if pb else []
    tables = []
    for s in seq_lens:
        n = math.ceil(s / block_size)
        tables.append(prefix[: min(pb, n)] + (allocator.allocate(n - pb) if n > pb else []))
    return tables


def with_stale_ids(
    tables: Sequence[Sequence[int]], num_blocks: int, g: torch.Generator, *, extra_columns: int = STALE_COLUMNS
) -> list[list[int]]:
    """Each request's blocks followed by stale, valid block ids (1 .. num_blocks - 1, drawn
    from ``g``) up to a common width: the longest request's blocks plus ``extra_columns``.

    >>> tables = with_stale_ids([[3, 1], []], 5, torch.Generator().manual_seed(0), extra_columns=1)
    >>> [len(t) for t in tables], tables[0][:2], all(1 <= b < 5 for t in tables for b in t)
    ([3, 3], [3, 1], True)
    """
    width = max((len(t) for t in tables), default=0) + extra_columns
    out = []
    for t in tables:
        stale = torch.randint(1, num_blocks, (width - len(t),), generator=g).tolist()
        out.append([*t, *stale])
    return out


def laid_out_cache(
    layout: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    kv_dtype: str = "auto",
    device: torch.device | str = "cpu",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    head_dim_v: int | None = None,
) -> KVCache:
    """A cache whose ``k``/``v`` (and per-slot scales) are NHD views of storage laid out as ``layout``:

    - ``"kv_interleaved"``: one ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` pool,
      ``k = pool[:, 0]`` and ``v = pool[:, 1]`` (FlashInfer's and vLLM's layout);
    - ``"hnd_view"``: ``[num_blocks, num_kv_heads, block_size, head_dim]`` storage per tensor,
      permuted to ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    No spill block: as with an engine's own tensors, a backend must write through the strides.
    With ``k_scale``/``v_scale`` the scales are static (``paged_core.static_scale`` of them).
    ``head_dim_v`` (V's own head dim) is for ``"hnd_view"`` only: one pool holds one head dim.
    """
    store = dtype if kv_dtype == "auto" else QUANT_FORMATS[kv_dtype][0]
    pack = PACKED_CODES.get(kv_dtype, 1)  # int4 codes: two a byte
    nb, bs, h = num_blocks, block_size, num_kv_heads
    d, dv = head_dim // pack, (head_dim if head_dim_v is None else head_dim_v) // pack
    if layout == "kv_interleaved" and dv != d:
        raise ValueError(f"cache layout kv_interleaved holds one head dim; head_dim {d}, head_dim_v {dv}")
    if layout == "kv_interleaved":
        pool = torch.zeros(nb, 2, bs, h, d, dtype=store, device=device)
        k, v = pool[:, 0], pool[:, 1]
        scales = torch.zeros(nb, 2, bs, h, dtype=torch.float32, device=device)
        ks, vs = scales[:, 0], scales[:, 1]
    elif layout == "hnd_view":
        k, v = (torch.zeros(nb, h, bs, w, dtype=store, device=device).permute(0, 2, 1, 3) for w in (d, dv))
        ks, vs = (torch.zeros(nb, h, bs, dtype=torch.float32, device=device).permute(0, 2, 1) for _ in "kv")
    else:
        raise ValueError(f"cache layout {layout!r}; accepted: kv_interleaved, hnd_view")
    quantized = kv_dtype != "auto"
    if kv_dtype in PER_CHANNEL_KEYS:  # one key scale per (block, KV head, channel)
        ks = torch.zeros(nb, h, head_dim, dtype=torch.float32, device=device)
    if quantized and k_scale is not None and v_scale is not None:
        ks, vs = static_scale(k_scale, k, name="k_scale"), static_scale(v_scale, v, name="v_scale")
    return KVCache(
        k=k, v=v, kv_dtype=kv_dtype, k_scale=ks if quantized else None, v_scale=vs if quantized else None, dtype=dtype
    )


def _strided(t: torch.Tensor, fill: int) -> torch.Tensor:
    """``t`` as a stride-2 view of a buffer twice its size whose other elements hold ``fill``
    (for a 2-D tensor: every other column of rows twice as wide, so rows and columns are strided)."""
    buf = torch.full((t.numel() * 2,), fill, dtype=t.dtype, device=t.device)
    if t.dim() == 1:
        view = buf[::2]
    else:
        view = buf.view(t.shape[0], 2 * t.shape[1])[:, ::2]
    view.copy_(t)
    return view


def strided_views(meta: BatchMeta) -> BatchMeta:
    """``meta`` with every tensor a stride-2 view of a persistent buffer (``Case.meta_layout``).

    The numbers in between are a batch of their own: ``seq_lens``'s are the longest request's
    length (valid for every request: the tables hold stale ids past each request's blocks), so
    a kernel that reads it as contiguous computes a wrong but well-formed batch.
    """
    longest = max(meta.max_seq_len, 1)
    return BatchMeta(
        num_reqs=meta.num_reqs,
        query_start_loc=_strided(meta.query_start_loc, 0),
        seq_lens=_strided(meta.seq_lens, longest),
        block_table=_strided(meta.block_table, 0),
        slot_mapping=_strided(meta.slot_mapping, 0),
        block_size=meta.block_size,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        query_start_loc_cpu=None if meta.query_start_loc_cpu is None else _strided(meta.query_start_loc_cpu, 0),
        seq_lens_cpu=None if meta.seq_lens_cpu is None else _strided(meta.seq_lens_cpu, longest),
    )


def _garbage_(cache: KVCache, g: torch.Generator) -> None:
    """Fill every slot (and scale) of ``cache`` with finite, non-zero garbage."""
    for name, t in storage(cache).items():
        shape = tuple(t.shape)
        if name.endswith("scale"):
            val = torch.rand(shape, generator=g) * 0.04 + 0.01
        elif cache.kv_dtype == "int8":
            val = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        elif cache.kv_dtype in PACKED_CODES:
            val = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)  # two codes a byte
        elif cache.kv_dtype in ("fp8", "fp8_e5m2"):
            code_dtype, q_max = QUANT_FORMATS[cache.kv_dtype]
            val = (torch.randn(shape, generator=g) * (q_max / 7)).clamp(-q_max, q_max).to(code_dtype)
            val = val.view(torch.uint8)
        else:
            # Larger than the real keys: a kernel that attends to garbage is far off.
            val = torch.randn(shape, generator=g) * 3
        t.copy_(val.to(device=t.device, dtype=t.dtype))


def _context_slots(meta: BatchMeta, case: Case) -> list[int]:
    """The flat slots of every request's cached context (positions before this step's tokens)."""
    table = meta.block_table.cpu().tolist()
    bs = case.block_size
    slots = []
    for r, (q, s) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        for pos in range(max(s - q, 0) if s else 0):
            slots.append(table[r][pos // bs] * bs + pos % bs)
    return slots


# Workloads are reused by every check and backend of a case. pytest runs one check over all
# backends and cases before the next check, so the CPU cache holds the whole small table
# (a few MB); on a GPU a full-size workload is ~0.3 GB and recomputing one is cheap there.
_CACHE: collections.OrderedDict[tuple[Case, torch.device], Workload] = collections.OrderedDict()
_CACHE_ENTRIES = {"cpu": 64}
_CACHE_ENTRIES_OTHER = 4


def clear_workloads(case_id: str | None = None) -> None:
    """Forget the cached workloads (of the cases called ``case_id`` only, if given)."""
    for key in [k for k in _CACHE if case_id is None or k[0].id == case_id]:
        del _CACHE[key]


def build_workload(case: Case, device: torch.device | str) -> Workload:
    """The data of ``case`` on ``device`` and its float64 reference, drawn once and cached."""
    device = torch.device(device)
    key = (case, device)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    wl = _CACHE[key] = _draw(case, device)
    while len(_CACHE) > _CACHE_ENTRIES.get(device.type, _CACHE_ENTRIES_OTHER):
        _CACHE.popitem(last=False)
    return wl


def _draw(case: Case, device: torch.device) -> Workload:
    assert case.seed is not None  # Case.__post_init__ derives it from the id
    g = torch.Generator().manual_seed(case.seed)
    hq, hkv, d, dt = case.num_heads, case.num_kv_heads, case.head_dim, case.dtype
    dv = case.dim_v
    n = case.num_tokens

    shared = case.shared_prefix_blocks
    needed = blocks_needed(case.seq_lens, case.block_size, shared_prefix_blocks=shared)
    num_blocks = needed + 1 + SPARE_BLOCKS  # + the reserved block 0
    allocator = BlockAllocator(num_blocks, shuffle=True, seed=case.seed)
    tables = allocate_tables(case.seq_lens, case.block_size, allocator, shared_prefix_blocks=shared)
    # Its own generator: the stale ids do not shift the q/K/V draws below.
    tables = with_stale_ids(tables, num_blocks, torch.Generator().manual_seed(case.seed + 1))
    meta = BatchMeta.from_lists(case.query_lens, case.seq_lens, tables, block_size=case.block_size, device=device)
    if case.meta_layout == "strided_views":
        meta = strided_views(meta)

    # Draw q, K, V first, from the seed alone: a case and its copy with another kv_dtype share
    # them, which is what the quantized-vs-full-precision check compares.
    if case.q_layout == "qkv_view":
        qkv = torch.randn(n, hq + 2 * hkv, d, generator=g)
        q = qkv.to(device=device, dtype=dt)[:, :hq]
    elif case.q_layout == "contiguous":
        q = torch.randn(n, hq, d, generator=g).to(device=device, dtype=dt)
    else:
        raise ValueError(f"case {case.id}: q_layout {case.q_layout!r}; accepted: contiguous, qkv_view")
    context_lens = [max(s - q_, 0) for q_, s in zip(case.query_lens, case.seq_lens, strict=True)]
    k_ctx = [torch.randn(c, hkv, d, generator=g) for c in context_lens]
    v_ctx = [torch.randn(c, hkv, dv, generator=g) for c in context_lens]
    k_new = torch.randn(n, hkv, d, generator=g).to(device=device, dtype=dt)
    v_new = torch.randn(n, hkv, dv, generator=g).to(device=device, dtype=dt)
    # Sinks around e^2 ~ 7: comparable to the softmax mass of short contexts, so ignoring them shows.
    sinks = (torch.randn(hq, generator=g) + 2.0).to(device) if case.sinks else None
    if sinks is not None and case.sinks_values == "extreme":
        sinks[0], sinks[-1] = math.inf, -math.inf
    if sinks is not None and case.sinks_layout == "every_other":
        # sinks[h] at buffer[2h]; the elements between are other numbers, so reading the buffer
        # as contiguous shows.
        buffer = torch.stack([sinks.cpu(), torch.randn(hq, generator=g) - 3.0], dim=1).reshape(-1)
        sinks = buffer.to(device)[::2]

    static = _static_scales(case, device)
    fixed = {} if static is None else {"k_scale": static[0], "v_scale": static[1]}
    cache_before = allocate_kv_cache(
        num_blocks, case.block_size, hkv, d, dtype=dt, kv_dtype=case.kv_dtype, device=device, head_dim_v=dv, **fixed
    )
    _garbage_(cache_before, g)
    # A shared prefix's slots are in every request's context: written once, by the first request
    # that holds them (a write with repeated slots may keep any of the values, and a quantized
    # cache's codes and scales are separate writes).
    flat = _context_slots(meta, case)
    first = sorted({slot: i for i, slot in reversed(list(enumerate(flat)))}.values())
    rows = torch.tensor(first, dtype=torch.int64)
    write_kv(
        cache_before,
        torch.cat(k_ctx)[rows].to(device=device, dtype=dt),
        torch.cat(v_ctx)[rows].to(device=device, dtype=dt),
        torch.tensor([flat[i] for i in first], dtype=torch.int64, device=device),
    )

    cache_after = allocate_kv_cache(
        num_blocks, case.block_size, hkv, d, dtype=dt, kv_dtype=case.kv_dtype, device=device, head_dim_v=dv, **fixed
    )
    for name, t in storage(cache_before).items():
        storage(cache_after)[name].copy_(t)
    write_kv(cache_after, k_new, v_new, meta.slot_mapping)

    ref_out, ref_lse = reference_attention(
        q,
        cache_after,
        meta,
        scale=case.scale,
        window=case.window,
        softcap=case.softcap,
        sinks=sinks,
        compute_dtype=torch.float64,
        return_lse=True,
    )
    return Workload(
        case, device, meta, num_blocks, q, k_new, v_new, sinks, cache_before, cache_after, ref_out, ref_lse, static
    )


def _static_scales(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A static-scale case's (k, v) scales: about 5 / q_max, so that unit-normal K/V saturate
    almost never (|x| > 5: p ~ 6e-7), different per KV head for "per_head"."""
    if case.kv_scales == "per_slot":
        return None
    q_max = Q_MAX[case.kv_dtype]
    n = case.num_kv_heads if case.kv_scales == "per_head" else 1
    k = torch.tensor([(5.0 + 0.5 * h) / q_max for h in range(n)], dtype=torch.float32, device=device)
    v = torch.tensor([(5.5 + 0.25 * h) / q_max for h in range(n)], dtype=torch.float32, device=device)
    return k, v
