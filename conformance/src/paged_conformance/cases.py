"""The conformance cases: one table of data, two sizes.

A case is a batch (each request's query and sequence length) plus the shape and features of the
attention call (heads, head_dim, block size, dtypes, window, soft-cap, sinks, backend options).
Its id is the test id: ``test_matches_reference[triton-unified-sliding_window]``.

The same table runs at two sizes. ``small`` keeps every kernel call well under a second when the
Triton backends run under ``TRITON_INTERPRET=1`` on a CPU (measured: ~0.2 s for the small mixed
batch with 4/1 heads, ~0.7 s with 4/4), so the whole suite stays within minutes there. ``full``
is what a GPU runs: 32/8 heads, head_dim 128, dozens of requests, contexts of thousands of tokens.
Only the batches and head counts scale; the ids and what each case is about stay the same.

Positions follow ``paged_core.BatchMeta``: request r's ``query_lens[r]`` new tokens are the last
of its ``seq_lens[r]`` tokens; ``seq_lens[r] == 0`` makes it a padding request.

>>> [c.id for c in cases("small")][:3]
['mixed_prefill_and_decode-g4', 'mixed_prefill_and_decode-g3', 'mixed_prefill_and_decode-g1']
>>> case = get_case("spec_verify_5", "small")
>>> case.query_lens, case.seq_lens
((5, 5, 5, 1), (12, 70, 133, 40))
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from paged_core import AttentionSpec

__all__ = [
    "SIZES",
    "CACHE_LAYOUTS",
    "SINKS_LAYOUTS",
    "META_LAYOUTS",
    "SINKS_VALUES",
    "KV_SCALES",
    "Batch",
    "Case",
    "TABLE",
    "cases",
    "get_case",
    "default_size",
    "default_device",
]

#: The case sizes: ``small`` for CPUs (Triton under its interpreter), ``full`` for GPUs.
SIZES = ("small", "full")

#: Memory layouts of the cache a case can ask for (see ``Case.cache_layout``).
CACHE_LAYOUTS = ("nhd", "kv_interleaved", "hnd_view")
#: Memory layouts of ``sinks`` (see ``Case.sinks_layout``).
SINKS_LAYOUTS = ("contiguous", "every_other")
#: Memory layouts of the batch metadata (see ``Case.meta_layout``).
META_LAYOUTS = ("contiguous", "strided_views")
#: What the sinks hold (see ``Case.sinks_values``).
SINKS_VALUES = ("random", "extreme")
#: Scales of a quantized cache (see ``Case.kv_scales``).
KV_SCALES = ("per_slot", "per_head", "per_tensor")

_DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclasses.dataclass(frozen=True)
class Batch:
    """Per-request lengths of one batch: ``query_lens[r]`` new tokens of ``seq_lens[r]`` in all."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    #: Leading logical blocks that every request shares (the same physical blocks): a prefix
    #: cached once for many requests, as cascade attention exploits.
    shared_prefix_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class Case:
    """One concrete conformance case: a batch and the attention call made on it.

    Hashable, so workloads (random data and the float64 reference) can be cached per case.
    """

    #: The test id, e.g. ``mixed_prefill_and_decode-g4``.
    id: str
    #: New tokens of each request in this step (rows of q).
    query_lens: tuple[int, ...]
    #: Tokens of context of each request after this step; 0 = padding request (exact-zero rows).
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    #: The case is about its block size: a backend that cannot take it skips it. Otherwise a
    #: backend that takes only larger blocks (flash-attn 2: multiples of 256) runs the case at its
    #: smallest accepted block size, and the report says so.
    block_size_fixed: bool = False
    #: The model dtype of q, K, V and the output.
    dtype: torch.dtype = torch.float16
    #: The cache storage: "auto" (the model dtype), "int8", "fp8" (E4M3) or "fp8_e5m2" codes
    #: with float32 scales.
    kv_dtype: str = "auto"
    #: A quantized cache's scales: "per_slot", set by each write (``max|x| / q_max``); or static
    #: (``paged_core.static_scale``), fixed when the cache is made: "per_head", one per KV head,
    #: "per_tensor", one for all (vLLM's and SGLang's fp8 caches).
    kv_scales: str = "per_slot"
    #: Sliding window (0: off): each query sees its last ``window`` keys, itself included.
    window: int = 0
    #: Softmax scale passed to forward; None: the default ``head_dim ** -0.5``.
    scale: float | None = None
    #: Logit soft-cap (0: off).
    softcap: float = 0.0
    #: Whether to pass per-head attention sinks.
    sinks: bool = False
    #: "contiguous", or "qkv_view": q is a strided view into a fused [N, Hq + 2*Hkv, D] tensor.
    q_layout: str = "contiguous"
    #: Backend constructor options as (name, value) pairs, e.g. (("num_splits", 3),).
    options: tuple[tuple[str, Any], ...] = ()
    #: Leading logical blocks shared by every request (same physical block ids); 0: none.
    shared_prefix_blocks: int = 0
    #: How the cache's K and V are laid out in memory (always seen as NHD
    #: ``[num_blocks, block_size, num_kv_heads, head_dim]``): "nhd", the backend's own
    #: ``allocate``; "kv_interleaved", views ``pool[:, 0]`` and ``pool[:, 1]`` of one
    #: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` pool (FlashInfer's and vLLM's);
    #: "hnd_view", ``[num_blocks, num_kv_heads, block_size, head_dim]`` storage permuted to NHD.
    cache_layout: str = "nhd"
    #: "contiguous", or "every_other": ``sinks`` is ``buffer[::2]`` of a twice-as-long buffer.
    sinks_layout: str = "contiguous"
    #: "contiguous", or "strided_views": every metadata tensor of the batch (``query_start_loc``,
    #: ``seq_lens``, ``block_table`` rows and columns, ``slot_mapping``, the host mirrors) is a
    #: stride-2 view of a persistent buffer twice its size, other numbers in between (engines
    #: slice their buffers).
    meta_layout: str = "contiguous"
    #: "random" sinks around e^2, or "extreme": the limits, +inf for one head (the sink takes all
    #: the mass: exact zeros) and -inf for another (no sink), random for the rest.
    sinks_values: str = "random"
    #: V's and the output's head dim (MLA-shaped layers: 192/128 in DeepSeek-V3); None: ``head_dim``.
    head_dim_v: int | None = None
    #: Seed of the random data; derived from the id when left at None.
    seed: int | None = None
    #: One sentence: what the case is about (shown in reports).
    about: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.seed is None:
            # crc32, not hash(): the same data in every process and Python version.
            object.__setattr__(self, "seed", zlib.crc32(self.id.encode()))
        if len(self.query_lens) != len(self.seq_lens):
            raise ValueError(f"case {self.id}: query_lens and seq_lens differ in length")
        if self.cache_layout not in CACHE_LAYOUTS:
            raise ValueError(
                f"case {self.id}: cache_layout {self.cache_layout!r}; accepted: {', '.join(CACHE_LAYOUTS)}"
            )
        if self.kv_scales not in KV_SCALES or (self.kv_scales != "per_slot" and self.kv_dtype == "auto"):
            raise ValueError(
                f"case {self.id}: kv_scales {self.kv_scales!r} with kv_dtype {self.kv_dtype!r}; "
                f"accepted: {', '.join(KV_SCALES)}, static ones for a quantized cache only"
            )
        if self.meta_layout not in META_LAYOUTS or self.sinks_values not in SINKS_VALUES:
            raise ValueError(
                f"case {self.id}: meta_layout {self.meta_layout!r}, sinks_values {self.sinks_values!r}; "
                f"accepted: {', '.join(META_LAYOUTS)} and {', '.join(SINKS_VALUES)}"
            )
        if self.sinks_layout not in SINKS_LAYOUTS:
            raise ValueError(
                f"case {self.id}: sinks_layout {self.sinks_layout!r}; accepted: {', '.join(SINKS_LAYOUTS)}"
            )

    # ----------------------------------------------------------------------------- derived
    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def decode_only(self) -> bool:
        return max(self.query_lens, default=0) <= 1

    @property
    def padding_requests(self) -> list[int]:
        return [r for r, s in enumerate(self.seq_lens) if s == 0]

    @property
    def real_requests(self) -> list[int]:
        return [r for r, s in enumerate(self.seq_lens) if s > 0]

    @property
    def dim_v(self) -> int:
        """V's head dim: ``head_dim_v``, or ``head_dim`` when that is None."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def spec(self, device: torch.device | str, *, return_lse: bool = False) -> AttentionSpec:
        """The ``AttentionSpec`` a backend sees for this case (what ``reasons()`` is asked about)."""
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,  # type: ignore[arg-type]
            kv_scales=self.kv_scales,
            window=self.window,
            softcap=self.softcap,
            sinks=self.sinks,
            device=torch.device(device).type,
            decode_only=self.decode_only,
            return_lse=return_lse,
            head_dim_v=self.dim_v,
        )

    def describe(self) -> str:
        """A one-line summary of the shape, for reports and failure messages."""
        parts = [
            f"{self.num_reqs} reqs / {self.num_tokens} tokens",
            f"heads {self.num_heads}/{self.num_kv_heads}",
            f"head_dim {self.head_dim}" + ("" if self.dim_v == self.head_dim else f"/v {self.dim_v}"),
            f"block {self.block_size}",
            _DTYPE_IDS[self.dtype],
        ]
        if self.kv_dtype != "auto":
            parts.append(f"kv {self.kv_dtype}")
        if self.kv_scales != "per_slot":
            parts.append(f"static scales {self.kv_scales.replace('_', ' ')}")
        if self.window:
            parts.append(f"window {self.window}")
        if self.scale is not None:
            parts.append(f"scale {self.scale:g}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.q_layout != "contiguous":
            parts.append(f"q {self.q_layout}")
        if self.shared_prefix_blocks:
            parts.append(f"{self.shared_prefix_blocks} shared prefix blocks")
        if self.cache_layout != "nhd":
            parts.append(f"cache {self.cache_layout}")
        if self.sinks_layout != "contiguous":
            parts.append(f"sinks {self.sinks_layout}")
        if self.sinks_values != "random":
            parts.append(f"sinks {self.sinks_values}")
        if self.meta_layout != "contiguous":
            parts.append(f"metadata {self.meta_layout}")
        parts += [f"{k}={v}" for k, v in self.options]
        return ", ".join(parts)


# --------------------------------------------------------------------------------- the table
# The batches every case is built on, per size. "full" adds requests and lengthens contexts;
# "small" keeps the features (a chunk after cached context, whole prompts, decodes crossing
# several blocks, a last block exactly full, padding) at interpreter-friendly lengths.
BATCHES: Mapping[str, Mapping[str, Batch]] = {
    # A mid-prefill chunk (new tokens after cached context), a whole 16-token prompt, a 21-token
    # prompt (not a multiple of the block size), and decodes at 70 and 130 tokens.
    "mixed": {
        "small": Batch((24, 16, 21, 1, 1), (56, 16, 21, 70, 130)),
        "full": Batch(
            (512, 16, 21, 1, 1, *[1] * 30),
            (1536, 16, 21, 70, 130, *[97 + 131 * i for i in range(30)]),
        ),
    },
    # Decode only, long and short contexts together (64: the last block exactly full).
    "decode": {
        "small": Batch((1, 1, 1, 1, 1), (300, 3, 130, 17, 64)),
        "full": Batch(
            (1,) * 16,
            (8192, 3, 130, 17, 64, 4096, 1, 2048, 513, 1000, 33, 3000, 16, 700, 7, 1500),
        ),
    },
    # Real requests followed by padding requests (seq_len 0), as in a batch padded for a CUDA
    # graph; one padding request has two rows (a padded verification block).
    "padding": {
        "small": Batch((5, 1, 1, 2, 1), (45, 70, 17, 0, 0)),
        "full": Batch((5, 1, 1, 1, 2, 1, 1, 1), (45, 70, 17, 2000, 0, 0, 0, 0)),
    },
    # Speculative decoding: blocks of 5 tokens (4 drafts + 1) to verify, and one plain decode.
    "spec_verify": {
        "small": Batch((5, 5, 5, 1), (12, 70, 133, 40)),
        "full": Batch((*[5] * 16, 1), (*[12 + 250 * i for i in range(16)], 40)),
    },
    # Requests at their very first token (seq_len 1) and first decode (seq_len 2).
    "first_token": {
        "small": Batch((1, 1, 1, 1), (1, 2, 70, 33)),
        "full": Batch((1,) * 8, (1, 1, 2, 70, 1, 4096, 2, 300)),
    },
    # More than 32 requests (a request index in 5 bits, a grid dimension capped at 32 shows),
    # decodes and short prompts with one padding request; short contexts keep it cheap under the
    # Triton interpreter.
    "many_requests": {
        "small": Batch(
            tuple(3 if i % 7 == 3 else 1 for i in range(39)) + (1,), tuple(1 + (13 * i) % 47 for i in range(39)) + (0,)
        ),
        "full": Batch(
            tuple(5 if i % 7 == 3 else 1 for i in range(63)) + (1,),
            tuple(1 + (977 * i) % 3001 for i in range(63)) + (0,),
        ),
    },
    # More than 128 requests (an int8 request index, a 128-wide grid dimension), decodes only.
    "over_128_requests": {
        # Under the Triton interpreter each request's program costs ~0.13 s whatever its length
        # (measured 2026-12-01, Triton 3.9, 2 CPU cores): 130 one- and two-block requests.
        "small": Batch((1,) * 130, tuple(1 + (7 * i) % 20 for i in range(130))),
        "full": Batch((1,) * 300, tuple(1 + (331 * i) % 2049 for i in range(300))),
    },
    # Requests sharing a cached prefix (the same physical blocks), then private suffixes:
    # decodes and one verification block, as in parallel sampling from one prompt.
    "shared_prefix": {
        "small": Batch((1, 1, 3, 1), (69, 94, 81, 112), shared_prefix_blocks=4),
        "full": Batch((1,) * 15 + (5,), tuple(4000 + 37 + 11 * i for i in range(16)), shared_prefix_blocks=250),
    },
    # One request (every dimension over requests of size 1): a chunk after cached context.
    "one_request": {
        "small": Batch((3,), (11,)),
        "full": Batch((64,), (1000,)),
    },
}

#: (num_heads, num_kv_heads) per query/KV group size and case size. Group 3 pads to 4 in
#: kernels that pack a group into tile rows; the small 6/2 also has two KV heads, so a query
#: head reading the wrong KV head shows.
HEADS: Mapping[str, Mapping[int, tuple[int, int]]] = {
    "small": {4: (4, 1), 3: (6, 2), 1: (2, 2)},
    "full": {4: (32, 8), 3: (24, 8), 1: (32, 32)},
}
DEFAULT_HEAD_DIM = {"small": 64, "full": 128}
#: Shorter than the mixed batch's prefill chunk (24 / 512 tokens), so the window cuts inside it.
WINDOW = {"small": 16, "full": 128}
#: Against unit-normal logits a cap this low changes the softmax visibly, so ignoring it fails.
SOFTCAP = 2.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of :data:`TABLE`: a batch name and what differs from the defaults."""

    id: str
    batch: str
    about: str
    group: int = 4
    head_dim: int | None = None  # None: the size's default
    #: (head_dim, head_dim_v) per size when V's head dim differs (MLA-shaped); overrides head_dim.
    mla: Mapping[str, tuple[int, int]] | None = None
    block_size: int = 16
    block_size_fixed: bool = False
    dtype: torch.dtype = torch.float16
    kv_dtype: str = "auto"
    kv_scales: str = "per_slot"
    window: bool = False
    scale: float | None = None
    softcap: bool | float = False
    sinks: bool = False
    q_layout: str = "contiguous"
    cache_layout: str = "nhd"
    sinks_layout: str = "contiguous"
    meta_layout: str = "contiguous"
    sinks_values: str = "random"
    options: tuple[tuple[str, Any], ...] = ()

    def build(self, size: str) -> Case:
        batch = BATCHES[self.batch][size]
        num_heads, num_kv_heads = HEADS[size][self.group]
        head_dim, head_dim_v = self.mla[size] if self.mla else (self.head_dim or DEFAULT_HEAD_DIM[size], None)
        return Case(
            id=self.id,
            query_lens=batch.query_lens,
            seq_lens=batch.seq_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            block_size=self.block_size,
            block_size_fixed=self.block_size_fixed,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            kv_scales=self.kv_scales,
            window=WINDOW[size] if self.window else 0,
            scale=self.scale,
            softcap=(float(self.softcap) if type(self.softcap) is not bool else SOFTCAP) if self.softcap else 0.0,
            sinks=self.sinks,
            q_layout=self.q_layout,
            cache_layout=self.cache_layout,
            sinks_layout=self.sinks_layout,
            meta_layout=self.meta_layout,
            sinks_values=self.sinks_values,
            options=self.options,
            shared_prefix_blocks=batch.shared_prefix_blocks,
            about=self.about,
        )


