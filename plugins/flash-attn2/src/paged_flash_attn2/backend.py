"""The ``flash-attn2`` backend: ``flash_attn_varlen_func(..., block_table=...)`` behind the contract.

flash-attn is imported lazily (inside :func:`_varlen_func` and the availability probe), so this
module imports on any machine; ``registry.names()`` never touches it.

Every capability below was read from the flash-attn 2.8.3 sources (the PyPI sdist,
``flash_attn-2.8.3.tar.gz``, and Dao-AILab/flash-attention on GitHub); each claim names the file.
The adapter relies only on the public ``flash_attn_varlen_func`` signature, which is the same from
2.6 through 2.8.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any, cast

import torch
from paged_core import AttentionSpec, Backend, BatchMeta, Capabilities, KVCache, to_flash_attn_args
from paged_core.hookspecs import pip_install

__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "BUILD_COST",
    "FlashAttn2Backend",
    "FlashAttn2Capabilities",
    "FlashAttn2Plan",
    "HEAD_DIMS",
    "INSTALL",
    "PRUNED_BUILD_INFO",
    "kernel_head_dim",
    "lse_to_paged",
    "varlen_kwargs",
]

#: What installs the backend and flash-attn (shown whenever it is unavailable).
INSTALL = pip_install("'paged-core[flash-attn]'")
#: What that install costs where no prebuilt flash-attn wheel matches torch and CUDA.
BUILD_COST = (
    "without a prebuilt wheel for this torch and CUDA, pip compiles flash-attn from source: "
    "tens of minutes; for Hopper, plugins/flash-attn2/build_sm90.sh builds only the paged "
    "kernels, about 6 minutes on 16 cores"
)
#: The flash-attn versions this adapter was written against (pyproject: flash-attn>=2.6,<3).
MIN_VERSION, MAX_MAJOR = (2, 6), 3

# csrc/flash_attn/flash_api.cpp (mha_varlen_fwd, 2.8.3):
#   TORCH_CHECK(!paged_KV || page_block_size % 256 == 0, "Paged KV cache block size must be divisible by 256")
# and the docstring of flash_attn_with_kvcache in flash_attn/flash_attn_interface.py: "page_block_size
# must be a multiple of 256". tests/test_flash_attn.py runs the paged varlen path with 256 and 512.
BLOCK_SIZE_MULTIPLE = 256

# csrc/flash_attn/flash_api.cpp (mha_varlen_fwd, 2.8.3): TORCH_CHECK(head_size <= 256) and
# TORCH_CHECK(head_size % 8 == 0); csrc/flash_attn/src/static_switch.h HEADDIM_SWITCH rounds every
# such size up to a compiled kernel (32, 64, 96, 128, 192, 256). In 2.6.x the Python wrapper pads
# other sizes to a multiple of 8 instead, which for a paged cache would copy the whole pool per
# call (FlashAttnVarlenFunc.forward: torch.nn.functional.pad(k, ...)): not claimed.
HEAD_DIMS = frozenset(range(8, 257, 8))

#: flash-attn's head-dim kernels (csrc/flash_attn/src/static_switch.h HEADDIM_SWITCH).
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
#: The file ``plugins/flash-attn2/build_sm90.sh`` writes next to a pruned build's
#: ``flash_attn/__init__.py``: the head-dim kernels and dtypes it compiled (JSON).
PRUNED_BUILD_INFO = "paged_pruned_build.json"


def kernel_head_dim(head_dim: int) -> int:
    """The flash-attn kernel a head dim runs on: the next of :data:`KERNEL_HEAD_DIMS` at or above it.

    >>> kernel_head_dim(80), kernel_head_dim(128), kernel_head_dim(136)
    (96, 128, 192)
    """
    return next(k for k in KERNEL_HEAD_DIMS if head_dim <= k)


@dataclasses.dataclass(frozen=True)
class FlashAttn2Capabilities(Capabilities):
    """``Capabilities`` plus a block-size *multiple*, which a finite set of sizes cannot state."""

    #: Every accepted block size is a multiple of this.
    block_size_multiple: int = 1

    def accepts_block_size(self, block_size: int) -> bool:
        return super().accepts_block_size(block_size) and block_size % self.block_size_multiple == 0

    def block_size_reason(self, block_size: int) -> str:
        m = self.block_size_multiple
        return (
            f"block_size {block_size} is not supported: flash-attn 2's paged KV path needs "
            f"block_size % {m} == 0 (accepted: {m}, {2 * m}, ...); allocate the cache with "
            f"{m}-token blocks, or keep 16-token blocks and run through paged_flash_attn2.bridge"
        )

    def summary(self) -> str:
        text = super().summary().replace("block any", f"block multiple of {self.block_size_multiple}")
        dims = sorted(self.head_dims or ())
        steps = {b - a for a, b in zip(dims, dims[1:], strict=False)}
        if len(dims) > 4 and len(steps) == 1:  # 32 sizes in a row read better as a range
            text = re.sub(r"^head_dim [^;]*;", f"head_dim {dims[0]}..{dims[-1]} step {steps.pop()};", text)
        return text


# ------------------------------------------------------------------------------ availability
def _version_tuple(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str, ...]:
    """Why flash-attn 2 cannot run here (empty: it can). Cached: it imports a CUDA extension."""
    return (*_package_reasons(), *_device_reasons())


def _package_reasons() -> list[str]:
    if importlib.util.find_spec("flash_attn") is None:
        return [f"flash-attn is not installed (to fix: {INSTALL}; {BUILD_COST})"]
    version: str | None
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        version = None  # on sys.path without metadata (a source build): ask the module below
    try:
        flash_attn = importlib.import_module("flash_attn")
        flash_attn.flash_attn_varlen_func  # noqa: B018 - the one entry point the adapter uses
    except Exception as exc:  # undefined symbols, CUDA/torch ABI mismatch, missing libcudart ...
        return [
            f"flash-attn is installed but does not import: {type(exc).__name__}: {exc} (to fix: "
            "pip install --force-reinstall --no-build-isolation 'flash-attn>=2.6,<3')"
        ]
    # ``flash_attn.__version__`` is the version string (the module is untyped to mypy).
    version = cast(str, version or getattr(flash_attn, "__version__", "0.0"))
    v = _version_tuple(version)
    if not (MIN_VERSION <= v and v[0] < MAX_MAJOR):
        return [
            f"flash-attn {version} is installed; accepted: >=2.6,<3 (to fix: "
            "pip install --no-build-isolation 'flash-attn>=2.6,<3')"
        ]
    return []


def _device_reasons() -> list[str]:
    if not torch.cuda.is_available():
        return [
            "no CUDA device is visible; flash-attn 2 runs on NVIDIA GPUs of compute capability "
            "8.0 or newer (to fix: run on such a machine, with a CUDA build of torch)"
        ]
    # flash_api.cpp: TORCH_CHECK(cc_major >= 8, "FlashAttention only supports Ampere GPUs or newer.")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return [
            f"the GPU has compute capability {major}.{minor}; flash-attn 2 needs 8.0 or newer "
            "(to fix: run on an Ampere, Ada or Hopper GPU)"
        ]
    return []


@functools.lru_cache(maxsize=1)
def _pruned_build() -> tuple[pathlib.Path, frozenset[int], frozenset[str]] | None:
    """(marker file, compiled head-dim kernels, compiled dtypes) of a pruned flash-attn build;
    None for a full one (no marker) or when flash-attn does not import."""
    try:
        where = getattr(importlib.import_module("flash_attn"), "__file__", None)
    except Exception:
        return None
    marker = pathlib.Path(where).parent / PRUNED_BUILD_INFO if where else None
    if marker is None or not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    return marker, frozenset(int(d) for d in info["head_dims"]), frozenset(info["dtypes"])


def _build_reasons(head_dim: int, dtype: torch.dtype) -> list[str]:
    """What a pruned build (plugins/flash-attn2/build_sm90.sh) lacks for this head dim and dtype:
    flash-attn would stop inside its kernel dispatch with a TORCH_CHECK."""
    build = _pruned_build()
    if build is None or head_dim > KERNEL_HEAD_DIMS[-1]:
        return []
    marker, dims, dtypes = build
    out = []
    kernel = kernel_head_dim(head_dim)
    if kernel not in dims:
        out.append(
            f"head_dim {head_dim} runs on flash-attn's head-dim-{kernel} kernel, which this pruned build "
            f"does not have (compiled: {', '.join(map(str, sorted(dims)))}; {marker}); to fix: rebuild with "
            f'FA_HEAD_DIMS="{" ".join(map(str, sorted(dims | {kernel})))}" bash plugins/flash-attn2/build_sm90.sh'
        )
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if name is not None and name not in dtypes:
        out.append(
            f"dtype {name} is not in this pruned build (compiled: {', '.join(sorted(dtypes))}; {marker}); "
            f'to fix: rebuild with FA_DTYPES="{" ".join(sorted(dtypes | {name}))}"'
        )
    return out


def _varlen_func() -> Callable[..., Any]:
    return importlib.import_module("flash_attn").flash_attn_varlen_func


# ------------------------------------------------------------------------------ plan
@dataclasses.dataclass
class FlashAttn2Plan:
    """A batch in flash-attn's terms, built once per step by :meth:`FlashAttn2Backend.plan`.

    Every tensor is on the batch's device and was computed there without a host sync.
    """

    meta: BatchMeta
    #: int32 [num_reqs + 1]: query offsets (``meta.query_start_loc``).
    cu_seqlens_q: torch.Tensor
    #: int32 [num_reqs + 1]: prefix sums of ``seq_lens``, a padding request (``seq_len == 0``)
    #: counted as 1 key (see :meth:`FlashAttn2Backend._plan`); in the paged path flash-attn reads
    #: only the differences (each request's key count), K/V come through the block table.
    cu_seqlens_k: torch.Tensor
    #: int32 [num_reqs, max_blocks]: the block table, contiguous in its last dim as flash-attn
    #: checks; a padding request's first entry is block 0 (its one key).
    block_table: torch.Tensor
    #: Host int handed to flash-attn as ``max_seqlen_q`` (see :meth:`FlashAttn2Backend.plan`).
    max_seqlen_q: int
    max_seqlen_k: int
    #: int64 [num_tokens]: the request of each query row.
    token_req: torch.Tensor
    #: int64 [num_tokens]: each row's index within its request's new tokens.
    token_pos: torch.Tensor
    #: bool [num_tokens]: rows of padding requests (``seq_len == 0``), forced to exact zeros.
    pad_rows: torch.Tensor


def varlen_kwargs(
    q: torch.Tensor,
    cache: KVCache,
    plan: FlashAttn2Plan,
    *,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of ``flash_attn.flash_attn_varlen_func`` for one layer.

    The cache tensors are passed as they are (NHD ``[num_blocks, block_size, kv_heads, head_dim]``
    is flash-attn's paged layout, flash_api.cpp: CHECK_SHAPE(k, num_blocks, page_block_size,
    num_heads_k, head_size)).
    """
    # flash-attn moves a decode batch's query heads into its sequence dimension (flash_api.cpp
    # mha_varlen_fwd: seqlenq_ngroups_swapped when max_seqlen_q == 1 and num_heads >
    # num_heads_k, no window) and, on its unsplit path, leaves softmax_lse in (kv head, request,
    # group) order under the [num_heads, total_q] shape: on the H200 (2026-12-01) the lse of a
    # 300-request decode batch was wrong in 9,501 of 9,600 elements. Any bound at or above the
    # longest query is valid, and 2 keeps the plain layout; only calls that return the lse pay.
    max_seqlen_q = max(plan.max_seqlen_q, 2) if return_lse else plan.max_seqlen_q
    return dict(
        q=q,
        k=cache.k,
        v=cache.v,
        cu_seqlens_q=plan.cu_seqlens_q,
        cu_seqlens_k=plan.cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=plan.max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=scale,
        # Bottom-right aligned (flash_attn_interface.py, flash_attn_varlen_func docstring: "the
        # causal mask is aligned to the bottom right corner"): query i of a request with sq new
        # tokens and sk keys sees keys <= i + sk - sq, which is our rule of positions.
        causal=True,
        # Query i sees keys in [i + sk - sq - left, i + sk - sq + right] (same docstring): our
        # window w keeps keys > p - w, i.e. left = w - 1, right = 0.
        window_size=(window - 1, 0) if window > 0 else (-1, -1),
        # flash_api.cpp set_params_fprop: softcap > 0 computes softcap * tanh(s * scale / softcap),
        # the same map as ours (softcap * tanh(scale * qk / softcap)); 0.0 disables it.
        softcap=float(softcap),
        alibi_slopes=None,
        deterministic=False,
        # With dropout_p == 0 this returns (out, softmax_lse, empty) and computes no probabilities
        # (FlashAttnVarlenFunc.forward: return_softmax=return_softmax and dropout_p > 0).
        return_attn_probs=return_lse,
        block_table=plan.block_table,
    )


