"""Memory-safety run of the Triton kernels and write_kv over random and adversarial batches.

On the GPU machine, under NVIDIA's memcheck (issue 9)::

    PAGED_AUTOTUNE=0 compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize.py

Smoke test on the CPU (Triton's interpreter; checks the script and the numbers, not memory)::

    python scripts/sanitize.py --device cpu

Validation is OFF throughout: the kernels alone must keep every access inside its buffer. Each
case prints one line; the run ends with a summary and exits 1 if any case raised or disagreed
with the float64 reference (which masks the same keys the kernels promise to mask) by more than
the conformance suite's tolerance (``paged_conformance.tolerances``). memcheck adds its own exit
code 1 for any out-of-bounds access.

Every tensor is its own exact-size allocation: the cache is built here without write_kv's spill
block, and PyTorch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1, set below),
because memcheck only sees accesses past the end of a cudaMalloc, not past a tensor inside a
cached segment. Sizes are tiny and the shapes few (Triton compiles count against the time).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

# Before torch and triton are imported.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
os.environ.setdefault("PAGED_AUTOTUNE", "0")
_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
_parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (TRITON_INTERPRET=1 smoke test)")
_parser.add_argument("--seed", type=int, default=0)
_parser.add_argument("--random", type=int, default=2, help="random bf16 batches per kernel path (default 2)")
ARGS = _parser.parse_args()
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from paged_conformance.tolerances import assert_close_to_reference, output_tolerance  # noqa: E402
from paged_core import (  # noqa: E402
    BatchMeta,
    KVCache,
    allocate_kv_cache,
    quantize_kv,
    reference_attention,
    registry,
    write_kv,
)
from paged_triton_common.write import write_kv as triton_write_kv  # noqa: E402  # the Triton backends' write

DEV = torch.device(ARGS.device)
HQ, HKV, D, BS = 8, 2, 64, 16  # one model shape: every case reuses the same compiled kernels
NUM_BLOCKS = 40
DTYPE = torch.bfloat16

RESULTS: list[tuple[str, str, str]] = []


def run_case(name: str, fn, *args, **kwargs) -> None:
    """Run ``fn(*args, **kwargs)`` as one case; record ok / FAIL with the reason; one line each."""
    t0 = time.perf_counter()
    try:
        detail = fn(*args, **kwargs) or ""
        status = "ok"
    except Exception as exc:  # a case that raises is a failure of the run, not of the script
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    if DEV.type == "cuda":
        torch.cuda.synchronize()  # a fault surfaces here, attributed to this case
    RESULTS.append((name, status, detail))
    print(f"{status:4} {name:58} {time.perf_counter() - t0:6.2f}s {detail}", flush=True)


# ------------------------------------------------------------------------------ inputs
def exact_cache(kv_dtype: str, gen: torch.Generator, dv: int = D) -> KVCache:
    """A random cache of NUM_BLOCKS blocks, each tensor its own allocation (no spill block);
    ``dv`` is V's head dim (MLA-shaped when it is not D)."""
    k = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen).to(DTYPE)
    v = torch.randn(NUM_BLOCKS, BS, HKV, dv, generator=gen).to(DTYPE)
    if kv_dtype == "auto":
        return KVCache(k=k.to(DEV), v=v.to(DEV), dtype=DTYPE)
    kc, ks = quantize_kv(k, kv_dtype)
    vc, vs = quantize_kv(v, kv_dtype)
    return KVCache(k=kc.to(DEV), v=vc.to(DEV), k_scale=ks.to(DEV), v_scale=vs.to(DEV), kv_dtype=kv_dtype, dtype=DTYPE)


def make_meta(qlens, slens, gen, *, prefix_blocks=0, width=None) -> BatchMeta:
    """A batch over shuffled blocks 1.. of the pool; the first ``prefix_blocks`` shared by all."""
    perm = (1 + torch.randperm(NUM_BLOCKS - 1, generator=gen)).tolist()
    shared, rest = perm[:prefix_blocks], perm[prefix_blocks:]
    tables = []
    for s in slens:
        n = math.ceil(s / BS)
        own = max(0, n - prefix_blocks) if s else 0
        tables.append((shared[: min(n, prefix_blocks)] if s else []) + [rest.pop() for _ in range(own)])
    return BatchMeta.from_lists(qlens, slens, tables, block_size=BS, device=DEV, table_width=width)


