"""paged-triton-unified: one Triton kernel launch per layer for any mixed batch.

Registers the backend ``triton-unified``; the class lives in :mod:`paged_triton_unified.backend`
and is imported only when used, so that loading the plugin to list backends imports neither
torch nor Triton. The launcher is :func:`paged_triton_unified.launch.unified_attention`; what
both Triton backends share is in the ``paged_triton_common`` distribution.
"""

from __future__ import annotations

from paged_core.hookspecs import hookimpl, pip_install

__version__ = "0.1.0"


@hookimpl
def register_backends(register):
    register(
        "triton-unified",
        "paged_triton_unified.backend:TritonUnifiedBackend",
        priority=20,
        install=pip_install("'paged-core[triton]'"),
    )
