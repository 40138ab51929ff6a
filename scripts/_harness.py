"""The harness of ``gpu_tune.py``, ``prefill_ceiling.py`` and ``gpu_profile.py``: a batch on random
data, a fixed-config call of triton-unified's unified or split-KV launcher on it, its CUDA-graph
replay time and its check against the reference, one printed line per variant.

Not a script: the scripts beside it import it (``import _harness as H``; Python puts a script's
own folder first on ``sys.path``). ``--smoke`` on the script's command line selects tiny shapes on
the CPU under Triton's interpreter; it is read here, at import, because Triton reads
``TRITON_INTERPRET`` when the kernels are imported. Timings are CUDA-graph replays timed by ``paged
bench``'s own timer (``paged_bench.timing``, the one module of the bench the scripts import);
checks use the conformance suite's tolerance
(``paged_conformance.tolerances``). Floors: bytes of K/V (+ scales) read / ``BW``; prefill is
reported in TFLOP/s (causal FLOPs, 4 * D * Hq per visible pair).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.utils._python_dispatch  # noqa: E402
from paged_conformance.tolerances import ConformanceFailure, assert_close_to_reference, output_tolerance  # noqa: E402
from paged_core import BatchMeta, KVCache, allocate_kv_cache, pack_int4, reference_attention  # noqa: E402
from paged_triton_common.backend import kernel_k_scale  # noqa: E402
from paged_triton_unified.launch import LaunchConfig, unified_attention  # noqa: E402
from paged_triton_unified.split_launch import split_decode_attention  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BW = 4.55e12  # read floor measured on the NVIDIA H200 (streaming-read kernel)
HQ, HKV, D, BS = (8, 2, 64, 16) if SMOKE else (32, 8, 128, 16)  # Qwen3-8B attention
SCALE = D**-0.5
DEADLINE_S: float | None = None  # a script's --deadline: report() skips variants after it
T0 = time.time()


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Raises on a device-to-host read (``.item()``, ``int(tensor)``): inside a CUDA-graph
    capture that is an error, so on the CPU (--smoke) a timed call must not do one either."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(
                "the timed call reads a tensor's value on the host, which a CUDA-graph capture "
                "refuses: compute it before building the call"
            )
        return func(*args, **(kwargs or {}))


def graph_ms(fn) -> float:
    """Median ms of ``fn``'s CUDA-graph replays, timed as ``paged bench`` times the backends that
    claim CUDA graphs (``paged_bench.timing``: ``graph_replay``, then ``time_fn``, the L2 flushed
    before each replay). With --smoke: one call on the CPU, which must not read a tensor on the
    host, and NaN."""
    if SMOKE:
        with _NoHostSync():
            fn()
        return float("nan")
    from paged_bench.timing import graph_replay, time_fn

    device = torch.device("cuda")
    fn()
    torch.cuda.synchronize()
    replay, why = graph_replay(fn, device)
    if replay is None:
        raise RuntimeError(f"the call could not be captured in a CUDA graph: {why}")
    return time_fn(replay, device)[0]


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    meta: BatchMeta
    cache: KVCache
    q: torch.Tensor
    nbytes: int  # K/V (+ scale) bytes the batch must read
    flops: int  # causal FLOPs
    check_reqs: list[int]
    kv_dtype: str


def make_case(
    qlens, slens, kv_dtype="auto", seed=1, check_reqs=None, static_scales=False, head_major_scales=False
) -> Case:
    """A batch on random data; ``static_scales``: an 8-bit cache with one scale per tensor (no
    per-key scale to gather) instead of one per slot; ``head_major_scales``: per-slot scales
    stored ``[num_blocks, num_kv_heads, block_size]`` (a block's keys of one head contiguous),
    seen through the contract's ``[num_blocks, block_size, num_kv_heads]`` view."""
    if SMOKE:  # the first, middle and last request, at most 40 tokens each
        keep = sorted({0, len(qlens) // 2, len(qlens) - 1})
        qlens = [min(qlens[r], 20 + 7 * i) for i, r in enumerate(keep)]
        slens = [max(q, min(slens[r], 40 + 9 * i)) for i, (q, r) in enumerate(zip(qlens, keep, strict=True))]
        check_reqs = None
    meta = BatchMeta.build(qlens, slens, block_size=BS, device=DEV, seed=seed)
    nb = int(meta.block_table.max()) + 1
    fixed = dict(k_scale=0.01, v_scale=0.012) if static_scales else {}
    cache = allocate_kv_cache(nb, BS, HKV, D, dtype=torch.bfloat16, device=DEV, kv_dtype=kv_dtype, **fixed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    if kv_dtype == "auto":
        cache.k.normal_(generator=g), cache.v.normal_(generator=g)
    elif kv_dtype == "int8":
        for t in (cache.k, cache.v):
            codes = torch.randint(-127, 128, t.shape, generator=g, device=DEV, dtype=torch.int16)
            t.copy_(codes.to(torch.int8))
    elif kv_dtype in ("int4", "kivi4"):  # codes in [-7, 7], two a byte
        for t in (cache.k, cache.v):
            shape = (*t.shape[:-1], 2 * t.shape[-1])
            t.copy_(pack_int4(torch.randint(-7, 8, shape, generator=g, device=DEV, dtype=torch.int8)))
    else:  # fp8 e4m3: normal codes spread over the format's range
        for t in (cache.k, cache.v):
            t.copy_((torch.randn(t.shape, generator=g, device=DEV) * 100).clamp(-448, 448).to(t.dtype))
    if head_major_scales:
        ks, vs = (torch.empty(nb, HKV, BS, device=DEV).transpose(1, 2) for _ in "kv")
        cache = KVCache(k=cache.k, v=cache.v, kv_dtype=kv_dtype, k_scale=ks, v_scale=vs, dtype=cache.dtype)
    if cache.k_scale is not None and not cache.static_scales:
        for t in (cache.k_scale, cache.v_scale):
            t.copy_(torch.rand(t.shape, generator=g, device=DEV) * 0.02 + 1e-3)
    q = torch.randn(sum(qlens), HQ, D, generator=g, device=DEV).to(torch.bfloat16)
    elem = {"auto": 2, "int4": 0.5, "kivi4": 0.5}.get(kv_dtype, 1)
    scales = 0 if kv_dtype == "auto" or static_scales else 2 * HKV * 4  # float32 per slot, K and V
    if kv_dtype == "kivi4":  # K's per (block, channel), V's per slot
        scales = HKV * D * 4 / BS + HKV * 4
    per_token = 2 * HKV * D * elem + scales
    nbytes = sum(slens) * per_token
    flops = 4 * D * HQ * sum(t * (s - t) + t * (t + 1) // 2 for t, s in zip(qlens, slens, strict=True) if s)
    if check_reqs is None:
        check_reqs = sorted({0, len(qlens) // 2, len(qlens) - 1})
    return Case(meta, cache, q, nbytes, flops, check_reqs, kv_dtype)


def check(case: Case, out: torch.Tensor) -> tuple[float, bool]:
    """(max abs error, within the conformance tolerance) against a float32 reference on the
    check requests only (a compact copy of their blocks)."""
    meta, cache = case.meta, case.cache
    qlens, slens = meta.host()
    qsl = meta.query_start_loc.tolist()
    table = meta.block_table.tolist()
    bs = cache.k.shape[1]  # the case's own block size (BS unless the case chose another)
    used = [table[r][: math.ceil(slens[r] / bs)] for r in case.check_reqs]
    uniq = sorted({b for t in used for b in t})
    remap = {b: i for i, b in enumerate(uniq)}
    idx = torch.tensor(uniq, dtype=torch.long, device=DEV)
    sub = KVCache(
        k=cache.k.index_select(0, idx),
        v=cache.v.index_select(0, idx),
        kv_dtype=cache.kv_dtype,
        k_scale=None if cache.k_scale is None else cache.k_scale.index_select(0, idx),
        v_scale=None if cache.v_scale is None else cache.v_scale.index_select(0, idx),
        dtype=cache.dtype,
    )
    reqs = case.check_reqs
    sub_meta = BatchMeta.from_lists(
        [qlens[r] for r in reqs],
        [slens[r] for r in reqs],
        [[remap[b] for b in t] for t in used],
        block_size=bs,
        device=DEV,
    )
    rows = torch.tensor([i for r in case.check_reqs for i in range(qsl[r], qsl[r + 1])], device=DEV)
    ref = reference_attention(case.q.index_select(0, rows), sub, sub_meta, scale=SCALE, compute_dtype=torch.float32)
    got = out.index_select(0, rows)
    try:
        return assert_close_to_reference(
            got, ref, backend="harness", case="check", tolerance=output_tolerance(got.dtype, case.kv_dtype)
        ), True
    except ConformanceFailure as exc:
        return exc.max_error, False


def report(section: str, name: str, case: Case, fn, out: torch.Tensor, *, tflops: bool = False) -> None:
    if DEADLINE_S is not None and time.time() - T0 > DEADLINE_S:
        print(f"{section:8s} | {name:58s} | skipped (deadline)", flush=True)
        return
    try:
        out.fill_(float("nan"))
        ms = graph_ms(fn)
        err, ok = check(case, out)
    except Exception as exc:  # out of resources, compile errors: report and go on
        first = (str(exc).splitlines() or [""])[0][:90]
        print(f"{section:8s} | {name:58s} | {type(exc).__name__}: {first}", flush=True)
        return
    if tflops:
        perf = f"{case.flops / ms / 1e9:6.1f} TFLOP/s"
    else:
        perf = f"{100 * case.nbytes / BW * 1e3 / ms:5.1f}% of floor ({case.nbytes / BW * 1e3:.3f} ms)"
    flag = "" if ok else "  BAD"
    elapsed = time.time() - T0
    print(f"{section:8s} | {name:58s} | {ms:7.4f} ms | {perf} | err {err:.1e}{flag}  [{elapsed:5.0f}s]", flush=True)


def unified(case: Case, out: torch.Tensor, cfg: LaunchConfig | None):
    m, c = case.meta, case.cache
    return lambda: unified_attention(
        case.q,
        c.k,
        c.v,
        out,
        query_start_loc=m.query_start_loc,
        seq_lens=m.seq_lens,
        block_table=m.block_table,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
        scale=SCALE,
        k_scale=kernel_k_scale(c),
        v_scale=c.v_scale,
        config=cfg,
    )


def cfg(small=(128, 4, 2), large=(64, 8, 2), bq_large=32) -> LaunchConfig:
    """A fixed config: ``small`` for decode-shaped batches (and the key step of a fused launch's
    small tiles), ``large`` for a launch with large tiles of ``bq_large`` query tokens."""
    return LaunchConfig(
        block_q_small=4,
        block_q_large=bq_large,
        block_n=small[0],
        num_warps=small[1],
        num_stages=small[2],
        maxnreg=small[3] if len(small) > 3 else None,
        large_block_n=large[0],
        large_num_warps=large[1],
        large_num_stages=large[2],
    )


def tag(small=None, large=None, bq_large=None) -> str:
    parts = []
    if small:
        parts.append("small {}/w{}/st{}".format(*small) + (f"/r{small[3]}" if len(small) > 3 else ""))
    if large:
        parts.append("large {}/w{}/st{}".format(*large))
    if bq_large:
        parts.append(f"BLOCK_M {bq_large * 4}")
    return " ".join(parts)


def split_call(case: Case, out: torch.Tensor, splits: int, kc: tuple[int, int, int]):
    """triton-unified's split decode at a fixed split count and kernel config (any cache format)."""
    c = case.cache
    kcfg = {"BLOCK_N": kc[0], "num_warps": kc[1], "num_stages": kc[2]}
    max_seq_len = case.meta.max_seq_len  # a host int: the call is captured, where a sync is an error
    return lambda: split_decode_attention(
        case.q,
        c.k,
        c.v,
        out,
        seq_lens=case.meta.seq_lens,
        block_table=case.meta.block_table,
        max_seq_len=max_seq_len,
        scale=SCALE,
        num_splits=splits,
        kernel_config=kcfg,
        k_scale=kernel_k_scale(c),
        v_scale=c.v_scale,
    )
