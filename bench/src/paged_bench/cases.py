"""The benchmark's cases: a few large batches (decode, mixed, prefill, quantized caches, a shared
prefix, a batch-size sweep), each with its per-request lengths as the suite's ``Batch``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
from paged_conformance import Batch

if TYPE_CHECKING:
    from paged_core import KVDtype

    from .config import Config

__all__ = ["CASE_IDS", "CPU_CASES", "QUANT_SHAPES", "STATIC_SCALE", "Case", "build_cases"]

#: Case ids in the order they run; ``--cases`` takes any of these ("sweep" = every sweep point).
CASE_IDS = (
    "decode",
    "decode-long",
    "decode-short",
    "decode-medium",
    "decode-single",
    "mixed",
    "prefill",
    "decode-int8",
    "decode-fp8",
    "decode-fp8-static",
    "decode-fp8_e5m2",
    "decode-int4",
    "decode-kivi4",
    "cascade",
    "sweep",
)
#: What runs on a machine without a GPU unless ``--cases`` says otherwise (minuscule sizes).
CPU_CASES = ("decode", "mixed", "prefill", "decode-int8", "decode-fp8", "decode-fp8-static", "cascade", "sweep")
#: The shapes every quantized-cache case runs at (batch, context, id suffix): the bf16 rows of
#: ``decode``, ``decode-short`` and ``decode-long``, so each format has a bf16 row to compare with.
QUANT_SHAPES = ((64, 4096, ""), (256, 1024, "-short"), (4, 32768, "-long"))
#: The static scale of the ``decode-fp8-static`` case, for K and V: unit-normal K/V reach 448 codes
#: at 4 sigma (|x| > 4: p ~ 6e-5 saturate), as a calibrated per-tensor scale would put them.
STATIC_SCALE = 4.0 / 448


@dataclasses.dataclass
class Case:
    """One timed batch: its per-request lengths (the suite's :class:`paged_conformance.Batch`) and labels."""

    id: str
    kind: str  # decode | mixed | prefill | cascade
    shape: str
    #: ``query_lens[r]`` new tokens of ``seq_lens[r]`` in all, and the blocks every request shares.
    lengths: Batch
    kv_dtype: KVDtype = "auto"
    #: A quantized cache with one static scale per tensor (``STATIC_SCALE``), vLLM's fp8 format,
    #: instead of one scale per slot.
    static_scales: bool = False
    group: str = ""  # "sweep" for sweep points
    batch: int = 0
    description: str = ""

    @property
    def query_lens(self) -> tuple[int, ...]:
        return self.lengths.query_lens

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.lengths.seq_lens

    def allocate_kwargs(self) -> dict:
        """``allocate_kv_cache``'s static-scale keywords for this case (none for per-slot scales)."""
        return dict(k_scale=STATIC_SCALE, v_scale=STATIC_SCALE) if self.static_scales else {}

    @property
    def uniform(self) -> bool:
        """One context length, and either one query per request or whole prompts (SDPA can run it)."""
        if len(set(self.seq_lens)) != 1 or self.kv_dtype != "auto":
            return False
        pairs = zip(self.query_lens, self.seq_lens, strict=True)
        return all(q == 1 for q in self.query_lens) or all(q == s for q, s in pairs)


def build_cases(cfg: Config) -> list[Case]:
    """The cases ``cfg.cases`` selects, in the order of :data:`CASE_IDS` (tiny sizes without a GPU)."""
    t = cfg.tiny
    g = torch.Generator().manual_seed(cfg.seed + 1)

    def decode(cid: str, b: int, n: int, desc: str, kv: KVDtype = "auto") -> Case:
        return Case(cid, "decode", f"{b}x{n}", Batch((1,) * b, (n,) * b), kv_dtype=kv, description=desc)

    out: list[Case] = []
    for cid in CASE_IDS:
        if cid not in cfg.cases:
            continue
        if cid == "decode":
            b, n = (2, 64) if t else (64, 4096)
            out.append(decode(cid, b, n, "headline decode"))
        elif cid == "decode-long":
            b, n = (1, 256) if t else (4, 32768)
            out.append(decode(cid, b, n, "few long contexts (split-KV territory)"))
        elif cid == "decode-short":
            b, n = (4, 32) if t else (256, 1024)
            out.append(decode(cid, b, n, "many short contexts"))
        elif cid == "decode-medium":
            b, n = (2, 128) if t else (16, 8192)
            out.append(decode(cid, b, n, "medium batch, medium context"))
        elif cid == "decode-single":
            n = 512 if t else 131072
            out.append(decode(cid, 1, n, "one very long context"))
        elif cid == "mixed":
            chunk, ctxs, ndec, dlen, spread = (8, [8, 24], 2, 40, 8) if t else (512, [1024, 3072], 30, 2000, 100)
            dec = [dlen + int(x) for x in torch.randint(-spread, spread + 1, (ndec,), generator=g)]
            qlens = (1,) * ndec + (chunk,) * len(ctxs)
            slens = (*dec, *(c + chunk for c in ctxs))
            out.append(
                Case(
                    cid,
                    "mixed",
                    f"{len(ctxs)}x{chunk}+{ndec}x~{dlen}",
                    Batch(qlens, slens),
                    description=f"{len(ctxs)} prefill chunks of {chunk} (context {ctxs}) + {ndec} decodes at ~{dlen}",
                )
            )
        elif cid == "prefill":
            b, n = (2, 16) if t else (8, 2048)
            out.append(Case(cid, "prefill", f"{b}x{n}", Batch((n,) * b, (n,) * b), description="whole prompts, causal"))
        elif cid in ("decode-int8", "decode-fp8", "decode-fp8_e5m2", "decode-int4", "decode-kivi4"):
            kv = cast("KVDtype", cid.rsplit("-", 1)[1])  # the ids above name formats
            for b, n, shape_id in ((2, 64, ""),) if t else QUANT_SHAPES:
                out.append(decode(cid + shape_id, b, n, f"decode, {kv} cache", kv=kv))
        elif cid == "decode-fp8-static":
            for b, n, shape_id in ((2, 64, ""),) if t else QUANT_SHAPES:
                desc = "decode, fp8 cache with one static scale per tensor (vLLM's)"
                out.append(dataclasses.replace(decode(cid + shape_id, b, n, desc, kv="fp8"), static_scales=True))
        elif cid == "cascade":
            b, prefix, suffix = (4, 32, 8) if t else (64, 4000, 100)
            shared = prefix // cfg.block_size * cfg.block_size
            out.append(
                Case(
                    cid,
                    "cascade",
                    f"{b}x({prefix}+{suffix})",
                    Batch((1,) * b, (prefix + suffix,) * b, shared_prefix_blocks=prefix // cfg.block_size),
                    description=f"{b} decodes sharing a {prefix}-token prefix ({shared} tokens "
                    f"in the same physical blocks) + {suffix}-token suffixes",
                )
            )
        elif cid == "sweep":
            for n in cfg.sweep_lens:
                for b in cfg.sweep_batches:
                    c = decode(f"sweep-b{b}-l{n}", b, n, f"sweep: batch {b} at {n} tokens")
                    c.group, c.batch = "sweep", b
                    out.append(c)
    return out
