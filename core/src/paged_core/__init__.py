"""paged-core: the contract, the reference backend and the registry of paged attention backends.

>>> import torch
>>> from paged_core import BatchMeta, registry
>>> meta = BatchMeta.build(query_lens=[5, 1], seq_lens=[5, 40], block_size=16)
>>> backend = registry.get("reference")
>>> cache = backend.allocate(8, 16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
>>> backend.write(cache, torch.randn(6, 2, 64), torch.randn(6, 2, 64), meta)
>>> backend.forward(torch.randn(6, 8, 64), cache, meta).shape
torch.Size([6, 8, 64])
"""

from ._auto import AutoBackend, AutoPlan, TuneTable, tune_table_path
from ._backend import Backend, validation_enabled
from ._batch import BatchMeta, BlockAllocator, shared_prefix_blocks
from ._cache import KVCache, allocate_kv_cache, kv_bytes_per_token
from ._convert import FlashAttnArgs, FlashInferPages, to_flash_attn_args, to_flashinfer_pages
from ._errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    BatchMetaError,
    InputError,
    PagedError,
    PluginError,
    UnsupportedSpecError,
)
from ._merge import merge_states
from ._quant import Q_MAX, dequantize_kv, pack_int4, quantize_kv, static_scale, unpack_int4
from ._reference import ReferenceBackend, reference_attention
from ._registry import Problem, Registration, Registry, registry
from ._spec import (
    KV_DTYPES,
    KV_SCALES,
    PACKED_CODES,
    PER_CHANNEL_KEYS,
    QUANT_FORMATS,
    AttentionSpec,
    Capabilities,
    KVDtype,
)
from ._write import check_write_inputs, write_kv
from .hookspecs import HOOK_API_VERSION, hookimpl

__version__ = "0.1.0"

__all__ = [
    "AutoBackend",
    "AutoPlan",
    "TuneTable",
    "tune_table_path",
    "AttentionSpec",
    "Backend",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "BatchMeta",
    "BatchMetaError",
    "BlockAllocator",
    "Capabilities",
    "FlashAttnArgs",
    "FlashInferPages",
    "HOOK_API_VERSION",
    "InputError",
    "KVCache",
    "KV_DTYPES",
    "KV_SCALES",
    "KVDtype",
    "PagedError",
    "PluginError",
    "Problem",
    "QUANT_FORMATS",
    "PACKED_CODES",
    "PER_CHANNEL_KEYS",
    "Q_MAX",
    "ReferenceBackend",
    "Registration",
    "Registry",
    "UnsupportedSpecError",
    "allocate_kv_cache",
    "check_write_inputs",
    "dequantize_kv",
    "pack_int4",
    "unpack_int4",
    "hookimpl",
    "kv_bytes_per_token",
    "merge_states",
    "quantize_kv",
    "reference_attention",
    "registry",
    "shared_prefix_blocks",
    "static_scale",
    "to_flash_attn_args",
    "to_flashinfer_pages",
    "validation_enabled",
    "write_kv",
]
