"""``paged_triton_unified.merge_states``: the public Triton merge, beside core's PyTorch one."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import paged_triton_unified
from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance
from paged_core import merge_states as merge_states_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_exported_from_the_package_and_imported_on_first_use():
    from paged_triton_unified import split_launch

    assert paged_triton_unified.merge_states is split_launch.merge_states
    assert "merge_states" in paged_triton_unified.__all__
    # Loading the plugin (what `paged list` does) must not define the kernels yet.
    code = "import sys, paged_triton_unified; print('paged_triton_unified.split_launch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("with_sinks", [False, True])
def test_nan_lse_gives_nan_in_both_merges(with_sinks):
    g = torch.Generator().manual_seed(3)
    outs = torch.randn(3, 4, 2, 16, generator=g)
    lses = torch.randn(3, 4, 2, generator=g)
    lses[1, 2, 0] = float("nan")
    lses[:, 3, 1] = -math.inf  # a row no part saw: zeros and -inf
    sinks = torch.tensor([0.5, -1.0]) if with_sinks else None
    want_out, want_lse = merge_states_torch(outs, lses, sinks=sinks)
    # Poisoned with a value the merge never produces: every row must be written.
    out, lse = paged_triton_unified.merge_states(
        outs.to(DEVICE),
        lses.to(DEVICE),
        torch.full((4, 2, 16), 123.0, device=DEVICE),
        torch.full((4, 2), 123.0, device=DEVICE),
        sinks=None if sinks is None else sinks.to(DEVICE),
    )
    out, lse = out.cpu(), lse.cpu()
    assert torch.isnan(out[2, 0]).all() and torch.isnan(lse[2, 0])
    assert torch.equal(out[3, 1], torch.zeros(16)) and lse[3, 1].item() == -math.inf
    # The two merges are the same float32 arithmetic: the shared float32 tolerances hold.
    real = ~torch.isnan(want_lse)
    assert_close_to_reference(
        out[real],
        want_out[real].double(),
        backend="triton-unified",
        case="merge",
        tolerance=output_tolerance(torch.float32),
    )
    assert_close_to_reference(
        lse[real],
        want_lse[real].double(),
        backend="triton-unified",
        case="merge",
        what="lse",
        tolerance=lse_tolerance(torch.float32),
    )
