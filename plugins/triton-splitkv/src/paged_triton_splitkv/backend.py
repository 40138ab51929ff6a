"""The ``triton-splitkv`` backend: ``triton-unified`` under its former name, deprecated."""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

from paged_triton_common.backend import TritonPlan
from paged_triton_unified.backend import MAX_NUM_SPLITS, TritonUnifiedBackend

__all__ = ["TritonSplitKVBackend", "SplitKVPlan", "MAX_NUM_SPLITS"]

#: What :meth:`TritonSplitKVBackend.plan` returns, by the name this module gave it.
SplitKVPlan = TritonPlan

DEPRECATION = (
    "triton-splitkv is triton-unified under its former name; use registry.get('triton-unified', ...) "
    "with the same options"
)


class TritonSplitKVBackend(TritonUnifiedBackend):
    """:class:`~paged_triton_unified.backend.TritonUnifiedBackend` registered as ``triton-splitkv``:
    the same options, kernels and results. Each construction warns (``DeprecationWarning``)."""

    name = "triton-splitkv"

    # The signature is triton-unified's: inspect.signature, which the registry and the
    # conformance suite read the accepted options from, follows __wrapped__. (mypy does not
    # follow a decorated constructor: calls of this class are not type-checked.)
    @functools.wraps(TritonUnifiedBackend.__init__)  # type: ignore[misc]
    def __init__(self, **options: Any) -> None:
        warnings.warn(DEPRECATION, DeprecationWarning, stacklevel=_callers_level())
        super().__init__(**options)


def _callers_level() -> int:
    """The ``stacklevel`` that names the code asking for the old name: the first caller of
    ``__init__`` outside paged-core, so that ``registry.get("triton-splitkv")`` in a script
    warns at that line (Python shows a DeprecationWarning by default only in ``__main__``)."""
    level, frame = 2, sys._getframe(2)  # 0: this function, 1: __init__, 2: its caller
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "paged_core":
        level, frame = level + 1, frame.f_back
    return level
