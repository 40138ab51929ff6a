"""triton-splitkv's first forward on a new shape can be captured in a CUDA graph (GPU only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "_test_direct", Path(__file__).resolve().parents[2] / "triton-common" / "tests" / "test_direct.py"
)
_direct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_direct)


@pytest.mark.parametrize("autotune", ["1", "0"], ids=["autotune", "fixed-config"])
@pytest.mark.parametrize("case", _direct.CAPTURE_CASES)
def test_first_call_is_capture_safe(case, autotune, tmp_path):
    _direct.first_call_capture("triton-splitkv", case, tmp_path, autotune)
