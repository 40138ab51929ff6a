"""The ``flashinfer`` backend: FlashInfer's paged wrappers over paged-core's NHD cache, as it is.

FlashInfer splits attention into ``plan`` (host-side scheduling, once per step) and ``run`` (per
layer). This adapter keeps that split:

    plan = backend.plan(meta, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    for layer in layers:                               # no host work, no sync
        out = backend.forward(q, caches[layer], plan)

``forward`` also accepts a ``BatchMeta``; it then plans implicitly on first use and caches the
plan for that meta object (which is what the conformance suite does). Engines should call
``plan`` once per step themselves: the implicit path costs a FlashInfer plan on the first layer.
A plan is prepared for one set of attention parameters (heads, head_dim, dtype, window,
soft-cap, scale) when first used with it, so layers with different windows share one plan.

Which FlashInfer kernel runs, per batch class (measured on an NVIDIA H200, 2026-11-29, docs/benchmarks.md):

================  =====================================================================
decode only       ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")``
                  (its FA3 backend was 3-12x slower for one-token queries)
mixed             ``BatchAttention`` (one persistent launch for prefill and decode rows);
                  it has no sliding window, so windowed layers use the prefill wrapper
prefill only      ``BatchPrefillWithPagedKVCacheWrapper(backend="auto")`` (FA3 on Hopper)
shared prefix     with ``cascade=True``: FlashInfer's two-level cascade (the levels of
                  ``MultiLevelCascadeAttentionWrapper``: the prefix once for every query,
                  non-causal, then each request's own keys, causal, merged with
                  ``merge_state_in_place``)
================  =====================================================================

fp8 caches (``kv_dtype="fp8"`` or ``"fp8_e5m2"``, scales per slot or static) run FlashInfer's
FA2 kernels with ``use_token_head_sf=True``: the codes are read as they are and the float32
scales through ``kv_cache_sf``, one per (slot, KV head) as paged-core stores them (a static
scale is the same view with strides 0). Mixed batches then take the prefill wrapper
(``BatchAttention`` has no such scales).

Everything FlashInfer's planners need on the host comes from ``BatchMeta``'s host mirrors
(``query_start_loc_cpu``, ``seq_lens_cpu``); the device-side metadata comes from
:func:`paged_core.to_flashinfer_pages`. No device-to-host copy happens when the mirrors exist
(``BatchAttention.plan`` itself calls ``torch.cuda.synchronize()``; see its note below).

Padding requests (``seq_len == 0``) are given one dummy page (block 0) so that every FlashInfer
kernel sees a well-formed request, and their rows are overwritten with exact zeros (LSE
``-inf``) after the run by a device-side mask, so no host sync is needed.

Evidence for each capability lives next to ``FlashInferBackend.capabilities``; every file named
there is from the ``flashinfer-python`` 0.7.4 wheel (``flashinfer/_build_meta.py``: 0.7.4,
git 77039051b0be).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from paged_core import (
    AttentionSpec,
    Backend,
    BatchMeta,
    Capabilities,
    FlashInferPages,
    InputError,
    KVCache,
    shared_prefix_blocks,
    to_flashinfer_pages,
)
from paged_core.hookspecs import pip_install

__all__ = ["FlashInferBackend", "FlashInferPlan"]

INSTALL = pip_install("'paged-core[flashinfer]'")
#: FlashInfer's kernels write the log-sum-exp in base 2 (``math::ptx_log2(d) + m`` in
#: include/flashinfer/attention/persistent.cuh and prefill.cuh; prefill.py's ``_finish_lse``
#: docstring: "Kernels write base-2 LSE as [tokens, heads]"). Ours is natural log.
LN2 = math.log(2.0)
#: FlashInfer's recommended float workspace (decode.py / prefill.py docstrings: "128MB").
WORKSPACE_BYTES = 128 * 1024 * 1024
_DECODE_BACKENDS = ("fa2", "fa3", "auto")
_PREFILL_BACKENDS = ("auto", "fa2", "fa3")
_MIXED = ("batch_attention", "prefill")
#: paged-core's fp8 formats and the code dtypes FlashInfer reads them as.
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP8_CODES = frozenset(_FP8.values())
_tokens = itertools.count(1)


def _flashinfer() -> Any:
    """Import FlashInfer on first use; a failure names the package and the fix."""
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install raising anything on import
        raise InputError(
            f"the flashinfer backend could not import flashinfer ({type(exc).__name__}: {exc}); to fix: {INSTALL}"
        ) from exc
    return flashinfer


@dataclasses.dataclass(frozen=True)
class _Params:
    """The attention parameters FlashInfer bakes into a plan (its ``plan`` takes them all)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int
    softcap: float
    scale: float
    #: V's and the output's head dim (``head_dim`` except in MLA-shaped layers).
    head_dim_vo: int = 0
    #: The cache's element dtype: ``dtype``, or the fp8 codes' (scales through ``kv_cache_sf``).
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not self.head_dim_vo:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @property
    def fp8(self) -> bool:
        """fp8 codes with one float32 scale per (slot, KV head): FlashInfer's ``use_token_head_sf``."""
        return self.kv_dtype in _FP8_CODES

    @property
    def window_left(self) -> int:
        # Our window w: the query at position p sees keys > p - w (w keys, itself included).
        # FlashInfer keeps kv_idx with kv_idx + window_left >= p (variants.cuh LogitsMask:
        # "kv_idx + qo_len + window_left >= kv_len + qo_idx"; prefill.cuh: "kv_idx + window_left
        # < idx_in_original_seq" is out of bounds), i.e. window_left + 1 keys; -1 disables it.
        return self.window - 1 if self.window > 0 else -1


