"""paged_triton_common.tuning: the autotuners time configs as CUDA-graph replays."""

from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from paged_triton_common.tuning import replay_bench


def test_a_config_that_does_not_fit_raises_where_the_autotuner_expects_it():
    """Triton's autotuner times a config that raises OutOfResources as infinitely slow: the
    error must leave replay_bench, not be timed or swallowed."""
    from triton.runtime.errors import OutOfResources

    calls = []

    def kernel_call():
        calls.append(1)
        raise OutOfResources(300_000, 232_448, "shared memory")

    with pytest.raises(OutOfResources):
        replay_bench(kernel_call, quantiles=(0.5, 0.2, 0.8))
    assert calls == [1]  # raised by the first, untimed call: nothing was captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing CUDA-graph replays needs a CUDA device")
def test_host_work_around_the_launch_is_not_timed():
    """2 ms of host work per call: Triton's eager timing reports at least that, the replays only
    the kernel (a 4 MB copy, microseconds)."""
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)

    def kernel_call():
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        dst.copy_(src)

    import triton.testing

    eager = triton.testing.do_bench(kernel_call, quantiles=(0.5,))
    eager = eager[0] if isinstance(eager, list) else eager
    replayed = replay_bench(kernel_call, quantiles=(0.5, 0.2, 0.8))
    assert eager >= 1.5, f"eager timing {eager} ms: the host work was expected to show"
    assert replayed[0] < 0.5, f"replay timing {replayed} ms: host work entered the time"
