"""paged-triton-unified: one Triton kernel launch per layer for any mixed batch.

Registers the backend ``triton-unified``; the class lives in :mod:`paged_triton_unified.backend`
and is imported only when used. The names of ``__all__`` are this distribution's public API
(what other Triton plugins may build on); they are imported on first access, so that loading
the plugin to list backends imports neither torch nor Triton.
"""

from __future__ import annotations

import importlib

from paged_core.hookspecs import hookimpl

__version__ = "0.1.0"

# name -> module of this package that defines it
_PUBLIC = {
    "AUTOTUNE": "kernels",
    "INTERPRET": "kernels",
    "tanh": "kernels",
    "LaunchConfig": "launch",
    "default_config": "launch",
    "occupancy_class": "launch",
    "sm_count": "launch",
    "unified_attention": "launch",
    "replay_bench": "tuning",
    "TritonBackend": "backend",
    "TritonPlan": "backend",
    "TritonUnifiedBackend": "backend",
    "interpreter_reasons": "backend",
}

__all__ = sorted(_PUBLIC)


# No __dir__ that lists them: pluggy reads every attribute dir() names when it registers this
# module, which would import them all.
def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)


@hookimpl
def register_backends(register):
    register(
        "triton-unified",
        "paged_triton_unified.backend:TritonUnifiedBackend",
        priority=20,
        install="pip install 'paged-core[triton]'",
    )