def lse_to_paged(fa_lse: torch.Tensor, plan: FlashAttn2Plan) -> torch.Tensor:
    """flash-attn's varlen ``softmax_lse`` in paged's convention: float32 ``[num_tokens, num_heads]``.

    flash-attn >= 2.6 returns ``[num_heads, total_q]`` (flash_api.cpp mha_varlen_fwd:
    ``torch::empty({num_heads, total_q})`` with unpadded_lse; the decode "ngroups swapped" path
    reshapes to the same layout, flash_fwd_kernel.h get_lse_tile), natural log
    (softmax.h: ``row_max * softmax_scale + __logf(sum)``). Older builds returned the padded
    ``[batch, num_heads, max_seqlen_q]``; both are accepted. flash-attn writes ``+inf`` for rows
    that see no key (flash_fwd_kernel.h: ``gLSE(row) = INFINITY``); ours is ``-inf``.
    """
    if fa_lse.dim() == 2:
        ours = fa_lse.t()
    else:
        ours = fa_lse[plan.token_req, :, plan.token_pos]
    empty = torch.isposinf(ours) | plan.pad_rows[:, None]
    return torch.where(empty, torch.full((), -math.inf, dtype=ours.dtype, device=ours.device), ours).float()


# ------------------------------------------------------------------------------ backend
class FlashAttn2Backend(Backend):
    """FlashAttention 2's varlen kernel over the paged cache, one call per layer for any batch.

    Needs flash-attn ``>=2.6,<3`` and an sm_80+ GPU, a cache of ``block_size % 256 == 0``
    (see :mod:`paged_flash_attn2.bridge` for engines with 16-token blocks), fp16/bf16.
    ``plan(meta)`` once per step precomputes the cumulative key lengths and the padding-row mask;
    ``forward`` then makes one flash-attn call plus one masked copy into ``out``, without a host sync.
    """

    name = "flash-attn2"
    capabilities = FlashAttn2Capabilities(
        head_dims=HEAD_DIMS,
        block_sizes=None,  # any multiple of 256: block_size_multiple below
        # No MLA-shaped heads: flash-attn 2 has one head dim for Q, K and V (flash_api.cpp
        # mha_fwd_kvcache: CHECK_SHAPE(vcache, ..., head_size_og) with q's head size).
        head_dim_pairs=frozenset(),
        block_size_multiple=BLOCK_SIZE_MULTIPLE,
        # GQA/MQA: any ratio (flash_api.cpp: TORCH_CHECK(num_heads % num_heads_k == 0); head h
        # reads KV head h // (num_heads / num_heads_k), as our reference's repeat_interleave).
        group_sizes=None,
        # flash_api.cpp: "FlashAttention only support fp16 and bf16 data type"; K/V must match q.
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        # FA2 has no int8/fp8 KV path (the cache must have q's dtype, flash_api.cpp).
        kv_dtypes=frozenset({"auto"}),
        devices=frozenset({"cuda"}),
        sliding_window=True,
        softcap=True,
        # FA2 has no attention-sink logits (no such parameter in flash_attn_varlen_func).
        sinks=False,
        mixed_batches=True,
        returns_lse=True,
        # Probably graph-safe (no host sync here; flash-attn sizes everything from host ints), but
        # not verified on a GPU yet: not claimed.
        cuda_graphs=False,
        # plan() is PyTorch on the batch's device, no host read (tested on meta tensors).
        device_plan=True,
        # The decode path picks its split count from the batch size (flash_api.cpp
        # num_splits_heuristic), so a request's rounding can change with its neighbours.
        batch_invariant=False,
    )

    @classmethod
    def unavailable(cls) -> list[str]:
        return list(_probe())

    def extra_reasons(self, spec: AttentionSpec) -> list[str]:
        # A pruned build has only some head-dim kernels: refused here, not inside flash-attn.
        return _build_reasons(spec.head_dim, spec.dtype)

    def _plan(self, meta: BatchMeta, **layer: Any) -> FlashAttn2Plan:
        """flash-attn's description of ``meta``: pure PyTorch on its device, no host sync. The
        layer keywords of :meth:`paged_core.Backend.plan` are checked there and unused here."""
        args = to_flash_attn_args(meta)
        dev = meta.device
        # No request may reach flash-attn without keys. flash-attn 2.8.3's paged varlen kernel
        # (flash_fwd_kernel.h, compute_attn_1rowblock_splitkv, early exit when n_block_max <=
        # n_block_min, unsplit path) writes such a request's lse at the *padded* offset
        # ((bidb * h + bidh) * max_seqlen_q + row) of the unpadded [h, total_q] buffer: past its
        # end for later requests, over other tensors (the bug of vllm-project/flash-attention
        # pull request 139). On the H200 (2026-12-01) that zeroed rows
        # of real requests in batches holding padding requests, differently from run to run. A
        # padding request therefore sees one key of block 0 (valid in every cache); its rows
        # are forced to zeros and its lse to -inf in forward as before.
        padding = meta.seq_lens == 0
        seq_k = meta.seq_lens.clamp(min=1)
        cu_seqlens_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=dev)
        cu_seqlens_k[1:] = torch.cumsum(seq_k, 0)
        block_table = args.block_table.clone(memory_format=torch.contiguous_format)
        if block_table.shape[1]:
            block_table[:, 0].masked_fill_(padding, 0)
        else:  # every request is padding: one column for block 0
            block_table = torch.zeros(meta.num_reqs, 1, dtype=torch.int32, device=dev)
        n = meta.num_tokens
        rows = torch.arange(n, dtype=torch.int32, device=dev)
        if meta.num_reqs:
            ends = meta.query_start_loc[1:].contiguous()
            token_req = torch.searchsorted(ends, rows, right=True).clamp_(max=meta.num_reqs - 1)
            token_pos = (rows - meta.query_start_loc.index_select(0, token_req)).long()
            pad_rows = meta.seq_lens.index_select(0, token_req) == 0
        else:
            token_req = token_pos = torch.zeros(0, dtype=torch.int64, device=dev)
            pad_rows = torch.zeros(0, dtype=torch.bool, device=dev)
        max_q = meta.max_query_len
        if max_q <= 1 and n != meta.num_reqs:
            # flash_api.cpp mha_varlen_fwd: with max_seqlen_q == 1 (and GQA, no window) it reshapes
            # q to [batch_size, ...], assuming one row per request; a batch where some requests have
            # no new token (padding) would fail there. max_seqlen_q is only an upper bound (grid
            # size), so 2 takes the general path, which handles any query lengths.
            max_q = 2
        return FlashAttn2Plan(
            meta=meta,
            cu_seqlens_q=args.cu_seqlens_q.contiguous(),
            cu_seqlens_k=cu_seqlens_k,
            block_table=block_table,
            max_seqlen_q=max_q,
            max_seqlen_k=max(args.max_seqlen_k, 1),
            token_req=token_req.long(),
            token_pos=token_pos,
            pad_rows=pad_rows,
        )

    def _forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        plan: Any,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> None:
        # A BatchMeta, or another backend's plan of one: plan it here (cheap, no host sync).
        p = plan if isinstance(plan, FlashAttn2Plan) else self.plan(self._batch_of(plan))
        if q.shape[0] == 0:
            return
        res = _varlen_func()(
            **varlen_kwargs(q, cache, p, scale=scale, window=window, softcap=softcap, return_lse=lse is not None)
        )
        res_out = res[0] if lse is not None else res
        # Padding requests (seq_len 0) must give exact zeros. flash-attn already writes zeros for
        # rows without keys (flash_fwd_kernel.h early exit); the mask makes it a guarantee (NaN
        # included) at the price of the copy into `out` that the public API needs anyway.
        torch.where(p.pad_rows[:, None, None], torch.zeros((), dtype=out.dtype, device=out.device), res_out, out=out)
        if lse is not None:
            lse.copy_(lse_to_paged(res[1], p))
