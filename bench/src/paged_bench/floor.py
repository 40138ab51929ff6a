"""The two ceilings ``paged bench`` measures in the same run, the denominators of its floors.

* :func:`read_bandwidth` — the read ceiling: a streaming-read Triton kernel over a 4 GB buffer
  (each program sums one chunk with wide vector loads and writes one value), which reaches more
  than a copy or ``torch.sum``; ``torch.sum`` is the fallback (and the CPU path).
* :func:`matmul_rate` — the dense matrix rate: ``torch.matmul`` of two random 8192² matrices in
  the model dtype (1024² float32 on the CPU).

Nothing here imports Triton at module import: on a CPU machine ``paged bench`` sets
``TRITON_INTERPRET=1`` before any kernel is decorated.
"""

from __future__ import annotations

from typing import Any

import torch

from .timing import have_triton, host_time, time_fn

__all__ = ["Ceiling", "matmul_rate", "read_bandwidth"]


class Ceiling(dict):
    """``{"value": per second, "method": str, ...}``: what was measured and how."""


_READ_KERNEL = None


def _read_kernel() -> Any:
    """The streaming-read kernel, decorated on first use (never at import)."""
    global _READ_KERNEL
    if _READ_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        # Unannotated pointers: Triton reads a kernel's annotations as what to compile it on.
        def stream_read_kernel(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
            # One program reads CHUNK contiguous elements, BLOCK at a time (16-byte vector loads:
            # BLOCK / (32 * num_warps) elements per thread), and writes a single float.
            pid = tl.program_id(0).to(tl.int64)
            base = x_ptr + pid * CHUNK
            offs = tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(0, CHUNK, BLOCK):
                idx = tl.max_contiguous(tl.multiple_of(i + offs, BLOCK), BLOCK)
                acc += tl.load(base + idx).to(tl.float32)
            tl.store(out_ptr + pid, tl.sum(acc, axis=0))

        _READ_KERNEL = stream_read_kernel
    return _READ_KERNEL


def read_bandwidth(device: torch.device, *, gbytes: float = 4.0, warmup_ms: float = 10, rep_ms: float = 50) -> Ceiling:
    """Bytes per second the device reads, measured now (the denominator of every floor)."""
    if device.type != "cuda":
        x = torch.randn(16 * 1024 * 1024, dtype=torch.float32)  # 64 MB
        ms = host_time(lambda: torch.sum(x), device, rep_ms=200, max_reps=10)
        return Ceiling(
            value=x.numel() * 4 / (ms / 1000), method="torch.sum of 64 MB float32 (CPU)", bytes=x.numel() * 4
        )
    results: dict[str, float] = {}
    free = torch.cuda.mem_get_info(device)[0]
    nbytes = int(min(gbytes * 1e9, free * 0.4))
    n = max(1 << 24, (nbytes // 2) >> 20 << 20)  # bf16 elements, a multiple of 2**20
    x = torch.randn(n, dtype=torch.bfloat16, device=device)
    # torch.sum: a lower bound that needs no Triton.
    ms, _ = time_fn(lambda: torch.sum(x, dtype=torch.float32), device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    results["torch.sum"] = n * 2 / (ms / 1000)
    # A device-to-device copy, counting bytes read plus written (for orientation only).
    half = x[: n // 2]
    dst = torch.empty_like(half)
    ms, _ = time_fn(lambda: dst.copy_(half), device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    results["copy (read+write)"] = 2 * half.numel() * 2 / (ms / 1000)
    err = None
    if have_triton():
        try:
            kernel = _read_kernel()
            want = float(torch.sum(x, dtype=torch.float64))
            for chunk, block, warps in (
                (1 << 16, 4096, 8),
                (1 << 16, 2048, 4),
                (1 << 18, 4096, 8),
                (1 << 14, 2048, 4),
                (1 << 17, 8192, 8),
            ):
                if n % chunk:
                    continue
                grid = (n // chunk,)
                out = torch.empty(grid[0], dtype=torch.float32, device=device)
                call = lambda k=kernel, o=out, c=chunk, b=block, w=warps, g=grid: k[g](
                    x, o, CHUNK=c, BLOCK=b, num_warps=w
                )
                call()
                got = float(out.double().sum())
                if abs(got - want) > 1e-3 * n**0.5 + 1e-4 * abs(want):
                    raise RuntimeError(f"stream-read kernel summed {got}, torch.sum says {want}")
                ms, _ = time_fn(call, device, warmup_ms=warmup_ms, rep_ms=rep_ms)
                results[f"triton stream-read chunk={chunk} block={block} warps={warps}"] = n * 2 / (ms / 1000)
        except Exception as exc:  # the floor must not take the benchmark down
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    reads = {k: v for k, v in results.items() if not k.startswith("copy")}
    best = max(reads, key=reads.__getitem__)
    c = Ceiling(value=reads[best], method=best, bytes=n * 2, all={k: round(v / 1e9, 1) for k, v in results.items()})
    if err:
        c["triton_error"] = err
    return c


def matmul_rate(device: torch.device, dtype: torch.dtype, *, warmup_ms: float = 10, rep_ms: float = 50) -> Ceiling:
    """FLOP/s of a dense matrix product in ``dtype`` on random data (8192² on a GPU)."""
    if device.type != "cuda":
        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        ms = host_time(lambda: torch.matmul(a, b), device, rep_ms=200, max_reps=10)
        return Ceiling(value=2 * n**3 / (ms / 1000), method=f"torch.matmul {n}x{n} float32 (CPU)")
    n = 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    torch.matmul(a, b, out=c)
    ms, _ = time_fn(lambda: torch.matmul(a, b, out=c), device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    name = str(dtype).removeprefix("torch.")
    return Ceiling(value=2 * n**3 / (ms / 1000), method=f"torch.matmul {n}x{n} {name}")