_MIXED = "the mixed batch"
#: The one case table. Defaults: group 4, the size's head_dim, block 16, float16, "auto" cache.
TABLE: tuple[Row, ...] = (
    Row("mixed_prefill_and_decode-g4", "mixed", f"{_MIXED}, 4 query heads per KV head"),
    Row("mixed_prefill_and_decode-g3", "mixed", f"{_MIXED}, 3 query heads per KV head (padded)", group=3),
    Row("mixed_prefill_and_decode-g1", "mixed", f"{_MIXED}, one query head per KV head (MHA)", group=1),
    Row("decode_only-long_and_short", "decode", "decodes with long and short contexts together"),
    Row("padding_rows", "padding", "padding requests (seq_len 0) must give exact zeros"),
    Row("spec_verify_5", "spec_verify", "speculative verification blocks of 5 tokens"),
    Row("first_token", "first_token", "requests at their very first token"),
    Row("qkv_view", "mixed", "q is a strided view into a fused QKV tensor", q_layout="qkv_view"),
    Row("sliding_window", "mixed", "a sliding window shorter than the prefill chunk", window=True),
    Row("sliding_window-decode_only", "decode", "a sliding window on long and short decodes", window=True),
    Row("explicit_scale", "mixed", "a softmax scale other than head_dim**-0.5", scale=0.3),
    Row("softcap", "mixed", "logit soft-capping", softcap=True),
    Row("sinks", "mixed", "per-head attention sinks", sinks=True),
    Row(
        "sinks-strided",
        "mixed",
        "sinks as a strided view (every other element of a buffer)",
        sinks=True,
        sinks_layout="every_other",
    ),
    Row(
        "cache-kv_interleaved",
        "mixed",
        "K and V as views pool[:, 0], pool[:, 1] of one [num_blocks, 2, block_size, num_kv_heads, head_dim] pool",
        group=3,
        cache_layout="kv_interleaved",
    ),
    Row("cache-hnd_view", "mixed", "HND cache storage seen as NHD (a permuted view)", group=3, cache_layout="hnd_view"),
    Row(
        "meta-strided_views",
        "mixed",
        "every metadata tensor a stride-2 view of a persistent buffer",
        meta_layout="strided_views",
    ),
    Row(
        "meta-strided_views-decode_only",
        "decode",
        "decodes whose metadata are stride-2 views of buffers",
        meta_layout="strided_views",
    ),
    Row(
        "sinks-extreme",
        "mixed",
        "sinks at their limits: +inf (zeros) for one head, -inf (none) for another",
        sinks=True,
        sinks_values="extreme",
    ),
    Row("softcap-largest", "mixed", "the largest soft-cap accepted (no cap in effect)", softcap=1.7e38),
    Row(
        "size_one_dims",
        "one_request",
        "one request, one KV head, blocks of one token",
        block_size=1,
        block_size_fixed=True,
    ),
    Row(
        "kv_fp8-static-block_size_1",
        "one_request",
        "fp8 cache with one static scale at blocks of one token",
        block_size=1,
        block_size_fixed=True,
        kv_dtype="fp8",
        kv_scales="per_tensor",
    ),
    Row("many_requests", "many_requests", "more than 32 requests in one batch"),
    Row("over_128_requests", "over_128_requests", "more than 128 requests in one batch"),
    *(Row(f"head_dim_{d}", "mixed", f"head_dim {d}", head_dim=d) for d in (64, 96, 128, 256)),
    *(
        Row(f"block_size_{b}", "mixed", f"KV blocks of {b} tokens", block_size=b, block_size_fixed=True)
        for b in (16, 32, 64, 256)
    ),
    Row("kv_int8", "mixed", "int8 cache with per-token, per-head scales", kv_dtype="int8"),
    Row("kv_fp8", "mixed", "fp8 (E4M3) cache with per-token, per-head scales", kv_dtype="fp8"),
    Row("kv_int8-decode_only", "decode", "int8 cache, decode only", kv_dtype="int8"),
    Row("kv_fp8-decode_only", "decode", "fp8 cache, decode only", kv_dtype="fp8"),
    Row(
        "kv_int8-static",
        "mixed",
        "int8 cache with static scales, one per KV head",
        kv_dtype="int8",
        kv_scales="per_head",
    ),
    Row(
        "kv_fp8-static-decode_only",
        "decode",
        "fp8 cache with one static scale per KV head, decode only",
        kv_dtype="fp8",
        kv_scales="per_head",
    ),
    Row(
        "kv_fp8-static-kv_interleaved",
        "mixed",
        "vLLM's fp8 cache: one static scale per tensor, K and V views of one [num_blocks, 2, ...] pool",
        group=3,
        kv_dtype="fp8",
        kv_scales="per_tensor",
        cache_layout="kv_interleaved",
    ),
    Row("kv_int4", "mixed", "int4 cache (two codes a byte) with per-token, per-head scales", kv_dtype="int4"),
    Row("kv_int4-decode_only", "decode", "int4 cache, decode only", kv_dtype="int4"),
    Row(
        "kv_int4-mla",
        "mixed",
        "int4 cache, MLA-shaped heads",
        kv_dtype="int4",
        mla={"small": (64, 32), "full": (192, 128)},
    ),
    Row(
        "kv_kivi4",
        "mixed",
        "kivi4 cache: int4 keys scaled per (block, channel), int4 values per (token, head)",
        kv_dtype="kivi4",
    ),
    Row("kv_kivi4-decode_only", "decode", "kivi4 cache, decode only (each write rescales a block)", kv_dtype="kivi4"),
    *(
        Row(
            f"kv_kivi4-block_size_{b}",
            "mixed",
            f"kivi4 cache in {b}-token blocks (a key step spans several blocks, or part of one)",
            kv_dtype="kivi4",
            block_size=b,
            block_size_fixed=True,
        )
        for b in (8, 64)
    ),
    Row("kv_fp8_e5m2", "mixed", "fp8 E5M2 cache with per-token, per-head scales", kv_dtype="fp8_e5m2"),
    Row("kv_fp8_e5m2-decode_only", "decode", "fp8 E5M2 cache, decode only", kv_dtype="fp8_e5m2"),
    Row(
        "kv_fp8_e5m2-static-decode_only",
        "decode",
        "fp8 E5M2 cache with one static scale per KV head, decode only",
        kv_dtype="fp8_e5m2",
        kv_scales="per_head",
    ),
    Row(
        "kv_fp8_e5m2-static-kv_interleaved",
        "mixed",
        "vLLM's fp8_e5m2 cache: one static scale per tensor, K and V views of one [num_blocks, 2, ...] pool",
        group=3,
        kv_dtype="fp8_e5m2",
        kv_scales="per_tensor",
        cache_layout="kv_interleaved",
    ),
    Row("fp32", "mixed", "float32 inputs", dtype=torch.float32),
    Row("bf16", "mixed", "bfloat16 inputs", dtype=torch.bfloat16),
    Row("bf16-decode_only", "decode", "bfloat16 inputs, decode only", dtype=torch.bfloat16),
    Row(
        "all_features-bf16-kv_fp8",
        "mixed",
        "window, soft-cap and sinks at once on a bf16 fp8 cache",
        dtype=torch.bfloat16,
        kv_dtype="fp8",
        window=True,
        softcap=True,
        sinks=True,
    ),
    # For backends that split the KV (Flash-Decoding): forced split counts. Backends whose
    # constructor takes no `num_splits` option skip these with that reason.
    *(
        Row(f"split_{n}", "decode", f"decode split into {n} KV partitions", options=(("num_splits", n),))
        for n in (1, 3, 8)
    ),
    # A backend's bitwise batch-invariant mode: its capabilities then promise torch.equal between
    # a request alone and in the batch, which the batch_invariance check holds it to.
    Row(
        "batch_invariant-decode_only",
        "decode",
        "decode in the backend's batch-invariant mode",
        dtype=torch.bfloat16,
        options=(("batch_invariant", True),),
    ),
    # Cascade attention: the shared prefix read once for the whole batch, then merged.
    Row(
        "cascade-shared_prefix",
        "shared_prefix",
        "requests sharing a cached prefix, cascade on",
        dtype=torch.bfloat16,
        options=(("cascade", True), ("min_prefix_tokens", 16)),
    ),
    Row(
        "shared_prefix",
        "shared_prefix",
        "requests sharing a cached prefix (same physical blocks)",
        dtype=torch.bfloat16,
    ),
    # MLA-shaped heads: V (and the output) narrower than Q/K, DeepSeek-V3's 192/128 and 96/64 at
    # both sizes; the feature rows use 64/32 on a CPU, where the interpreter's time grows with
    # the head dims.
    *(
        Row(
            f"mla_{d}_{dv}",
            "mixed",
            f"V head dim {dv} under QK head dim {d} (MLA-shaped)",
            mla={"small": (d, dv), "full": (d, dv)},
        )
        for d, dv in ((192, 128), (96, 64))
    ),
    Row(
        "mla-small_pair",
        "mixed",
        "V head dim 32 under QK head dim 64, float32",
        mla={"small": (64, 32), "full": (64, 32)},
        dtype=torch.float32,
    ),
    Row("mla-wider_v", "mixed", "V head dim 64 over QK head dim 32", mla={"small": (32, 64), "full": (128, 256)}),
    Row(
        "mla-decode_only",
        "decode",
        "MLA-shaped heads, decode only",
        mla={"small": (64, 32), "full": (192, 128)},
        dtype=torch.bfloat16,
    ),
    Row(
        "mla-kv_int8",
        "mixed",
        "MLA-shaped heads on an int8 cache",
        mla={"small": (64, 32), "full": (192, 128)},
        kv_dtype="int8",
    ),
    Row(
        "mla-kv_fp8-decode_only",
        "decode",
        "MLA-shaped heads on an fp8 cache, decode only",
        mla={"small": (64, 32), "full": (192, 128)},
        kv_dtype="fp8",
        dtype=torch.bfloat16,
    ),
    Row(
        "mla-all_features",
        "mixed",
        "MLA-shaped heads with window, soft-cap and sinks",
        mla={"small": (64, 32), "full": (192, 128)},
        window=True,
        softcap=True,
        sinks=True,
    ),
    *(
        Row(
            f"mla-split_{n}",
            "decode",
            f"MLA-shaped decode split into {n} KV partitions",
            mla={"small": (64, 32), "full": (192, 128)},
            options=(("num_splits", n),),
        )
        for n in (1, 3)
    ),
    Row(
        "mla-cascade-shared_prefix",
        "shared_prefix",
        "MLA-shaped heads, shared prefix, cascade on",
        mla={"small": (64, 32), "full": (192, 128)},
        dtype=torch.bfloat16,
        options=(("cascade", True), ("min_prefix_tokens", 16)),
    ),
    Row(
        "mla-int8-cascade",
        "shared_prefix",
        "MLA-shaped heads over an int8 cache, shared prefix, cascade on",
        mla={"small": (64, 32), "full": (192, 128)},
        kv_dtype="int8",
        options=(("cascade", True), ("min_prefix_tokens", 16)),
    ),
)


def cases(size: str) -> list[Case]:
    """Every case of the table at ``size`` ("small" or "full")."""
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    return [row.build(size) for row in TABLE]


def get_case(case_id: str, size: str) -> Case:
    """The case called ``case_id`` at ``size``."""
    for case in cases(size):
        if case.id == case_id:
            return case
    raise KeyError(f"no case {case_id!r}; known: {', '.join(r.id for r in TABLE)}")


def default_size() -> str:
    """``$PAGED_CONFORMANCE_SIZE``, else "full" when a CUDA device is present, else "small"."""
    size = os.environ.get("PAGED_CONFORMANCE_SIZE")
    if size:
        if size not in SIZES:
            raise ValueError(f"PAGED_CONFORMANCE_SIZE is {size!r}; accepted: {', '.join(SIZES)}")
        return size
    return "full" if torch.cuda.is_available() else "small"


def default_device() -> torch.device:
    """``$PAGED_CONFORMANCE_DEVICE``, else cuda when available, else cpu."""
    dev = os.environ.get("PAGED_CONFORMANCE_DEVICE")
    if dev:
        return torch.device(dev)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
