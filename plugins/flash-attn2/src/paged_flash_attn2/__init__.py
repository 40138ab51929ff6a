"""paged-flash-attn2: FlashAttention 2's paged varlen kernel behind paged's backend contract.

Registers the backend ``flash-attn2``; the class lives in :mod:`paged_flash_attn2.backend` and is
imported only when used, so listing backends needs neither flash-attn nor CUDA.
:mod:`paged_flash_attn2.bridge` lets an engine whose cache uses 16-token blocks run it
(flash-attn 2 needs ``block_size % 256 == 0``).
"""

from paged_core.hookspecs import Register, hookimpl, pip_install

from .bridge import (
    BridgedAllocator,
    BridgeError,
    big_block_table,
    bridge_cache,
    bridge_meta,
    check_aligned_runs,
    small_block_view,
)

__version__ = "0.1.0"

__all__ = [
    "BridgeError",
    "BridgedAllocator",
    "big_block_table",
    "bridge_cache",
    "bridge_meta",
    "check_aligned_runs",
    "register_backends",
    "small_block_view",
]


@hookimpl
def register_backends(register: Register) -> None:
    register(
        "flash-attn2",
        "paged_flash_attn2.backend:FlashAttn2Backend",
        priority=10,
        install=pip_install("'paged-core[flash-attn]'"),
    )
