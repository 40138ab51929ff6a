"""paged-triton-splitkv: Flash-Decoding for long contexts, the LSE merge, cascade attention.

Registers the backend ``triton-splitkv``; the class lives in :mod:`paged_triton_splitkv.backend`
and is imported only when used.
"""

from paged_core.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_backends(register):
    register(
        "triton-splitkv",
        "paged_triton_splitkv.backend:TritonSplitKVBackend",
        priority=25,
        install="pip install 'paged-core[triton]'",
    )
