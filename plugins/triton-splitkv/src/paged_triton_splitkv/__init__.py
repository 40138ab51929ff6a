"""paged-triton-splitkv: the former name of the ``triton-unified`` backend, kept as a deprecated alias.

Split-KV decoding, cascade attention and the batch-invariant mode are options of
``triton-unified`` (paged-triton-unified), with the same names and defaults. This plugin registers
``triton-splitkv`` as that backend under its former name, ranked below it, and warns when one is
constructed. :func:`merge_states` is ``paged_triton_unified.merge_states``, imported on first use
so that loading this plugin (``paged list``) compiles nothing.
"""

from __future__ import annotations

from typing import Any

from paged_core.hookspecs import Register, hookimpl, pip_install

__version__ = "0.1.0"

__all__ = ["merge_states"]


def __getattr__(name: str) -> Any:
    if name == "merge_states":
        from paged_triton_unified import merge_states

        return merge_states
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_backends(register: Register) -> None:
    # Below triton-unified (25): select() ranks the current name first.
    register(
        "triton-splitkv",
        "paged_triton_splitkv.backend:TritonSplitKVBackend",
        priority=20,
        install=pip_install("'paged-core[triton]'"),
    )
