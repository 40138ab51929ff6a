"""Quick H200 probe of the Triton kernels (and FlashInfer when importable) on the headline cases.

Not the benchmark (that is ``paged bench``): a tuning aid that prints the autotuner's choice
per case next to the time and the % of the measured read floor. Usage: python scripts/gpu_probe.py
"""

from __future__ import annotations

import sys
import time

import torch
import triton
import triton.language as tl

from paged_core import BatchMeta, registry, reference_attention
from paged_core._cache import quantize_kv

DEV = "cuda"


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_bw() -> float:
    n = 1 << 31  # 4 GiB of bf16
    x = torch.randn(n // 2, device=DEV, dtype=torch.bfloat16).repeat(2)
    BLOCK, ITERS = 4096, 16
    grid = triton.cdiv(n, BLOCK * ITERS)
    out = torch.empty(grid, device=DEV, dtype=torch.float32)
    ms = triton.testing.do_bench(lambda: _read_kernel[(grid,)](x, out, n, BLOCK=BLOCK, ITERS=ITERS), rep=200)
    del x
    return n * 2 / ms / 1e9  # GB/s


def make(query_lens, seq_lens, kv_dtype="auto", hq=32, hkv=8, d=128, bs=16):
    meta = BatchMeta.build(query_lens, seq_lens, block_size=bs, device=DEV, seed=1)
    nb = meta.block_table.max().item() + 1
    shape = (nb, bs, hkv, d)
    from paged_core import allocate_kv_cache

    cache = allocate_kv_cache(nb, bs, hkv, d, dtype=torch.bfloat16, kv_dtype=kv_dtype, device=DEV)
    k = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    if kv_dtype == "auto":
        cache.k.copy_(k), cache.v.copy_(v)
    else:
        kc, ks = quantize_kv(k, kv_dtype)
        vc, vs = quantize_kv(v, kv_dtype)
        cache.k.copy_(kc), cache.v.copy_(vc), cache.k_scale.copy_(ks), cache.v_scale.copy_(vs)
    del k, v
    q = torch.randn(meta.num_tokens, hq, d, device=DEV, dtype=torch.bfloat16)
    kv_bytes = sum(seq_lens) * hkv * d * 2 * (2 if kv_dtype == "auto" else 1)
    if kv_dtype != "auto":
        kv_bytes += sum(seq_lens) * hkv * 4 * 2
    flops = sum(4 * d * hq * sum(s - t + i + 1 for i in range(t)) for t, s in zip(query_lens, seq_lens))
    return meta, cache, q, kv_bytes, flops


def check(backend, q, cache, meta):
    out = backend.forward(q, cache, meta)
    idx = list(range(min(meta.num_reqs, 4)))
    sub = meta.select(idx)
    qsl = meta.query_start_loc.tolist()
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in idx]).to(DEV)
    ref = reference_attention(q[rows], cache, sub, compute_dtype=torch.float32)
    err = ((out[rows].float() - ref).abs().max() / ref.abs().max()).item()
    return err


CASES = {
    "decode 64x4096": ([1] * 64, [4096] * 64),
    "decode 256x1024": ([1] * 256, [1024] * 256),
    "decode 16x8192": ([1] * 16, [8192] * 16),
    "decode 4x32768": ([1] * 4, [32768] * 4),
    "decode 1x131072": ([1], [131072]),
    "mixed 2x512+30": ([512, 512] + [1] * 30, [1024, 1536] + [2000 + 7 * i for i in range(30)]),
    "prefill 8x2048": ([2048] * 8, [2048] * 8),
}


def main() -> int:
    bw = read_bw()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"read bandwidth {bw:.0f} GB/s", flush=True)
    names = [n for n in ("triton-unified", "triton-splitkv", "flashinfer") if not registry.unavailable(n)]
    rows = []
    for case, (ql, sl) in CASES.items():
        for kvd in (["auto", "int8", "fp8"] if case == "decode 64x4096" else ["auto"]):
            meta, cache, q, nbytes, flops = make(ql, sl, kvd)
            for name in names:
                b = registry.get(name)
                spec_ok = True
                try:
                    t0 = time.time()
                    err = check(b, q, cache, meta)
                    tune_s = time.time() - t0
                    plan = b.plan(meta)
                    out = torch.empty_like(q)
                    ms = triton.testing.do_bench(lambda: b.forward(q, cache, plan, out=out), warmup=50, rep=300,
                                                 return_mode="median")
                except Exception as exc:  # report and go on: this is a probe
                    spec_ok = False
                    print(f"{case:18} {kvd:5} {name:15} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                if not spec_ok:
                    continue
                floor_ms = nbytes / bw / 1e6
                tf = flops / ms / 1e9
                cfg = ""
                for mod in ("paged_triton_unified.kernels", "paged_triton_splitkv.kernels"):
                    m = sys.modules.get(mod)
                    if m is not None:
                        for kn in ("unified_attention_kernel", "split_kv_attention_kernel"):
                            k = getattr(m, kn, None)
                            if k is not None and getattr(k, "best_config", None) is not None:
                                cfg += f" {kn[:5]}:{k.best_config}"
                line = (f"{case:18} {kvd:5} {name:15} {ms:8.4f} ms  {100 * floor_ms / ms:5.1f}% floor  "
                        f"{tf:6.1f} TFLOP/s  err {err:.1e}  first-call {tune_s:.1f}s{cfg}")
                rows.append(line)
                print(line, flush=True)
            del cache, q
            torch.cuda.empty_cache()
    print("\n== summary ==")
    for r in rows:
        print(r.split(" first-call")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