@dataclasses.dataclass(eq=False)
class FlashInferPlan:
    """One step's batch in FlashInfer's terms; returned by :meth:`FlashInferBackend.plan`.

    Valid for every layer of the step. FlashInfer's wrappers hold one plan at a time, so using
    an older plan after a newer one re-plans on the host (never inside a CUDA graph capture).
    """

    #: The batch this plan describes.
    meta: BatchMeta
    #: "decode" (one query per request), "mixed" (decode and longer requests) or "prefill".
    batch_class: str
    #: FlashInfer's page description, with one dummy page (block 0) per padding request.
    pages: FlashInferPages
    #: int32 [num_reqs + 1] on the CPU: query offsets for the planners.
    qo_indptr_cpu: torch.Tensor
    #: int32 [num_reqs] on the CPU: key lengths as planned (padding requests get their dummy length).
    kv_lens_cpu: torch.Tensor
    #: bool [num_tokens] on the device: rows of padding requests, or None when there are none.
    pad_rows: torch.Tensor | None
    #: With a shared prefix (``cascade=True`` or a declared ``shared_prefix_blocks``): its two
    #: levels; None otherwise.
    cascade: _Cascade | None = None
    #: Distinguishes plans for the wrappers' "which plan is loaded" bookkeeping.
    token: int = dataclasses.field(default_factory=lambda: next(_tokens))


@dataclasses.dataclass(eq=False)
class _Cascade:
    """The two levels of a batch whose requests share their first ``prefix_blocks`` blocks."""

    prefix_blocks: int
    #: Level 0: every query token of the batch as one request over the prefix pages.
    prefix_qo_indptr_cpu: torch.Tensor  # [0, num_tokens]
    prefix_indptr_cpu: torch.Tensor  # [0, prefix_blocks]
    prefix_indices: torch.Tensor  # int32 [prefix_blocks] on the device: block_table[0, :prefix_blocks]
    prefix_last_page_len_cpu: torch.Tensor  # [block_size]
    #: Level 1: each request's keys after the prefix (its own plan: pages, padding rows).
    suffix: FlashInferPlan


