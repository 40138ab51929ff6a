"""paged-triton-unified: paged attention in Triton for any mixed batch, Flash-Decoding where it pays.

Registers the backend ``triton-unified``; the class lives in :mod:`paged_triton_unified.backend`
and is imported only when used, so that loading the plugin to list backends imports neither
torch nor Triton. The launchers are :func:`paged_triton_unified.launch.unified_attention` (one
launch per layer for the whole batch) and, in :mod:`paged_triton_unified.split_launch`, the
split-KV decode and cascade attention; the Triton runtime they build on is the
``paged_triton_common`` distribution.

:func:`merge_states` is the Triton kernel of ``paged_core.merge_states`` (same arguments and
result, plus ``out=`` / ``out_lse=``): call it on CUDA tensors where the merge is on the hot path.
Like the backend it is imported on first use, so that loading this plugin (``paged list``)
compiles nothing and ``TRITON_INTERPRET`` can still be set before the kernels are defined.
"""

from __future__ import annotations

import importlib
from typing import Any

from paged_core.hookspecs import hookimpl, pip_install

__version__ = "0.1.0"

_EXPORTS = {"merge_states": "split_launch"}

__all__ = ["merge_states"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_backends(register):
    # Above the deprecated alias triton-splitkv (the same class), below flashinfer.
    register(
        "triton-unified",
        "paged_triton_unified.backend:TritonUnifiedBackend",
        priority=25,
        install=pip_install("'paged-core[triton]'"),
    )
