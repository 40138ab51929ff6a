"""The options of ``paged bench`` and the :class:`Config` they make (shapes, cases, timing)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

import torch
from paged_core import PagedError

from .cases import CASE_IDS, CPU_CASES

__all__ = ["CPU_NOTE", "DTYPES", "Config", "add_arguments", "dtype_name", "make_config", "split_values"]

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
#: Printed above and below a table timed on the CPU, and recorded in the JSON.
CPU_NOTE = "CPU timings — not representative; run on a GPU for real numbers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Time every installed backend (or --backend A,B) on the benchmark cases against the "
        "read-bandwidth floor measured in the same run; each result is checked against the "
        "reference before it is timed. Without a GPU it runs minuscule cases on the CPU."
    )
    p.add_argument(
        "--backend",
        action="append",
        metavar="A,B",
        help="only these backends (repeatable or comma-separated); the non-paged "
        "baselines are named sdpa-flash and sdpa-cudnn",
    )
    p.add_argument(
        "--cases",
        action="append",
        metavar="A,B",
        help=f"only these cases (repeatable or comma-separated): {', '.join(CASE_IDS)}",
    )
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; CPU 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; CPU 1)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; CPU 64)")
    p.add_argument(
        "--head-dim-v",
        type=int,
        default=None,
        help="V's and the output's head dim when it differs (MLA-shaped: --head-dim 192 --head-dim-v 128)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="model dtype (default bfloat16)")
    p.add_argument(
        "--sweep-len",
        action="append",
        metavar="L,L",
        help="context length(s) of the batch-size sweep (default 4096; e.g. 4096,32768)",
    )
    p.add_argument(
        "--sweep-batches",
        default=None,
        metavar="B,B",
        help="batch sizes of the sweep (default 1,2,4,8,16,32,64,128,256)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every result (env + rows) as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a PNG: achieved bandwidth vs the floor across the sweep (matplotlib)",
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="time nothing: print the table of a run recorded with --json (and --plot its sweep)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="shorter timing and a thinner sweep (implied without a GPU, with tiny sizes)",
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cuda", "cpu"], help="where to run (default: cuda if available)"
    )
    p.add_argument("--warmup", type=float, default=None, help="warm-up per timing, ms (default 25)")
    p.add_argument("--rep", type=float, default=None, help="timed repetitions per timing, ms (default 100)")
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="time eager calls only. By default, backends that claim cuda_graphs are also "
        "timed as CUDA-graph replays (as engines run decode) and 'ms' is the replay time; "
        "'eager ms' always includes the host-side launch cost",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the non-paged SDPA baselines")
    p.add_argument("--seed", type=int, default=0, help="random seed of data and block placement")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def split_values(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def _positive_ints(option: str, values: Sequence[str] | None) -> list[int]:
    """``--option 1,2`` as ints, or a PagedError naming the option (exit 2, not a traceback)."""
    out = []
    for v in split_values(values):
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise PagedError(f"{option} has {v!r}; accepted: positive ints separated by commas")
        out.append(n)
    return out


@dataclasses.dataclass
class Config:
    """Everything a run depends on besides the backends; ``--json`` records it (:meth:`public`)."""

    device: torch.device
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    cases: list[str]
    sweep_lens: list[int]
    sweep_batches: list[int]
    tiny: bool
    quick: bool
    warmup_ms: float
    rep_ms: float
    cuda_graph: bool
    seed: int
    min_pool_bytes: int
    #: V's and the output's head dim; None: ``head_dim``.
    head_dim_v: int | None = None

    @property
    def dim_v(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def public(self) -> dict:
        d = dataclasses.asdict(self)
        d["device"] = str(self.device)
        d["dtype"] = dtype_name(self.dtype)
        return d


def make_config(args: argparse.Namespace) -> Config:
    """The options checked (a :class:`PagedError` naming the option) and their defaults filled in,
    which differ without a GPU (tiny sizes, quick timing)."""
    want = getattr(args, "device", "auto") or "auto"
    if want == "cuda" and not torch.cuda.is_available():
        raise PagedError("--device cuda was asked for but torch sees no CUDA device")
    cuda = torch.cuda.is_available() and want != "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tiny = not cuda
    quick = bool(args.quick) or tiny
    cases = split_values(args.cases) or list(CASE_IDS if not tiny else CPU_CASES)
    unknown = [c for c in cases if c not in CASE_IDS and c != "all"]
    if unknown:
        raise PagedError(f"unknown case(s) {', '.join(unknown)}; accepted: {', '.join(CASE_IDS)}, all")
    if "all" in cases:
        cases = list(CASE_IDS)
    for opt in ("heads", "kv_heads", "head_dim", "head_dim_v", "block_size"):
        val = getattr(args, opt, None)
        if val is not None and val < 1:
            raise PagedError(f"--{opt.replace('_', '-')} is {val}; accepted: a positive int")
    for opt, low in (("warmup", 0.0), ("rep", None)):
        val = getattr(args, opt, None)
        if val is not None and not (math.isfinite(val) and (val > 0 if low is None else val >= low)):
            bound = "a positive number of milliseconds" if low is None else "0 or more milliseconds"
            raise PagedError(f"--{opt} is {val:g}; accepted: {bound}")
    if args.sweep_batches:
        batches = _positive_ints("--sweep-batches", [args.sweep_batches])
    elif tiny:
        batches = [1, 2, 4]
    elif quick:
        batches = [1, 4, 16, 64, 256]
    else:
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sweep_lens = _positive_ints("--sweep-len", args.sweep_len) or ([64] if tiny else [4096])
    heads = args.heads or (4 if tiny else 32)
    kv_heads = args.kv_heads or (1 if tiny else 8)
    if heads % kv_heads:
        raise PagedError(
            f"--heads {heads} is not a multiple of --kv-heads {kv_heads}; accepted: heads = group_size * kv_heads"
        )
    return Config(
        device=device,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=args.head_dim or (64 if tiny else 128),
        block_size=args.block_size,
        dtype=DTYPES[args.dtype],
        cases=cases,
        sweep_lens=sweep_lens,
        sweep_batches=batches,
        tiny=tiny,
        quick=quick,
        warmup_ms=args.warmup if args.warmup is not None else (10 if quick else 25),
        rep_ms=args.rep if args.rep is not None else (40 if quick else 100),
        cuda_graph=bool(getattr(args, "cuda_graph", True)) and cuda,
        seed=args.seed,
        # Random blocks spread over at least this much memory (well past H200's 50 MB of L2).
        min_pool_bytes=0 if tiny else 256 * 1024 * 1024,
        head_dim_v=getattr(args, "head_dim_v", None),
    )