@dataclasses.dataclass(eq=False)
class _Slot:
    """One FlashInfer wrapper and what is loaded into it."""

    path: str  # "decode", "prefill" or "batch_attention"
    wrapper: Any
    graph: bool = False
    capacity: int = 0  # graph mode: size of the fixed page-index buffer
    loaded: int | None = None  # token of the plan currently planned into the wrapper
    pad_rows: torch.Tensor | None = None  # graph mode: fixed-address padding mask [num_reqs]


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _host_mirrors(meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc, seq_lens) on the CPU: the mirrors, or one copy (a sync) without them."""
    qsl = meta.query_start_loc_cpu
    sl = meta.seq_lens_cpu
    if qsl is None:
        qsl = meta.query_start_loc.cpu()
    if sl is None:
        sl = meta.seq_lens.cpu()
    return qsl.to(torch.int32), sl.to(torch.int32)


def prepare_plan(meta: BatchMeta, prefix_blocks: int = 0) -> FlashInferPlan:
    """Classify the batch and build FlashInfer's page description; pure PyTorch, no FlashInfer.

    Without host mirrors this copies ``query_start_loc`` and ``seq_lens`` to the host (a sync),
    because FlashInfer's planners run on the host. With ``prefix_blocks`` (blocks every request
    holds at the same physical ids, see ``paged_core.shared_prefix_blocks``), the plan also gets
    the two cascade levels, unless a request's queries reach into the prefix (the prefix level
    is not causal): then the batch runs without the cascade.
    """
    qsl_cpu, sl_cpu = _host_mirrors(meta)
    plan = _plain_plan(meta, qsl_cpu, sl_cpu)
    if prefix_blocks > 0:
        plan.cascade = _cascade_levels(meta, qsl_cpu, sl_cpu, prefix_blocks)
    return plan


def _cascade_levels(
    meta: BatchMeta, qsl_cpu: torch.Tensor, sl_cpu: torch.Tensor, prefix_blocks: int
) -> _Cascade | None:
    bs = meta.block_size
    prefix = prefix_blocks * bs
    q_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
    active = sl_cpu > 0
    if prefix_blocks > meta.block_table.shape[1] or bool((sl_cpu[active] - q_cpu[active] < prefix).any()):
        return None
    suffix_sl_cpu = torch.where(active, sl_cpu - prefix, 0).to(torch.int32)
    suffix = dataclasses.replace(
        meta,
        seq_lens=torch.where(meta.seq_lens > 0, meta.seq_lens - prefix, 0).to(torch.int32),
        block_table=meta.block_table[:, prefix_blocks:],
        max_seq_len=max(int(suffix_sl_cpu.max()) if suffix_sl_cpu.numel() else 0, 0),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=suffix_sl_cpu,
    )
    return _Cascade(
        prefix_blocks=prefix_blocks,
        prefix_qo_indptr_cpu=torch.tensor([0, meta.num_tokens], dtype=torch.int32),
        prefix_indptr_cpu=torch.tensor([0, prefix_blocks], dtype=torch.int32),
        # Through the first request with keys (a padding row's table may hold anything).
        prefix_indices=meta.block_table[int(active.int().argmax()), :prefix_blocks].to(torch.int32).contiguous(),
        prefix_last_page_len_cpu=torch.tensor([bs], dtype=torch.int32),
        suffix=_plain_plan(suffix, qsl_cpu, suffix_sl_cpu),
    )


def _plain_plan(meta: BatchMeta, qsl_cpu: torch.Tensor, sl_cpu: torch.Tensor) -> FlashInferPlan:
    q_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
    pad_cpu = sl_cpu == 0
    has_padding = bool(pad_cpu.any())
    n, r = meta.num_tokens, meta.num_reqs
    if meta.max_query_len <= 1 and n == r:
        batch_class = "decode"
    elif bool((q_cpu == 1).any()) and bool((q_cpu > 1).any()):
        batch_class = "mixed"
    else:
        batch_class = "prefill"

    # A padding request becomes a request over max(query_len, 1) keys of block 0: every
    # FlashInfer planner and kernel sees kv_len >= qo_len >= 0 (BatchAttention's causal bound
    # "kv_len - q_len + ..." in persistent.cuh must not go negative), and block 0 exists in
    # every pool. Its rows are zeroed after the run.
    bs = meta.block_size
    pad = meta.seq_lens == 0
    eff = torch.where(pad, meta.query_lens.clamp(min=1), meta.seq_lens).to(torch.int32)
    eff_cpu = torch.where(pad_cpu, q_cpu.clamp(min=1), sl_cpu).to(torch.int32)
    table = meta.block_table.masked_fill(pad[:, None], 0)
    need = max(1, math.ceil(max(meta.max_query_len, 1) / bs))
    if table.shape[1] < need:
        table = F.pad(table, (0, need - table.shape[1]))
    padded = dataclasses.replace(
        meta,
        seq_lens=eff,
        block_table=table,
        max_seq_len=max(meta.max_seq_len, meta.max_query_len, 1),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=eff_cpu,
    )
    pages = to_flashinfer_pages(padded)

    pad_rows = None
    if has_padding:
        if batch_class == "decode":
            pad_rows = pad  # one row per request
        else:
            rows = torch.arange(n, dtype=torch.int32, device=meta.device)
            req = torch.searchsorted(meta.query_start_loc[1:].contiguous(), rows, right=True)
            pad_rows = pad[req.clamp(max=max(r - 1, 0))]
    return FlashInferPlan(
        meta=meta,
        batch_class=batch_class,
        pages=pages,
        qo_indptr_cpu=qsl_cpu,
        kv_lens_cpu=eff_cpu,
        pad_rows=pad_rows,
    )


class FlashInferBackend(Backend):
    """FlashInfer's paged attention (``kv_layout="NHD"``) over paged-core's cache tensors, no copy.

    Options (keyword-only):

    - ``decode_backend``: FlashInfer backend of the tensor-core decode wrapper, ``"fa2"``
      (default; fastest on the H200), ``"fa3"`` or ``"auto"``.
    - ``prefill_backend``: backend of the prefill wrapper, ``"auto"`` (default: FA3 on Hopper
      for head_dim 64/128/256, else FA2), ``"fa2"`` or ``"fa3"``.
    - ``mixed``: ``"batch_attention"`` (default; FlashInfer's persistent mixed kernel) or
      ``"prefill"`` (the prefill wrapper) for batches mixing decode and longer requests.
    - ``cuda_graph``: plan decode batches into CUDA-graph-mode wrappers, one per batch size,
      whose metadata buffers keep their addresses across plans. Needed to capture ``forward``
      once and replay it on later steps after ``plan`` (FlashInfer's ``use_cuda_graph=True``).
      Without it, a captured ``forward`` may only be replayed for the plan it was captured with.
    - ``cascade``: find a prefix shared by every request (the same physical blocks) in
      :meth:`plan` (it reads the block table on the host) and run FlashInfer's two-level cascade:
      the prefix read once for all queries, then each request's own keys, merged.
      ``plan(meta, shared_prefix_blocks=k)`` declares the prefix instead, with or without this
      option. Batches whose queries reach into the prefix, and windowed layers, run as usual.
      Cascade plans are not ``cuda_graph`` plans: a captured cascade forward replays only the
      plan it was captured with.
    - ``min_prefix_tokens``: a shorter shared prefix runs as a normal batch (default 256).

    No GPU memory is allocated until the first plan; workspaces are then reused. ``reset()``
    frees them (graphs captured against them must not be replayed afterwards).
    """

    name = "flashinfer"
    capabilities = Capabilities(
        # FA3 (the default prefill kernel on Hopper) instantiates only these:
        # include/flashinfer/attention/hopper/prefill_sm90.cuh static_assert(HEAD_DIM_VO == 64 ||
        # HEAD_DIM_VO == 128 || HEAD_DIM_VO == 256); utils.py determine_attention_backend falls
        # back to FA2 for others, but FA2 at other head dims is not claimed until proven here.
        head_dims=frozenset({64, 128, 256}),
        # DeepSeek-V3's MLA prefill shape: the prefill wrapper's plan takes head_dim_qk and
        # head_dim_vo (prefill.py), and its FA3 module instantiates HEAD_DIM_QK 192 with
        # HEAD_DIM_VO 128 (prefill_sm90.cuh). The decode wrapper's plan has one head_dim, so such
        # layers run every batch through the prefill wrapper (see _path).
        head_dim_pairs=frozenset({(192, 128)}),
        # page_size is a runtime argument of every path (decode.py/prefill.py plan(page_size),
        # paged_kv_t uses a fastdiv); the page-size restriction was removed in v0.0.5
        # (flashinfer-ai/flashinfer#320). Conformance proves 16/32/64/256.
        block_sizes=None,
        # GQA packs the group into query rows (uint_fastdiv gqa_group_size in prefill.cuh and
        # persistent.cuh): any num_heads that is a multiple of num_kv_heads.
        group_sizes=None,
        # FA2/FA3 kernels take half-precision Q/K/V only (prefill.py/decode.py: q_data_type
        # "float16" default; fp8 paths need fp8 Q or special scales). No float32.
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        # fp8 e4m3/e5m2 codes with float32 scales of shape [num_pages, page_size, num_kv_heads]
        # (NHD): plan(use_token_head_sf=True) and run(kv_cache_sf=(k_sf, v_sf)) of the decode
        # and prefill wrappers (decode.py/prefill.py: "The tensors may be non-contiguous
        # views"), FA2 only. The kernel indexes them with their own page/slot/head strides
        # (prefill.cuh page_produce_kv_token_head_sf), so static scales (strides 0) read as
        # well. int8 and 4-bit KV have no FlashInfer kernel.
        kv_dtypes=frozenset({"auto", *_FP8}),
        kv_scales=frozenset({"per_slot", "per_head", "per_tensor"}),
        devices=frozenset({"cuda"}),
        # window_left in decode.py/prefill.py plan(); BatchAttention.plan has none, so
        # windowed mixed batches go to the prefill wrapper (see _path).
        sliding_window=True,
        # logits_soft_cap in every plan(); variants.cuh: cap * tanh(s * sm_scale / cap).
        softcap=True,
        # Not claimed: prefill.py get_batch_prefill_module.paged_run passes `sinks` only to the
        # trtllm-gen kernel; the fa2 and fa3 branches drop it silently. BatchAttention.run
        # takes no sinks. (BatchAttentionWithAttentionSinkWrapper is a separate JIT variant.)
        sinks=False,
        mixed_batches=True,
        # Every kernel writes [tokens, heads] float32 LSE in base 2; converted to natural log.
        returns_lse=True,
        # run() does no host work (decode.py/prefill.py: "plan ... cannot be used in Cuda
        # Graph"; run reads only buffers). Replays across re-plans need cuda_graph=True.
        cuda_graphs=True,
        # plan() schedules on the host from the batch's lengths: outside any capture.
        device_plan=False,
        # Split-KV scheduling depends on the whole batch (scheduler.cuh).
        batch_invariant=False,
    )

    def __init__(
        self,
        *,
        decode_backend: str = "fa2",
        prefill_backend: str = "auto",
        mixed: str = "batch_attention",
        cuda_graph: bool = False,
        cascade: bool = False,
        min_prefix_tokens: int = 256,
        validate: bool | None = None,
    ) -> None:
        super().__init__(validate=validate)
        if not isinstance(min_prefix_tokens, int) or isinstance(min_prefix_tokens, bool) or min_prefix_tokens < 0:
            raise InputError(f"min_prefix_tokens is {min_prefix_tokens!r}; accepted: an int >= 0")
        self.cascade = bool(cascade)
        self.min_prefix_tokens = min_prefix_tokens
        for opt, val, accepted in (
            ("decode_backend", decode_backend, _DECODE_BACKENDS),
            ("prefill_backend", prefill_backend, _PREFILL_BACKENDS),
            ("mixed", mixed, _MIXED),
        ):
            if val not in accepted:
                raise InputError(f"{opt} is {val!r}; accepted: {', '.join(map(repr, accepted))}")
        self.decode_backend = decode_backend
        self.prefill_backend = prefill_backend
        self.mixed = mixed
        self.cuda_graph = bool(cuda_graph)
        # Everything below is allocated lazily, on the first plan that needs it.
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._slots: dict[tuple, _Slot] = {}
        # Wrappers replaced by larger ones stay alive: a captured graph may still point at
        # their buffers, and freeing them would let a replay read reused memory.
        self._retired: list[_Slot] = []
        self._implicit: dict[int, tuple[weakref.ref, FlashInferPlan]] = {}

    # ----------------------------------------------------------------------------- capability
    @classmethod
    def unavailable(cls) -> list[str]:
        reasons = []
        # find_spec, not import: importing FlashInfer is slow and must never break `paged list`.
        if importlib.util.find_spec("flashinfer") is None:
            reasons.append(f"flashinfer is not installed ({INSTALL})")
        if not torch.cuda.is_available():
            reasons.append(
                "needs a CUDA GPU; torch.cuda.is_available() is False (run on a machine with an "
                "NVIDIA GPU and a CUDA build of torch: pip install torch)"
            )
        return reasons

    def extra_reasons(self, spec: AttentionSpec) -> list[str]:
        out = []
        if spec.head_dim_v != spec.head_dim and self.prefill_backend == "fa3":
            out.append(
                f"head_dim_v {spec.head_dim_v} other than head_dim {spec.head_dim} needs prefill_backend "
                "'auto' or 'fa2': FA3's paged prefill reads K and V with one page stride, and K and V "
                "pages of two head dims have two"
            )
        if spec.kv_dtype in _FP8 and spec.head_dim_v != spec.head_dim:
            # Conformance case mla-kv_fp8-decode_only (192/128, fp8 e4m3 per slot): outputs off by
            # up to 1.6 (NVIDIA H100, FlashInfer 0.7.4, 2026-12-07); equal head dims pass.
            out.append(
                f"kv_dtype {spec.kv_dtype!r} with head_dim_v {spec.head_dim_v} other than head_dim "
                f"{spec.head_dim}: FlashInfer's fp8 prefill with per-slot scales computes it wrongly; "
                "accepted: fp8 caches with head_dim_v == head_dim, or kv_dtype 'auto'"
            )
        if spec.kv_dtype in _FP8:
            fa3 = [
                f"{opt}='fa3'"
                for opt, val in (("decode_backend", self.decode_backend), ("prefill_backend", self.prefill_backend))
                if val == "fa3"
            ]
            if fa3:
                out.append(
                    f"kv_dtype {spec.kv_dtype!r} runs FlashInfer's FA2 kernels only (per-slot fp8 scales: "
                    f"use_token_head_sf), not {' and '.join(fa3)}; accepted: 'fa2' or 'auto'"
                )
        return out

    # ----------------------------------------------------------------------------- plan
    def _plan(
        self,
        meta: BatchMeta,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        window: int = 0,
        softcap: float = 0.0,
        scale: float | None = None,
        shared_prefix_blocks: int | None = None,
        head_dim_v: int | None = None,
        kv_dtype: str = "auto",
    ) -> FlashInferPlan:
        """Plan one step's batch; pass the result to every layer's ``forward``.

        With ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``dtype`` (and the ``window``,
        ``softcap`` and ``scale`` the layers will pass), FlashInfer plans now, on the host, and
        the first ``forward`` does no planning. Without them, FlashInfer plans on the first
        ``forward`` (outside a CUDA graph capture). ``scale`` defaults to ``head_dim ** -0.5``,
        as in ``forward``. ``plan(meta, ...)`` has checked the keywords and, with the layer's
        shape given, refused a spec outside the capabilities before this runs.
        ``shared_prefix_blocks`` declares the blocks every request shares (cascade), so no
        block table is read on the host.
        """
        if not isinstance(meta, BatchMeta):
            raise InputError(f"meta is a {type(meta).__name__}; accepted: a paged_core.BatchMeta")
        plan = prepare_plan(meta, self._prefix_of(meta, shared_prefix_blocks))
        given = [num_heads, num_kv_heads, head_dim, dtype]
        if any(v is not None for v in given):
            if num_heads is None or num_kv_heads is None or head_dim is None or dtype is None:
                raise InputError(
                    "plan() got some of num_heads, num_kv_heads, head_dim, dtype but not all; "
                    "accepted: all four (plan now) or none (plan on the first forward)"
                )
            if meta.device.type != "cuda":
                raise InputError(
                    f"the batch is on {meta.device}; the flashinfer backend plans CUDA batches only "
                    "(move it with meta.to('cuda'))"
                )
            if scale is None:
                scale = head_dim**-0.5
            params = _Params(
                int(num_heads),
                int(num_kv_heads),
                int(head_dim),
                dtype,
                int(window),
                float(softcap),
                float(scale),
                int(head_dim_v or head_dim),
                _FP8.get(kv_dtype, dtype),
            )
            if meta.num_tokens:  # an empty batch runs nothing (forward returns at once)
                self._load(plan, params, meta.device)
        return plan

    def _plan_for(self, meta: Any) -> FlashInferPlan:
        if isinstance(meta, FlashInferPlan):
            return meta
        meta = self._batch_of(meta)  # a BatchMeta, or another backend's plan of one
        # A BatchMeta: plan implicitly, once per meta object. Keyed by id() with a weak
        # reference, so a new meta that reuses a dead one's id is not mistaken for it.
        key = id(meta)
        hit = self._implicit.get(key)
        if hit is not None and hit[0]() is meta:
            return hit[1]
        if _capturing():
            raise InputError(
                "forward() got a BatchMeta during CUDA graph capture, but FlashInfer plans on the "
                "host; call plan = backend.plan(meta, ...) before capturing and pass the plan"
            )
        plan = prepare_plan(meta, self._prefix_of(meta, None))
        self._implicit = {k: v for k, v in self._implicit.items() if v[0]() is not None}
        while len(self._implicit) >= 16:  # a few steps' worth; plans hold device tensors
            self._implicit.pop(next(iter(self._implicit)))
        self._implicit[key] = (weakref.ref(meta), plan)
        return plan

    def _prefix_of(self, meta: BatchMeta, declared: int | None) -> int:
        """The shared prefix the plan uses, in blocks: declared, found (``cascade=True``, a read
        of the block table) or none; 0 when shorter than ``min_prefix_tokens``."""
        if declared is not None:
            if (
                not isinstance(declared, int)
                or isinstance(declared, bool)
                or not (0 <= declared <= meta.block_table.shape[1])
            ):
                raise InputError(
                    f"shared_prefix_blocks is {declared!r}; accepted: an int from 0 to the "
                    f"block table's width ({meta.block_table.shape[1]})"
                )
            prefix = declared
        elif self.cascade and meta.num_reqs > 1:
            prefix = shared_prefix_blocks(meta.block_table, meta.seq_lens, meta.block_size)
        else:
            prefix = 0
        return prefix if prefix * meta.block_size >= max(self.min_prefix_tokens, 1) else 0

    def reset(self) -> None:
        """Free every workspace and wrapper (the next plan allocates them again)."""
        self._workspaces.clear()
        self._slots.clear()
        self._retired.clear()
        self._implicit.clear()

    # ----------------------------------------------------------------------------- wrappers
    def _path(self, plan: FlashInferPlan, params: _Params) -> str:
        if plan.cascade is not None and params.window == 0:
            return "cascade"
        if params.head_dim_vo != params.head_dim:
            # Only the prefill wrapper's plan takes V's own head dim (head_dim_vo).
            return "prefill"
        if plan.batch_class == "decode":
            return "decode"
        if params.fp8:
            return "prefill"  # BatchAttention reads no per-slot scales
        # BatchAttention has no sliding window; and with one query head per KV head (MHA) it
        # failed the conformance case mixed_prefill_and_decode-g1 on the H200 (FlashInfer 0.7.4,
        # 2026-11-29; g4 and g3 passed), so MHA mixed batches take the prefill wrapper.
        if (
            plan.batch_class == "mixed"
            and self.mixed == "batch_attention"
            and params.window == 0
            and params.num_heads != params.num_kv_heads
        ):
            return "batch_attention"
        return "prefill"

    def _workspace(self, device: torch.device) -> torch.Tensor:
        ws = self._workspaces.get(device)
        if ws is None:
            # decode.py: "Must be initialized to 0 for its first use". Shared by every decode and
            # prefill wrapper of this backend: they run one after another on one stream, as in
            # vLLM's FlashInfer backend.
            ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._workspaces[device] = ws
        return ws

    def _prefill_kernel(self, p: _Params) -> str:
        """The prefill wrapper's ``backend`` for layers of these parameters."""
        if p.fp8:
            return "fa2"  # use_token_head_sf is FA2's (prefill.py plan)
        if p.head_dim_vo != p.head_dim and self.prefill_backend == "auto":
            # FA3's paged prefill needs one page stride and one token stride for K and V
            # (batch_prefill_sm90.cu: "K and V must have same page stride for sparse attention");
            # K pages of 192 and V pages of 128 have two. FA2's paged_kv_t has V's own strides.
            return "fa2"
        return self.prefill_backend

    def _new_slot(self, path: str, graph: bool, plan: FlashInferPlan, p: _Params, device: torch.device) -> _Slot:
        fi = _flashinfer()
        if path == "decode":
            if graph:
                r = plan.meta.num_reqs
                cap = max(int(plan.pages.indices.numel()), 1)
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace(device),
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=torch.zeros(r + 1, dtype=torch.int32, device=device),
                    paged_kv_indices_buffer=torch.zeros(cap, dtype=torch.int32, device=device),
                    paged_kv_last_page_len_buffer=torch.zeros(r, dtype=torch.int32, device=device),
                    backend=self.decode_backend,
                )
                return _Slot(
                    path, wrapper, graph=True, capacity=cap, pad_rows=torch.zeros(r, dtype=torch.bool, device=device)
                )
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace(device),
                "NHD",
                use_tensor_cores=True,
                backend=self.decode_backend,
            )
            return _Slot(path, wrapper)
        if path == "prefill":
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace(device),
                "NHD",
                backend=self._prefill_kernel(p),
            )
            return _Slot(path, wrapper)
        if path == "cascade":
            # As MultiLevelCascadeAttentionWrapper(2, workspace, "NHD") builds its levels (one
            # prefill wrapper each, one float workspace); its run() returns no LSE and takes no
            # out=, so the levels are run here, the same way (cascade.py run).
            wrappers = tuple(
                fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace(device), "NHD", backend=self._prefill_kernel(p))
                for _ in range(2)
            )
            return _Slot(path, wrappers)
        # BatchAttention owns its workspaces (attention/_core.py __init__: 384 MB float, 8 MB int).
        dev = f"cuda:{device.index}" if device.index is not None else "cuda"
        return _Slot(path, fi.BatchAttention(kv_layout="NHD", device=dev))

    def _load(self, plan: FlashInferPlan, params: _Params, device: torch.device) -> _Slot:
        """The wrapper for (batch path, params), with ``plan`` planned into it."""
        path = self._path(plan, params)
        graph = path == "decode" and self.cuda_graph
        key = (path, params, device, plan.meta.num_reqs if graph else None)
        slot = self._slots.get(key)
        if slot is not None and graph and plan.pages.indices.numel() > slot.capacity:
            # FlashInfer's graph-mode buffers are sized once (decode.py: "should be large enough
            # to store the maximum number of page indices"); a wider block table needs a new one.
            self._retired.append(slot)
            slot = None
        if slot is None:
            slot = self._new_slot(path, graph, plan, params, device)
            self._slots[key] = slot
        if slot.loaded != plan.token:
            if _capturing():
                raise InputError(
                    "this plan is not the one loaded in FlashInfer's wrapper, and FlashInfer cannot "
                    "plan during CUDA graph capture; call backend.plan(meta, num_heads=..., ...) "
                    "with the layer's parameters right before capturing"
                )
            self._plan_into(slot, plan, params)
            slot.loaded = plan.token
        return slot

    def _plan_into(self, slot: _Slot, plan: FlashInferPlan, p: _Params) -> None:
        """Run FlashInfer's host-side plan; every host-side array comes from the CPU mirrors."""
        pages, bs = plan.pages, plan.meta.block_size
        self._prewarm(p, plan.meta.device)
        if pages.indptr_cpu is None or pages.last_page_len_cpu is None:  # prepare_plan sets them
            raise InputError("internal: the plan has no host page metadata")
        common = dict(q_data_type=p.dtype, kv_data_type=p.kv_dtype, sm_scale=p.scale)
        if p.fp8:
            common["use_token_head_sf"] = True
        if slot.path == "decode":
            # decode.py _plan_impl: indptr/last_page_len are read with .to("cpu") (no-op for CPU
            # tensors: no sync); indices stay on the device (copied into the fixed buffer in
            # graph mode, kept by reference otherwise).
            slot.wrapper.plan(
                pages.indptr_cpu,
                pages.indices,
                pages.last_page_len_cpu,
                p.num_heads,
                p.num_kv_heads,
                p.head_dim,
                bs,
                pos_encoding_mode="NONE",
                window_left=p.window_left,
                logits_soft_cap=p.softcap,
                non_blocking=True,
                **common,
            )
            if slot.graph:
                assert slot.pad_rows is not None
                if plan.pad_rows is None:
                    slot.pad_rows.zero_()
                else:
                    slot.pad_rows.copy_(plan.pad_rows)
        elif slot.path == "cascade":
            assert plan.cascade is not None
            c, sp = plan.cascade, plan.cascade.suffix.pages
            levels = dict(pos_encoding_mode="NONE", logits_soft_cap=p.softcap, non_blocking=True, **common)
            prefix_level, suffix_level = slot.wrapper
            # Level 0 is not causal (cascade.py plan: causal only on the last level): every query
            # lies after the prefix, which prepare_plan checked.
            prefix_level.plan(
                c.prefix_qo_indptr_cpu,
                c.prefix_indptr_cpu,
                c.prefix_indices,
                c.prefix_last_page_len_cpu,
                p.num_heads,
                p.num_kv_heads,
                p.head_dim,
                bs,
                causal=False,
                head_dim_vo=p.head_dim_vo,
                **levels,
            )
            suffix_level.plan(
                plan.qo_indptr_cpu,
                sp.indptr_cpu,
                sp.indices,
                sp.last_page_len_cpu,
                p.num_heads,
                p.num_kv_heads,
                p.head_dim,
                bs,
                causal=True,
                head_dim_vo=p.head_dim_vo,
                **levels,
            )
        elif slot.path == "prefill":
            # prefill.py plan: qo_indptr.to("cpu") and _paged_kv_host_metadata(indptr,
            # last_page_len).to("cpu"): CPU tensors here, so no sync.
            slot.wrapper.plan(
                plan.qo_indptr_cpu,
                pages.indptr_cpu,
                pages.indices,
                pages.last_page_len_cpu,
                p.num_heads,
                p.num_kv_heads,
                p.head_dim,
                bs,
                head_dim_vo=p.head_dim_vo,
                causal=True,
                pos_encoding_mode="NONE",
                window_left=p.window_left,
                logits_soft_cap=p.softcap,
                non_blocking=True,
                **common,
            )
        else:
            # attention/_core.py BatchAttention.plan: causal is bottom-right aligned
            # (persistent.cuh: "kv_len - q_len + ..."), matching our rule of positions. It calls
            # torch.cuda.synchronize() itself after its host copies: one sync per step.
            slot.wrapper.plan(
                plan.qo_indptr_cpu,
                pages.indptr_cpu,
                pages.indices,
                plan.kv_lens_cpu,
                p.num_heads,
                p.num_kv_heads,
                p.head_dim,
                p.head_dim_vo,
                bs,
                causal=True,
                sm_scale=p.scale,
                logits_soft_cap=p.softcap,
                q_data_type=p.dtype,
                kv_data_type=p.dtype,
            )

    @staticmethod
    def _prewarm(p: _Params, device: torch.device) -> None:
        # The wrappers' run() fetches a per-(num_heads, device) ALiBi slope buffer from a global
        # cache (flashinfer/utils.py _get_cache_alibi_slopes_buf), creating it on first use. Create
        # it here, on the host path, so that a forward captured in a CUDA graph never allocates
        # it from the graph's private pool. Best effort: a private helper that may move.
        try:
            from flashinfer.utils import _get_cache_alibi_slopes_buf

            _get_cache_alibi_slopes_buf(p.num_heads, device)
        except Exception:  # only an optimisation for capture; run() creates it otherwise
            pass

    # ----------------------------------------------------------------------------- forward
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
        if q.shape[0] == 0:
            return
        if cache.quantized and cache.kv_dtype not in _FP8:
            # Capabilities refuse it; a direct _forward call must not misread codes.
            raise InputError(
                f"kv_dtype {cache.kv_dtype!r} is not supported by the flashinfer backend (accepted: "
                f"'auto', {', '.join(map(repr, _FP8))})"
            )
        p = self._plan_for(plan)
        params = _Params(
            int(q.shape[1]),
            cache.num_kv_heads,
            int(q.shape[2]),
            q.dtype,
            int(window),
            float(softcap),
            float(scale),
            cache.head_dim_v,
            cache.k.dtype,
        )
        slot = self._load(p, params, q.device)

        qc = q if q.is_contiguous() else q.contiguous()
        o = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        kv = (cache.k, cache.v)
        # fp8: the scales as FlashInfer's use_token_head_sf reads them, [pages, page_size, heads].
        sf = {"kv_cache_sf": (cache.k_scale, cache.v_scale)} if params.fp8 else {}
        if slot.path == "cascade":
            prefix_level, suffix_level = slot.wrapper
            lse_s = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            suffix_level.run(qc, kv, out=o, lse=lse_s, return_lse=True, **sf)
            o_p, lse_p = prefix_level.run(qc, kv, return_lse=True, **sf)
            _flashinfer().merge_state_in_place(o, lse_s, o_p, lse_p)  # both LSEs base 2
        elif slot.path == "batch_attention":
            # BatchAttention.run always computes the LSE; soft-cap must be repeated at run time
            # (_core.py: "Must be consistent with the logits_soft_cap passed to plan()").
            slot.wrapper.run(qc, kv, out=o, lse=lse, logits_soft_cap=params.softcap)
        elif lse is not None:
            slot.wrapper.run(qc, kv, out=o, lse=lse, return_lse=True, **sf)
        else:
            slot.wrapper.run(qc, kv, out=o, **sf)
        if lse is not None:
            lse.mul_(LN2)
        pad_rows = slot.pad_rows if slot.graph else p.pad_rows
        if pad_rows is not None:
            # Padding rows ran over a dummy page: overwrite them (masked_fill also clears NaN).
            o.masked_fill_(pad_rows[:, None, None], 0.0)
            if lse is not None:
                lse.masked_fill_(pad_rows[:, None], -math.inf)
        if o is not out:
            out.copy_(o)
