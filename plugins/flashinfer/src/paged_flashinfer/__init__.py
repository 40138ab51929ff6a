"""paged-flashinfer: FlashInfer's paged wrappers as the ``flashinfer`` backend of paged-core.

Importing this module imports neither FlashInfer nor CUDA code: the hook registers a dotted
path, and the backend module imports FlashInfer only when it plans a batch. So ``paged list``
works on a machine without a GPU and reports why the backend cannot run there.
"""

from paged_core.hookspecs import Register, hookimpl, pip_install

__version__ = "0.1.0"
__all__ = ["register_backends"]


@hookimpl
def register_backends(register: Register) -> None:
    # Above the Triton backends: FlashInfer was the fastest on every case measured on the
    # NVIDIA H200, so select() prefers it wherever it supports the spec.
    register(
        "flashinfer",
        "paged_flashinfer.backend:FlashInferBackend",
        priority=30,
        install=pip_install("'paged-core[flashinfer]'"),
    )