def random_requests(gen, *, decode: bool, n: int = 4):
    qlens, slens = [], []
    for _ in range(n):
        s = int(torch.randint(1, 90, (1,), generator=gen))
        q = 1 if decode else int(torch.randint(1, min(s, 20) + 1, (1,), generator=gen))
        qlens.append(q)
        slens.append(s)
    if not decode:  # one padding request with two rows, as in a graph-padded batch
        qlens.append(2)
        slens.append(0)
    return qlens, slens


# ------------------------------------------------------------------------------ attention
PATHS = {
    # name: (registry name, options, decode batches?)
    "unified": ("triton-unified", {"split_kv": False}, False),
    "unified-decode": ("triton-unified", {"split_kv": False}, True),
    "split": ("triton-unified", {"num_splits": 3}, True),
    "cascade": ("triton-unified", {"cascade": True, "min_prefix_tokens": 0}, False),
}


def attention_case(path: str, kv_dtype: str, meta: BatchMeta, cache: KVCache, *, prefix=None, compare=True, gen=None):
    name, options, _ = PATHS[path]
    backend = registry.get(name, validate=False, **options)
    q = torch.randn(meta.num_tokens, HQ, D, generator=gen).to(DTYPE).to(DEV)
    plan = backend.plan(meta, shared_prefix_blocks=prefix) if path == "cascade" else meta
    if path == "cascade" and prefix and plan.prefix_blocks != prefix:
        raise AssertionError(f"plan kept {plan.prefix_blocks} prefix blocks, not {prefix}")
    out = backend.forward(q, cache, plan)
    if not compare:
        return f"finite={bool(torch.isfinite(out).all())}"
    want = reference_attention(q, cache, meta, compute_dtype=torch.float64)
    if out.numel() == 0:
        return "empty"
    return _compare(out, want, name, kv_dtype, meta)


def _compare(out, want, backend: str, kv_dtype: str, meta: BatchMeta) -> str:
    """The conformance suite's comparison and tolerance; raises (a failed case) beyond it."""
    tol = output_tolerance(DTYPE, kv_dtype)
    err = assert_close_to_reference(
        out,
        want,
        backend=backend,
        case="sanitize",
        tolerance=tol,
        query_start_loc=meta.query_start_loc.tolist(),
        seq_lens=meta.seq_lens.tolist(),
    )
    return f"err={err:.1e} (tolerance {tol})"


def bad_block_meta(qlens, slens, gen, bad: int, prefix_blocks=0) -> BatchMeta:
    """Block id ``bad`` in request 1's last block and in request 2's first block after the prefix
    (with no prefix, every key of request 2's first block: its early queries see nothing)."""
    meta = make_meta(qlens, slens, gen, prefix_blocks=prefix_blocks)
    meta.block_table[1, math.ceil(slens[1] / BS) - 1] = bad
    if math.ceil(slens[2] / BS) > prefix_blocks:
        meta.block_table[2, prefix_blocks] = bad
    return meta


