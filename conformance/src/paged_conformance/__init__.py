"""paged-conformance: one suite that proves every installed paged-attention backend.

Every backend the ``paged_core`` registry knows (the reference included) runs the same table
of cases (:mod:`.cases`) through the same checks (:mod:`.checks`) against the PyTorch reference
in float64, with one table of tolerances (:mod:`.tolerances`). Three ways in, one verdict::

    pytest --pyargs paged_conformance [--backends NAME,...] [--paged-size small|full]
    paged check [--backend NAME] [--size small|full] [--case TEXT]
    nox -s conformance

Each writes the backend × case matrix to ``conformance-report.md`` and ``.json``.

The names below are imported on first use: this package is also a pytest plugin, loaded by
every pytest run in its environment, and must not import torch until a conformance test runs.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Batch": "cases",
    "Case": "cases",
    "TABLE": "cases",
    "cases": "cases",
    "get_case": "cases",
    "default_size": "cases",
    "default_device": "cases",
    "Tolerance": "tolerances",
    "ConformanceFailure": "tolerances",
    "assert_close_to_reference": "tolerances",
    "output_tolerance": "tolerances",
    "CHECKS": "checks",
    "CheckResult": "checks",
    "NotApplicable": "checks",
    "BackendPool": "backends",
    "Matrix": "report",
    "check_writable": "report",
    "allocate_tables": "workload",
    "blocks_needed": "workload",
    "run": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
