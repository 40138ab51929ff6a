"""How the Triton plugins' autotuners time a config: in the regime the kernel runs in.

Triton's default timing (``triton.testing.do_bench``) launches the config through
``JITFunction.run``, about 100 us of host work a call, after queueing an L2 flush that takes the
GPU less time than that. A kernel shorter than ~50 us is then timed at the host's pace, not its
own: on an NVIDIA H200 (Triton 3.6, 2026-12-02) every config of the split-KV kernel at
256 and 512 keys per program timed 0.053-0.065 ms, though the chosen ones replay in 0.025 and
0.037-0.041 ms, so the choice among them was noise (the same bench row moved 0.0222-0.0250 ms
between processes). Engines run decode attention from CUDA graphs, and so does the timing here:
one call is captured, and its replays are timed, each after the same L2 flush.

``paged bench`` and the development scripts time replays the same way with the bench's timer
(``paged_bench.timing``); the autotuners keep this one, since a plugin may not depend on the
bench, and a config is captured thread-locally (other threads may be compiling) and timed eagerly
when it cannot be captured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["replay_bench"]

# Milliseconds of warm-up and of timed replays per config (Triton's defaults: 25 and 100). Graph
# replays time alike across processes to 0.0004 ms (NVIDIA H200, 2026-12-03), so 40 ms of them
# are enough to rank configs, and a new shape class's first call waits less for its tuning.
WARMUP_MS = 10
REP_MS = 40


def replay_bench(kernel_call: Callable[[], Any], quantiles: Sequence[float] | None = None) -> Any:
    """Time ``kernel_call`` (one launch of one config) as CUDA-graph replays; the autotuners'
    ``do_bench``, with ``triton.testing.do_bench``'s signature and result (milliseconds; a list
    for ``quantiles``).

    The first call runs eagerly and is not timed: it compiles and loads the config, and a config
    that does not fit (``OutOfResources``) raises there, where the autotuner expects it and times
    the config as infinite. The second call is captured in a graph (thread-local capture mode,
    so the compiles other threads may run meanwhile are not disturbed) and its replays are timed
    by ``do_bench``, which flushes the L2 before each. A call that cannot be captured is timed
    eagerly, as Triton would.
    """
    import torch
    import triton.testing

    kernel_call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            kernel_call()
    except RuntimeError:
        # The capture failed (a call that synchronises or allocates outside the graph's pool):
        # the eager timing is the one that still means something.
        del graph
        torch.cuda.synchronize()
        return triton.testing.do_bench(kernel_call, warmup=WARMUP_MS, rep=REP_MS, quantiles=quantiles)
    try:
        return triton.testing.do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS, quantiles=quantiles)
    finally:
        del graph  # its memory pool goes back before the next config is captured
