"""paged-triton-splitkv: Flash-Decoding for long contexts, the LSE merge, cascade attention.

Registers the backend ``triton-splitkv``; the class lives in :mod:`paged_triton_splitkv.backend`
and is imported only when used. :func:`merge_states` is ``paged_triton_unified.merge_states``,
the Triton kernel of ``paged_core.merge_states``, where its kernels now live. Like the backend it
is imported on first use, so that loading this plugin (``paged list``) compiles nothing.
"""

from __future__ import annotations

from typing import Any

from paged_core.hookspecs import hookimpl, pip_install

__version__ = "0.1.0"

__all__ = ["merge_states"]


def __getattr__(name: str) -> Any:
    if name == "merge_states":
        from paged_triton_unified import merge_states

        return merge_states
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_backends(register):
    register(
        "triton-splitkv",
        "paged_triton_splitkv.backend:TritonSplitKVBackend",
        priority=25,
        install=pip_install("'paged-core[triton]'"),
    )
