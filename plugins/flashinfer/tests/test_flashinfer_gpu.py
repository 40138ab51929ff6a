"""GPU tests of the flashinfer backend: correctness against the float64 reference and CUDA-graph
replay. Skipped, with the reason, on machines without CUDA or FlashInfer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None),
    reason="needs CUDA and flashinfer",
)
pytestmark = [pytest.mark.gpu, needs_gpu]


def _smoke():
    # Imported by path: tests/ directories of several plugins share sys.path under pytest.
    spec = importlib.util.spec_from_file_location(
        "paged_flashinfer_gpu_smoke", Path(__file__).with_name("smoke_flashinfer_gpu.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASES = {
    "decode_with_padding": ([1] * 6, [70, 0, 130, 1, 17, 0]),
    "mixed_prefill_and_decode": ([5, 16, 21, 1, 1], [37, 16, 21, 70, 130]),
    "prefill_only": ([16, 21, 33], [16, 21, 100]),
}


@pytest.mark.parametrize("kw", [{}, {"window": 8}, {"softcap": 20.0}], ids=["plain", "window", "softcap"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference_float64(case, kw, dtype):
    from paged_flashinfer.backend import FlashInferBackend

    s = _smoke()
    meta, cache, q = s.make_case(*CASES[case], num_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype)
    ok, msg = s.compare(FlashInferBackend(), meta, meta, cache, q, compute_dtype=torch.float64, **kw)
    assert ok, f"[flashinfer/{case}] {msg}"


def test_cuda_graph_replay_after_replan_equals_eager():
    from paged_flashinfer.backend import FlashInferBackend

    ok, msg = _smoke().graph_replay(FlashInferBackend, num_reqs=8, num_heads=8, num_kv_heads=2, head_dim=128, width=8)
    assert ok, f"[flashinfer/cuda_graph] {msg}"


def test_forward_with_a_meta_during_capture_is_refused():
    from paged_flashinfer.backend import FlashInferBackend

    s = _smoke()
    meta, cache, q = s.make_case([1, 1], [20, 40], num_heads=8, num_kv_heads=2, head_dim=128)
    backend = FlashInferBackend()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="plan"):
        with torch.cuda.graph(graph):
            backend.forward(q, cache, meta)


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "with_padding"])
def test_cascade_matches_reference_and_runs_both_levels(padding):
    from paged_core import BatchMeta
    from paged_flashinfer.backend import FlashInferBackend

    s = _smoke()
    qlens, slens = [1, 1, 4, 1, 1], [300, 290, 420, 0 if padding else 333, 257]
    meta, cache, q = s.make_case(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=128)
    # Give every request the first 16 blocks of request 0 (a 256-token prefix cached once).
    table = meta.block_table.clone()
    table[[r for r, n in enumerate(slens) if n], :16] = table[0, :16]
    rows = [row[: -(-n // 16)] for row, n in zip(table.tolist(), slens, strict=True)]
    shared = BatchMeta.from_lists(qlens, slens, rows, block_size=16, device="cuda")
    backend = FlashInferBackend(cascade=True)
    plan = backend.plan(shared, num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    assert plan.cascade is not None and plan.cascade.prefix_blocks == 16
    ok, msg = s.compare(backend, plan, shared, cache, q, compute_dtype=torch.float64)
    assert ok, f"[flashinfer/cascade] {msg}"
    assert "cascade" in s._path_of(backend)
