"""How long a call takes, the way ``paged bench`` times every row.

* :func:`time_fn` — median time of a callable: ``triton.testing.do_bench`` on a GPU (L2 flushed
  before every repetition), CUDA events around each call with a 256 MB buffer written between
  repetitions when Triton is missing, a host clock on the CPU.
* :func:`graph_replay` — a callable captured in a CUDA graph, as engines run decode steps; its
  replay is what :func:`time_fn` then times (``paged bench``'s "ms" of backends that claim CUDA
  graphs, and the development scripts' timings: ``scripts/_harness.py``).
* :func:`host_us` — the host's own time per call, the device synchronised only at the end.
* :func:`host_time_ms` — the wall time of a call synchronised on both sides (``plan``).

Nothing here imports Triton at module import: on a CPU machine ``paged bench`` sets
``TRITON_INTERPRET=1`` before any kernel is decorated.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HOST_CALLS", "graph_replay", "have_triton", "host_time", "host_time_ms", "host_us", "sync", "time_fn"]

_FLUSH_BYTES = 256 * 1024 * 1024


def have_triton() -> bool:
    try:
        import triton
        import triton.testing  # noqa: F401
    except Exception:
        return False
    return True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    method: str = "auto",
) -> tuple[float, str]:
    """``(median ms, how it was timed)`` of ``fn()``; ``fn`` must already have run once (compiled).

    On a GPU the L2 cache is flushed before every repetition, so each call reads its inputs from
    memory as a real layer call would.
    """
    if device.type != "cuda":
        return host_time(fn, device, rep_ms=rep_ms), "host clock (median)"
    if method in ("auto", "do_bench") and have_triton():
        from triton.testing import do_bench

        try:
            ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        except TypeError:  # an old Triton without return_mode
            ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])
            ms = ms[0] if isinstance(ms, (list, tuple)) else ms
        return float(ms), "triton.testing.do_bench (median, L2 flushed)"
    return _event_time(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms), "CUDA events (median, L2 flushed)"


def graph_replay(fn: Callable[[], object], device: torch.device) -> tuple[Callable[[], None], None] | tuple[None, str]:
    """``fn`` (already run once: compiled) captured in a CUDA graph: ``(replay, None)``, or
    ``(None, why)`` when it cannot be captured. ``fn`` runs once more on a side stream before the
    capture (what ``torch.cuda.graphs`` asks for) and the graph is replayed once before it is
    returned, so a replay that fails does so here."""
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
        msg = str(exc).strip().splitlines()
        return None, f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def _event_time(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float, rep_ms: float) -> float:
    flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    est = max(start.elapsed_time(end) / 5, 1e-3)  # includes the flush: an over-estimate, fine
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = min(max(10, int(rep_ms / est)), 2000)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def host_time(fn: Callable[[], Any], device: torch.device, *, rep_ms: float, max_reps: int = 50) -> float:
    """Median ms of ``fn()`` on the host clock, each call synchronised on both sides: as many
    calls as fit in ``rep_ms`` (at least one, at most ``max_reps``)."""
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1000
    while not times or (time.perf_counter() < deadline and len(times) < max_reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def host_time_ms(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls, each synced on both sides (host-side
    planning)."""
    return host_time(fn, device, rep_ms=math.inf, max_reps=reps)


#: Calls behind the "host us" column: enough for a stable mean, few enough that a tiny batch
#: never fills the launch queue (then the column would time the GPU, not the host).
HOST_CALLS = 200


def host_us(fn: Callable[[], Any], device: torch.device, calls: int = HOST_CALLS) -> float:
    """Host time of one ``fn()`` in microseconds: ``calls`` calls timed with no sync between
    them (what an engine's Python pays per layer), the device synchronised only at the end."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync(device)
    return (t1 - t0) / calls * 1e6