def attention_cases(kv_dtype: str, full: bool, dv: int = D) -> None:
    gen = torch.Generator().manual_seed(ARGS.seed)
    cache = exact_cache(kv_dtype, gen, dv)
    mixed = ([5, 1, 3, 1, 2], [40, 33, 20, 70, 0])  # chunk, decode, prompt part, decode, padding
    decode = ([1, 1, 1, 1], [40, 33, 20, 70])
    for path, (_, _, is_decode) in PATHS.items():
        qs, ss = decode if is_decode else mixed
        prefix = 2 if path == "cascade" else 0
        p = {"prefix": prefix} if path == "cascade" else {}
        tag = f"{path:14} kv={kv_dtype:4}" + (f" dv={dv}" if dv != D else "")
        for i in range(ARGS.random if full else 1):
            rq, rs = random_requests(gen, decode=is_decode)
            if path == "cascade":
                # Every real request covers the prefix; the last one stays padding.
                rs = [max(s, 2 * BS) for s in rs[:-1]] + [0]
                rq = [min(q, s) for q, s in zip(rq[:-1], rs[:-1], strict=True)] + [2]
            m = make_meta(rq, rs, gen, prefix_blocks=prefix)
            run_case(f"{tag} random#{i}", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
        for bad in (-1, NUM_BLOCKS, 2**31 - 1):
            m = bad_block_meta(qs, ss, gen, bad, prefix_blocks=prefix)
            run_case(f"{tag} block_id={bad}", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
        # seq_len past the table: keys beyond max_blocks_per_req * block_size are masked.
        m = make_meta(qs, ss, gen, prefix_blocks=prefix)
        past = m.block_table.shape[1] * BS + 20  # 20 keys past the last column of the table
        m.seq_lens[0] = past
        m.seq_lens_cpu[0] = past
        m.max_seq_len = max(m.max_seq_len, past)
        run_case(f"{tag} seq_len>table", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
        if not full:
            continue
        # Only padding requests; then no requests at all; then requests with no new tokens.
        w = max(prefix, 1)  # cascade refuses a declared prefix wider than the table
        m = make_meta([1] * 3 if is_decode else [2, 1, 3], [0, 0, 0], gen, width=w)
        run_case(f"{tag} padding-only", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
        m = make_meta([], [], gen, width=w)
        run_case(f"{tag} empty-batch", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
        if not is_decode:
            m = make_meta([0, 0], [40, 0], gen, prefix_blocks=prefix)
            run_case(f"{tag} zero-tokens", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
            # q_len > seq_len: queries at negative positions see nothing (zeros).
            m = make_meta([5, 1], [40, 33], gen, prefix_blocks=prefix)
            m.seq_lens[0] = 3
            m.seq_lens_cpu[0] = 3
            run_case(f"{tag} q_len>seq_len", attention_case, path, kv_dtype, m, cache, gen=gen, **p)
            # Garbage offsets: decreasing, and past num_tokens. Rows outside [0, N) are never
            # touched; which rows get what is unspecified, so only memory is checked.
            # A new device tensor: on the CPU, from_lists's host mirror is the same tensor, and
            # the mirror keeps the honest offsets the host ints were promised against.
            m = make_meta(*mixed, gen, prefix_blocks=prefix)
            m.query_start_loc = torch.tensor([0, 9, 4, 30, 7, 12], dtype=torch.int32, device=DEV)
            run_case(
                f"{tag} query_start_loc-garbage", attention_case, path, kv_dtype, m, cache, gen=gen, compare=False, **p
            )
        if path == "cascade":
            # A declared prefix the requests do not share (the caller broke its promise):
            # wrong numbers are allowed, out-of-bounds reads are not.
            m = make_meta(*mixed, gen)
            run_case(
                f"{tag} prefix-not-shared", attention_case, path, kv_dtype, m, cache, gen=gen, prefix=2, compare=False
            )
            m = make_meta(*mixed, gen, prefix_blocks=2)
            m.block_table[0, 0] = -1  # the prefix is read through request 0's row
            m.block_table[0, 1] = 2**31 - 1
            run_case(
                f"{tag} prefix-block-bad", attention_case, path, kv_dtype, m, cache, gen=gen, prefix=2, compare=False
            )


def cascade_split_case(kv_dtype: str, meta: BatchMeta, cache: KVCache, prefix: int, *, gen, compare=True):
    """cascade_attention with its prefix pass split along the keys (3 ranges of 128 keys)."""
    from paged_triton_unified.split_launch import cascade_attention

    q = torch.randn(meta.num_tokens, HQ, D, generator=gen).to(DTYPE).to(DEV)
    out = torch.empty_like(q)
    cascade_attention(
        q,
        cache.k,
        cache.v,
        out,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_table=meta.block_table,
        prefix_blocks=prefix,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        scale=D**-0.5,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        prefix_splits=3,
    )
    if not compare:
        return f"finite={bool(torch.isfinite(out).all())}"
    want = reference_attention(q, cache, meta, compute_dtype=torch.float64)
    return _compare(out, want, "triton-unified", kv_dtype, meta)


def cascade_split_cases(kv_dtype: str) -> None:
    gen = torch.Generator().manual_seed(ARGS.seed + 1)
    cache = exact_cache(kv_dtype, gen)
    prefix = 24  # 384 tokens: three 128-key ranges; 15 blocks of the pool left for suffixes
    qlens, slens = [1, 7, 1, 2], [prefix * BS + 40, prefix * BS + 9, prefix * BS - 30, 0]
    tag = f"cascade-split  kv={kv_dtype:4}"
    m = make_meta(qlens, slens, gen, prefix_blocks=prefix)
    run_case(f"{tag} 3 prefix splits", cascade_split_case, kv_dtype, m, cache, prefix, gen=gen)
    m = make_meta(qlens, slens, gen, prefix_blocks=prefix)
    m.block_table[0, prefix - 1] = 2**31 - 1  # a bad id in the last prefix range, read for all
    m.block_table[1, prefix] = -1
    run_case(f"{tag} bad block ids", cascade_split_case, kv_dtype, m, cache, prefix, gen=gen, compare=False)


# ------------------------------------------------------------------------------ write_kv
def write_case(kv_dtype: str, spill: bool, slots: list[int], write=write_kv):
    nb = 6
    num_slots = nb * BS
    if spill:
        cache = allocate_kv_cache(nb, BS, HKV, D, dtype=DTYPE, kv_dtype=kv_dtype, device=DEV)
    else:
        cache = exact_cache(kv_dtype, torch.Generator().manual_seed(1))
        cache = KVCache(
            k=cache.k[:nb].clone(),
            v=cache.v[:nb].clone(),
            kv_dtype=kv_dtype,
            dtype=DTYPE,
            k_scale=None if cache.k_scale is None else cache.k_scale[:nb].clone(),
            v_scale=None if cache.v_scale is None else cache.v_scale[:nb].clone(),
        )
    parts = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    before = [(t.view(torch.uint8) if t.element_size() == 1 else t).clone() for t in parts]
    n = len(slots)
    k = torch.randn(n, HKV, D).to(DTYPE).to(DEV)
    write(cache, k, k, torch.tensor(slots, dtype=torch.int64, device=DEV))
    keep = torch.ones(num_slots, dtype=torch.bool)
    keep[[s for s in slots if 0 <= s < num_slots]] = False
    for t0, t in zip(before, parts, strict=True):
        t1 = t.view(torch.uint8) if t.element_size() == 1 else t
        a = t0.reshape(num_slots, -1)[keep.to(DEV)]
        b = t1.reshape(num_slots, -1)[keep.to(DEV)]
        if not torch.equal(a, b):
            raise AssertionError("write_kv changed a slot it was not given")
    return f"{int((~keep).sum())} of {n} rows written"


def write_cases() -> None:
    num_slots = 6 * BS
    adversarial = [3, num_slots, num_slots + 5, 2**31 - 1, 2**40, -7, -1, num_slots - 1]
    for name, write in (("write_kv", write_kv), ("triton write", triton_write_kv)):
        for kv_dtype in ("auto", "int8", "fp8", "fp8_e5m2"):
            for spill in (True, False):
                tag = f"{name:14} kv={kv_dtype:4} {'allocated' if spill else 'exact'}"
                run_case(f"{tag} adversarial-slots", write_case, kv_dtype, spill, adversarial, write=write)
                run_case(f"{tag} empty", write_case, kv_dtype, spill, [], write=write)


def main() -> int:
    t0 = time.perf_counter()
    print(
        f"device {DEV} ({torch.cuda.get_device_name(DEV) if DEV.type == 'cuda' else 'interpreter'}), "
        f"torch {torch.__version__}, PAGED_AUTOTUNE={os.environ.get('PAGED_AUTOTUNE')}, "
        f"PYTORCH_NO_CUDA_MEMORY_CACHING={os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING')}",
        flush=True,
    )
    reasons = registry.unavailable("triton-unified")
    if reasons:
        print(f"FAIL triton-unified unavailable: {'; '.join(reasons)}")
        return 1
    write_cases()
    attention_cases("auto", full=True)
    attention_cases("int8", full=False)
    attention_cases("fp8", full=False)
    attention_cases("fp8_e5m2", full=False)
    attention_cases("auto", full=False, dv=D // 2)  # MLA-shaped: V narrower than K
    attention_cases("int8", full=False, dv=D // 2)
    cascade_split_cases("auto")
    cascade_split_cases("int8")
    failed = [r for r in RESULTS if r[1] != "ok"]
    print(
        f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} cases ok, {len(failed)} failed, "
        f"{time.perf_counter() - t0:.1f}s"
    )
    for name, _, detail in failed:
        print(f"  FAIL {name}: {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
