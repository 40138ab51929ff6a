"""triton-unified's autotuner times its configs as CUDA-graph replays (paged_triton_common.tuning)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from paged_triton_common.tuning import replay_bench
from paged_triton_unified import kernels
from triton.runtime.autotuner import Autotuner


def test_every_autotuner_times_configs_as_graph_replays():
    tuners = {name: obj for name, obj in vars(kernels).items() if isinstance(obj, Autotuner)}
    assert "unified_attention_kernel" in tuners
    for name, tuner in tuners.items():
        assert tuner._do_bench is replay_bench, f"{name} times its configs through Triton's launch path"
