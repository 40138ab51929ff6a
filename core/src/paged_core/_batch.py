"""``BatchMeta``: one flattened batch of requests in any mix of states.

Every request in a step contributes ``query_len`` new tokens (rows of ``q``) and has ``seq_len``
tokens of context once they are appended::

    request r:  |<------------------ seq_len ------------------>|
                |<------- context_len ------->|<-- query_len -->|
                [ K/V already in the cache ... | new tokens      ]
                                               ^ query i sits at position context_len + i

so query ``i`` sees keys ``0 .. context_len + i`` (causal) and, with a sliding window ``w > 0``,
only keys ``> context_len + i - w``. One rule covers a prefill chunk (``context_len > 0``), a whole
prompt (``context_len == 0``), a decode token (``query_len == 1``) and a speculative verification
block (``query_len == k + 1``). A request with ``seq_len == 0`` is padding (as in a batch padded for
a CUDA graph): its rows produce exact zeros and its ``slot_mapping`` entries are ``-1``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch

from ._errors import BatchMetaError, InputError
from ._spec import INT32_LIMIT, check_device

__all__ = ["BatchMeta", "BlockAllocator"]

_GENERATIONS = itertools.count(1)  # BatchMeta._generation


class BlockAllocator:
    """Hands out physical KV blocks of a pool of ``num_blocks``.

    With ``shuffle=True`` the blocks come in a random order, so a request's blocks are not
    contiguous, as in a long-running engine; block 0 is reserved by default (vLLM keeps it as the
    null block), which catches kernels that read block 0 when they should not.

    >>> alloc = BlockAllocator(8, shuffle=False)
    >>> alloc.allocate(3)
    [1, 2, 3]
    """

    def __init__(self, num_blocks: int, *, shuffle: bool = True, seed: int = 0, reserve_zero: bool = True) -> None:
        if not _is_int(num_blocks) or not 1 <= num_blocks < INT32_LIMIT:
            raise InputError(f"num_blocks is {num_blocks!r}; accepted: an int from 1 to 2**31 - 1")
        self.num_blocks = num_blocks
        free = list(range(1 if reserve_zero and num_blocks > 1 else 0, num_blocks))
        if shuffle:
            g = torch.Generator().manual_seed(seed)
            free = [free[i] for i in torch.randperm(len(free), generator=g).tolist()]
        self._free = free
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, taken from the pool until :meth:`free` gives them back."""
        if not _is_int(n) or n < 0:
            raise InputError(f"allocate({n!r}): accepted: a number of blocks, an int >= 0")
        if n > len(self._free):
            raise BatchMetaError(
                f"out of KV blocks: asked for {n}, {len(self._free)} free of {self.num_blocks}; allocate a larger cache"
            )
        out, self._free = self._free[:n], self._free[n:]
        self._used.update(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Give back blocks that :meth:`allocate` handed out (each once); checked before any is freed."""
        if not isinstance(blocks, (list, tuple, range)):
            raise InputError(f"free(): blocks is {type(blocks).__name__} {blocks!r:.60}; accepted: a list of block ids")
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            if not _is_int(b) or b not in self._used or b in seen:
                why = (
                    "it is not an int"
                    if not _is_int(b)
                    else "it is given twice"
                    if b in seen
                    else f"it is outside the pool 0 .. {self.num_blocks - 1}"
                    if not 0 <= b < self.num_blocks
                    else "it is not allocated (freed already, or never handed out)"
                )
                raise InputError(
                    f"free(): block {b!r} cannot be freed: {why}; accepted: blocks this allocator "
                    "handed out, each freed once"
                )
            seen.add(b)
        ids = [int(b) for b in blocks]  # numpy ints come back as the Python ints allocate() hands out
        self._used.difference_update(ids)
        self._free.extend(ids)


def _is_int(v: object) -> bool:
    # bool is an int to Python, never a length or an id here.
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_block_size(block_size: Any) -> None:
    """Tokens per block: what every builder, ``check_structure`` and ``shared_prefix_blocks`` accept."""
    if not _is_int(block_size) or not 1 <= block_size < INT32_LIMIT:
        raise BatchMetaError(f"block_size is {block_size!r}; accepted: a positive int below 2**31")


def _check_lengths(query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int) -> None:
    """The per-request list checks shared by the builders."""
    _check_block_size(block_size)
    for name, lst in (("query_lens", query_lens), ("seq_lens", seq_lens)):
        if not isinstance(lst, Sequence) or isinstance(lst, str):
            raise BatchMetaError(f"{name} is a {type(lst).__name__}; accepted: a list of ints, one per request")
    if len(query_lens) != len(seq_lens):
        raise BatchMetaError(
            f"query_lens has {len(query_lens)} entries but seq_lens has {len(seq_lens)}; give one of each per request"
        )
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if not _is_int(q) or not _is_int(s):
            raise BatchMetaError(f"request {r}: query_len {q!r} and seq_len {s!r}; accepted: ints")
        if q < 0 or s < 0:
            raise BatchMetaError(f"request {r}: query_len {q} and seq_len {s}; accepted: ints >= 0")
        if s >= INT32_LIMIT:
            raise BatchMetaError(f"request {r}: seq_len {s} does not fit the int32 seq_lens; accepted: below 2**31")
        if s and q > s:
            raise BatchMetaError(
                f"request {r}: query_len {q} is larger than seq_len {s}; the new tokens are "
                "part of the context, so accepted: query_len <= seq_len (or seq_len 0 for padding)"
            )
    total = sum(query_lens)
    if total >= INT32_LIMIT:
        raise BatchMetaError(
            f"the batch has {total} query tokens, past the int32 query_start_loc; accepted: fewer "
            "than 2**31 (split the step)"
        )


@dataclasses.dataclass
class BatchMeta:
    """Metadata of one flattened batch; built once per step and shared by every layer.

    Build it from per-request lists with :meth:`build`, or fill the fields from an engine's own
    tensors and call :meth:`validate` while debugging.
    """

    #: R, the number of requests (padding requests included).
    num_reqs: int
    #: int32 [num_reqs + 1]: request r's new tokens are rows ``query_start_loc[r]:query_start_loc[r+1]`` of q.
    query_start_loc: torch.Tensor
    #: int32 [num_reqs]: tokens of context after this step, new tokens included; 0 = padding request.
    seq_lens: torch.Tensor
    #: int32 [num_reqs, max_blocks_per_req]: physical block of each logical block of each request.
    block_table: torch.Tensor
    #: int64 [num_tokens]: flat slot ``block * block_size + offset`` where each new token's K/V is
    #: written; -1 = not written.
    slot_mapping: torch.Tensor
    #: Tokens per KV block; the slot arithmetic of ``slot_mapping`` and ``block_table`` uses it.
    block_size: int
    #: Host int: the largest query_len (or an upper bound), for sizing grids without a device sync.
    max_query_len: int
    #: Host int: the largest seq_len (or an upper bound).
    max_seq_len: int
    #: int32 [num_reqs + 1] on the CPU, or None: a host mirror for backends that plan on the host.
    query_start_loc_cpu: torch.Tensor | None = None
    #: int32 [num_reqs] on the CPU, or None: a host mirror for backends that plan on the host.
    seq_lens_cpu: torch.Tensor | None = None
    # The fields check_structure() last accepted: every layer of a step shares one BatchMeta.
    _checked: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # A number no other check of any object had: callers cache what they checked against this
    # object under it (Backend.forward), and a re-check gives a new one. 0: never checked.
    _generation: int = dataclasses.field(default=0, init=False, repr=False, compare=False)
    # Whether the checked fields are laid out as the kernels read them (``contiguous()``).
    _dense: bool = dataclasses.field(default=True, init=False, repr=False, compare=False)

    # ----------------------------------------------------------------------------- derived
    @property
    def num_tokens(self) -> int:
        """N, the number of query rows (the first dim of ``q`` and ``slot_mapping``)."""
        return int(self.slot_mapping.shape[0])

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def decode_only(self) -> bool:
        """True when every request has at most one new token (``max_query_len <= 1``)."""
        return self.max_query_len <= 1

    @property
    def query_lens(self) -> torch.Tensor:
        """int32 [num_reqs]: new tokens per request (on the device of the batch)."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        """int32 [num_reqs]: tokens already cached before this step."""
        return self.seq_lens - self.query_lens

    def host(self) -> tuple[list[int], list[int]]:
        """(query_lens, seq_lens) as Python lists, from the host mirrors when present.

        Without mirrors this copies from the device (a sync): fine for references and planning
        tests, never called on the per-layer path of a fast backend.
        """
        qsl = self.query_start_loc_cpu if self.query_start_loc_cpu is not None else self.query_start_loc
        sl = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens
        qsl_l = qsl.tolist()
        return [b - a for a, b in zip(qsl_l[:-1], qsl_l[1:], strict=True)], sl.tolist()

    def to(self, device: torch.device | str) -> BatchMeta:
        """The same batch with its device tensors on ``device`` (host mirrors stay on the CPU)."""
        device = check_device(device)
        self.check_structure()
        return dataclasses.replace(
            self,
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_table=self.block_table.to(device),
            slot_mapping=self.slot_mapping.to(device),
        )

    def select(self, reqs: Sequence[int]) -> BatchMeta:
        """A batch of only the requests ``reqs`` (in that order), sharing the same cache blocks.

        Used to check batch invariance: a request's output alone must equal its output in the batch.
        """
        self.check_structure()
        if not isinstance(reqs, Sequence) or isinstance(reqs, str):
            raise InputError(f"select() got a {type(reqs).__name__}; accepted: a list of request indices")
        for r in reqs:
            if not _is_int(r) or not 0 <= r < self.num_reqs:
                raise InputError(
                    f"select(): request {r!r} is not in the batch; accepted: request indices "
                    f"0 .. {self.num_reqs - 1} (ints)"
                )
        qlens, slens = self.host()
        qsl = self.query_start_loc.tolist()
        rows = [i for r in reqs for i in range(qsl[r], qsl[r + 1])]
        idx = torch.tensor(list(reqs), dtype=torch.long, device=self.device)
        return BatchMeta.from_tensors(
            query_lens=[qlens[r] for r in reqs],
            seq_lens=[slens[r] for r in reqs],
            block_table=self.block_table.index_select(0, idx),
            slot_mapping=self.slot_mapping[torch.tensor(rows, dtype=torch.long, device=self.device)],
            block_size=self.block_size,
        )

    def copy_(self, src: BatchMeta) -> BatchMeta:
        """Make this batch ``src``, in place: every tensor keeps its storage, so a plan made from
        this batch, or a CUDA graph captured with it, reads ``src``'s metadata. Returns self.

        The per-step call of an engine that replays captured decode steps: keep one static batch
        of the captured size, pad each step's batch to it (padding requests: ``seq_len`` 0) and
        ``static.copy_(step)``. Needs the same ``num_reqs``, ``num_tokens`` and ``block_size``,
        and a block table at least as wide as ``src``'s (the extra columns become -1: keys past
        a request's ``seq_len`` are never read). Host ints and host mirrors are copied too, so
        an eager call sees ``src`` whole; a replayed graph keeps the launch decisions its capture
        made from them (docs/cuda-graphs.md).

        >>> static = BatchMeta.build([1, 1], [5, 9], block_size=4, table_width=4)
        >>> _ = static.copy_(BatchMeta.build([1, 1], [13, 2], block_size=4))
        >>> static.seq_lens.tolist(), static.max_seq_len, static.block_table.shape[1]
        ([13, 2], 13, 4)
        """
        if not isinstance(src, BatchMeta):
            raise BatchMetaError(f"copy_ takes a BatchMeta; got a {type(src).__name__}")
        src.check_structure()
        self.check_structure()
        mismatch = [
            f"{name} {getattr(src, name)} (this batch: {getattr(self, name)})"
            for name in ("num_reqs", "num_tokens", "block_size")
            if getattr(src, name) != getattr(self, name)
        ]
        width, src_width = self.block_table.shape[1], src.block_table.shape[1]
        if src_width > width:
            mismatch.append(f"a block table {src_width} blocks wide (this batch's: {width})")
        if mismatch:
            raise BatchMetaError(
                "copy_ keeps every tensor's storage, so the batches must have the same shape; the "
                f"source has {', '.join(mismatch)}. Pad the source to this batch's requests and "
                "tokens (padding requests have seq_len 0), or build a new BatchMeta"
            )
        # Asynchronous only between tensors of one device (stream-ordered); from the host it
        # waits, so the caller may reuse ``src`` at once.
        same = src.device == self.device
        self.query_start_loc.copy_(src.query_start_loc, non_blocking=same)
        self.seq_lens.copy_(src.seq_lens, non_blocking=same)
        self.slot_mapping.copy_(src.slot_mapping, non_blocking=same)
        self.block_table[:, :src_width].copy_(src.block_table, non_blocking=same)
        if src_width < width:
            self.block_table[:, src_width:].fill_(-1)
        self.max_query_len, self.max_seq_len = src.max_query_len, src.max_seq_len
        for name in ("query_start_loc_cpu", "seq_lens_cpu"):
            mine, theirs = getattr(self, name), getattr(src, name)
            if mine is not None and theirs is not None:
                mine.copy_(theirs)
            else:
                setattr(self, name, None if theirs is None else theirs.clone())
        self._checked = None  # the mirrors changed in place: check the host ints against them again
        return self

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        *,
        block_size: int,
        allocator: BlockAllocator | None = None,
        num_blocks: int | None = None,
        device: torch.device | str = "cpu",
        table_width: int | None = None,
        seed: int = 0,
    ) -> BatchMeta:
        """Build a batch from per-request lists, allocating each request's blocks.

        ``seq_lens[r] == 0`` makes request r padding (its ``query_lens[r]`` rows are not written
        and produce zeros). Blocks come from ``allocator`` or, if None, from a shuffled pool of
        ``num_blocks`` (default: just enough, plus the reserved block 0).

        >>> meta = BatchMeta.build([3, 1], [10, 70], block_size=16)
        >>> meta.num_reqs, meta.num_tokens, meta.max_seq_len, meta.decode_only
        (2, 4, 70, False)
        """
        _check_lengths(query_lens, seq_lens, block_size)
        device = check_device(device)
        nblocks = [math.ceil(s / block_size) for s in seq_lens]
        if allocator is not None and not callable(getattr(allocator, "allocate", None)):
            raise BatchMetaError(
                f"allocator is a {type(allocator).__name__}; accepted: None or an object with "
                "allocate(n) -> list of block ids, such as a BlockAllocator"
            )
        if num_blocks is not None and (not _is_int(num_blocks) or num_blocks < 1):
            raise BatchMetaError(f"num_blocks is {num_blocks!r}; accepted: None or a positive int")
        if allocator is None:
            allocator = BlockAllocator(num_blocks or sum(nblocks) + 1, seed=seed)
        # A refused build leaves the pool as it was: a BlockAllocator is restored (order included),
        # another allocator gets the earlier requests' blocks back through its free(), if it has one.
        saved = (list(allocator._free), set(allocator._used)) if isinstance(allocator, BlockAllocator) else None
        tables: list = []
        try:
            for n in nblocks:
                tables.append(allocator.allocate(n))
        except Exception:
            if saved is not None:
                allocator._free, allocator._used = saved
            elif callable(getattr(allocator, "free", None)) and tables:
                try:
                    allocator.free([b for t in tables for b in t])
                except Exception:  # the allocation's error is the one to report
                    pass
            raise
        return cls.from_lists(
            query_lens, seq_lens, tables, block_size=block_size, device=device, table_width=table_width
        )

    @classmethod
    def from_lists(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        *,
        block_size: int,
        device: torch.device | str = "cpu",
        table_width: int | None = None,
    ) -> BatchMeta:
        """Build a batch from per-request lists and explicit per-request block lists."""
        _check_lengths(query_lens, seq_lens, block_size)
        device = check_device(device)
        if table_width is not None and (not _is_int(table_width) or table_width < 0):
            raise BatchMetaError(f"table_width is {table_width!r}; accepted: None or an int >= 0")
        if not isinstance(block_tables, Sequence) or len(block_tables) != len(seq_lens):
            found = len(block_tables) if isinstance(block_tables, Sequence) else "no"
            raise BatchMetaError(
                f"block_tables has {found} entries but seq_lens has {len(seq_lens)}; give one block list per request"
            )
        for r, (s, t) in enumerate(zip(seq_lens, block_tables, strict=True)):
            bad = [b for b in t if not _is_int(b) or not 0 <= b < INT32_LIMIT]
            if bad:
                raise BatchMetaError(
                    f"request {r}: block {bad[0]!r} in its block list; accepted: block ids, ints from 0 to 2**31 - 1"
                )
            if s and math.ceil(s / block_size) > len(t):
                raise BatchMetaError(
                    f"request {r}: seq_len {s} needs {math.ceil(s / block_size)} blocks of {block_size} "
                    f"but its block list has {len(t)}; accepted: ceil(seq_len / block_size) blocks"
                )
        width = max([len(t) for t in block_tables] + [table_width or 1])
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for r, t in enumerate(block_tables):
            if t:
                table[r, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
        slots = []
        for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            for i in range(q):
                if s == 0:
                    slots.append(-1)
                    continue
                pos = s - q + i
                slots.append(block_tables[r][pos // block_size] * block_size + pos % block_size)
        return cls.from_tensors(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=block_size,
            device=device,
        )

    @classmethod
    def from_tensors(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        device: torch.device | str | None = None,
    ) -> BatchMeta:
        _check_lengths(query_lens, seq_lens, block_size)
        for name, t, dims in (("block_table", block_table, 2), ("slot_mapping", slot_mapping, 1)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dim() != dims
                or t.is_floating_point()
                or t.is_complex()
                or t.dtype == torch.bool
            ):
                found = (
                    f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
                    if isinstance(t, torch.Tensor)
                    else f"a {type(t).__name__}"
                )
                raise BatchMetaError(f"{name} is {found}; accepted: an integer tensor of {dims} dimensions")
        device = check_device(device) if device is not None else block_table.device
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        sl_cpu = torch.tensor(list(seq_lens), dtype=torch.int32)
        return cls(
            num_reqs=len(seq_lens),
            query_start_loc=qsl_cpu.to(device),
            seq_lens=sl_cpu.to(device),
            block_table=block_table.to(device=device, dtype=torch.int32),
            slot_mapping=slot_mapping.to(device=device, dtype=torch.int64),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=sl_cpu,
        )

    # ----------------------------------------------------------------------------- validate
    def check_structure(self) -> BatchMeta:
        """The host-only part of :meth:`validate`: types, dtypes, shapes, devices, host ints.

        Reads no device value, so it costs microseconds and never syncs; ``Backend.forward`` runs
        it on every call, validation on or off, so a malformed batch is a :class:`BatchMetaError`
        rather than an error from deep inside a kernel launcher. Where the host mirrors exist,
        ``max_query_len`` and ``max_seq_len`` are checked against them (host memory, no sync).
        The result is cached per object: the fields are compared by identity, so assigning any
        field makes the next call check again (in-place edits of a tensor are not seen).
        """
        return self._structure(mirrors=True)

    def _structure(self, *, mirrors: bool) -> BatchMeta:
        fields = (
            self.num_reqs,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.slot_mapping,
            self.block_size,
            self.max_query_len,
            self.max_seq_len,
            self.query_start_loc_cpu,
            self.seq_lens_cpu,
        )
        last = self._checked
        if last is not None and all(map(operator.is_, fields, last)):  # same objects: checked
            return self
        R = self.num_reqs
        if not _is_int(R) or not 0 <= R < INT32_LIMIT:
            raise BatchMetaError(f"num_reqs is {R!r}; accepted: an int from 0 to 2**31 - 1")
        self._check_tensor("query_start_loc", self.query_start_loc, torch.int32, (R + 1,))
        self._check_tensor("seq_lens", self.seq_lens, torch.int32, (R,))
        if not isinstance(self.slot_mapping, torch.Tensor) or self.slot_mapping.dim() == 0:
            found = (
                self._desc(self.slot_mapping)
                if isinstance(self.slot_mapping, torch.Tensor)
                else f"a {type(self.slot_mapping).__name__}"
            )
            raise BatchMetaError(f"slot_mapping is {found}; accepted: int64 [num_tokens]")
        self._check_tensor("slot_mapping", self.slot_mapping, torch.int64, (self.num_tokens,))
        if (
            not isinstance(self.block_table, torch.Tensor)
            or self.block_table.dtype != torch.int32
            or self.block_table.dim() != 2
            or self.block_table.shape[0] != R
        ):
            found = (
                self._desc(self.block_table)
                if isinstance(self.block_table, torch.Tensor)
                else f"a {type(self.block_table).__name__}"
            )
            raise BatchMetaError(f"block_table is {found}; accepted: int32 [num_reqs={R}, max_blocks_per_req]")
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            t = getattr(self, name)
            if t.device != self.device:
                raise BatchMetaError(
                    f"{name} is on {t.device} but seq_lens is on {self.device}; every BatchMeta "
                    "tensor must be on the device of q"
                )
        _check_block_size(self.block_size)
        for name in ("max_query_len", "max_seq_len"):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= v < INT32_LIMIT:
                raise BatchMetaError(
                    f"{name} is {v!r}; accepted: a host int from 0 to 2**31 - 1 (not a device "
                    "tensor: reading one syncs)"
                )
        if self.max_query_len * R < self.num_tokens:
            # Pigeonhole: R requests of at most max_query_len rows cannot hold num_tokens rows.
            raise BatchMetaError(
                f"max_query_len is {self.max_query_len} but {R} requests share {self.num_tokens} "
                f"query tokens, so some request has at least {-(-self.num_tokens // max(R, 1))}; "
                "accepted: the largest query_len or an upper bound"
            )
        for name, shape in (("query_start_loc_cpu", (R + 1,)), ("seq_lens_cpu", (R,))):
            mirror = getattr(self, name)
            if mirror is not None:
                self._check_tensor(name, mirror, torch.int32, shape)
                if mirror.device.type != "cpu":
                    raise BatchMetaError(f"{name} is on {mirror.device}; accepted: a host mirror on the CPU (or None)")
        if not mirrors:
            return self  # validate() words these checks itself, per request
        # The host ints are promises the kernels size their grids by; the mirrors (host memory,
        # no sync) let a lie be caught on every call, once per BatchMeta.
        if R and self.seq_lens_cpu is not None:
            top = int(self.seq_lens_cpu.max())
            if top > self.max_seq_len:
                raise BatchMetaError(
                    f"max_seq_len is {self.max_seq_len} but seq_lens_cpu reaches {top}; accepted: "
                    "the largest seq_len or an upper bound"
                )
        if R and self.query_start_loc_cpu is not None:
            top = int((self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]).max())
            if top > self.max_query_len:
                raise BatchMetaError(
                    f"max_query_len is {self.max_query_len} but query_start_loc_cpu has a request "
                    f"of {top} tokens; accepted: the largest query_len or an upper bound"
                )
        self._dense = _is_dense(self)
        # The very objects checked (held, so an identity is never reused): assigning any field
        # a new tensor or host int makes the next call check again.
        self._checked = fields
        self._generation = next(_GENERATIONS)
        return self

    def contiguous(self) -> BatchMeta:
        """This batch with its metadata laid out as every kernel reads it: ``self`` when it is
        already, else a checked copy whose 1-D tensors (host mirrors included) are contiguous and
        whose block table has a contiguous last dimension (any row stride).

        Engines often slice persistent buffers (``seq_lens_buf[:n]``, every other element of a
        buffer); ``Backend.plan`` and ``Backend.forward`` call this, so such views cost one copy
        per field when planned (once per step) or, without a plan, per call, and a batch that is
        contiguous costs nothing. The copy is the batch of that moment: a plan made from a
        strided batch does not see later in-place edits of it (plan again, as after ``copy_``).

        >>> meta = BatchMeta.build([1, 1], [5, 9], block_size=4)
        >>> meta.contiguous() is meta
        True
        """
        self.check_structure()
        if self._dense:
            return self
        bt = self.block_table
        return BatchMeta(
            num_reqs=self.num_reqs,
            query_start_loc=self.query_start_loc.contiguous(),
            seq_lens=self.seq_lens.contiguous(),
            block_table=bt if _last_dim_dense(bt) else bt.contiguous(),
            slot_mapping=self.slot_mapping.contiguous(),
            block_size=self.block_size,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=None if self.query_start_loc_cpu is None else self.query_start_loc_cpu.contiguous(),
            seq_lens_cpu=None if self.seq_lens_cpu is None else self.seq_lens_cpu.contiguous(),
        ).check_structure()

    def validate(self, *, num_blocks: int | None = None) -> BatchMeta:
        """Check every invariant; raise :class:`BatchMetaError` naming request, field and values.

        Copies the metadata to the host (a sync): call it while debugging or behind
        ``PAGED_VALIDATE=1``, not on the hot path. ``num_blocks`` (the cache's) enables the check
        that every block id a request uses exists. Returns ``self`` so it chains.

        The checks run as vector ops over the host copy; only the first offending request is
        then walked in Python to word the message (docs/reliability.md has the cost).
        """
        self._structure(mirrors=False)
        if num_blocks is not None and (not _is_int(num_blocks) or num_blocks < 1):
            raise BatchMetaError(f"num_blocks is {num_blocks!r}; accepted: None or the cache's block count")
        R, N, bs = self.num_reqs, self.num_tokens, self.block_size
        width = self.block_table.shape[1]
        # One device-to-host copy (one sync) of every field, split on the host.
        flat = torch.cat(
            [self.query_start_loc.long(), self.seq_lens.long(), self.block_table.long().flatten(), self.slot_mapping]
        ).cpu()
        qsl_t, sl_t, table, slots = flat.split([R + 1, R, R * width, N])
        table = table.view(R, width)
        qsl = qsl_t.tolist()
        sl = sl_t.tolist()
        if qsl[0] != 0:
            raise BatchMetaError(f"query_start_loc[0] is {qsl[0]}; accepted: 0")
        if qsl[-1] != N:
            raise BatchMetaError(
                f"query_start_loc[{R}] is {qsl[-1]} but slot_mapping has {N} rows; "
                "accepted: the last offset equals the number of query tokens"
            )
        for mirror, dev, name in (
            (self.query_start_loc_cpu, qsl, "query_start_loc_cpu"),
            (self.seq_lens_cpu, sl, "seq_lens_cpu"),
        ):
            if mirror is not None and mirror.tolist() != dev:
                raise BatchMetaError(
                    f"{name} is {mirror.tolist()} but {name.removesuffix('_cpu')} is {dev}; accepted: "
                    "a host mirror equal to its device tensor (rebuild the host mirror)"
                )
        qlen = qsl_t[1:] - qsl_t[:-1]
        nblk = torch.div(sl_t + bs - 1, bs, rounding_mode="floor")  # ceil for s >= 0
        bad = (qlen < 0) | (sl_t < 0) | ((sl_t > 0) & (qlen > sl_t)) | (nblk > width) | (qsl_t[1:] > N)
        if num_blocks is not None and width:
            used = torch.arange(width)[None, :] < nblk[:, None]
            bad |= (used & ((table < 0) | (table >= num_blocks))).any(dim=1)
        first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else R
        # Requests before `first` pass the checks above, so their rows are a well-formed prefix
        # 0 .. qsl[first] of slot_mapping and their positions index inside the table.
        rows_end = qsl[first]
        if rows_end > 0:
            req = torch.repeat_interleave(torch.arange(first), qlen[:first])  # [rows_end]
            s_row, q_row = sl_t[req], qlen[req]
            pos = s_row - q_row + (torch.arange(rows_end) - qsl_t[req])
            if width:
                blk = table[req, (pos // bs).clamp(0, width - 1)]
                want = torch.where(s_row == 0, -1, blk * bs + pos % bs)
            else:
                want = torch.full((rows_end,), -1, dtype=torch.long)
            # -1 (not written) is accepted on any row: a context-parallel rank that does not own
            # a request's last block attends to its share but stores no new K/V.
            wrong = ((slots[:rows_end] != want) & (slots[:rows_end] != -1)).nonzero()
            if wrong.numel():
                first = int(req[int(wrong[0, 0])])
        if first < R:
            self._raise_for_request(first, qsl, sl, table[first].tolist(), slots, num_blocks)
        max_q = int(qlen.max()) if R else 0
        if self.max_query_len < max_q:
            raise BatchMetaError(
                f"max_query_len is {self.max_query_len} but request lengths reach {max_q}; "
                "accepted: the maximum or an upper bound"
            )
        if self.max_seq_len < max(sl, default=0):
            raise BatchMetaError(
                f"max_seq_len is {self.max_seq_len} but seq_lens reach {max(sl)}; "
                "accepted: the maximum or an upper bound"
            )
        return self

    def _raise_for_request(
        self,
        r: int,
        qsl: list[int],
        sl: list[int],
        row: list[int],
        slots: torch.Tensor,
        num_blocks: int | None,
    ) -> None:
        """Word the error of request ``r``, which the vector checks found to break an invariant."""
        N, bs, width = self.num_tokens, self.block_size, len(row)
        q, s = qsl[r + 1] - qsl[r], sl[r]
        if q < 0:
            raise BatchMetaError(
                f"request {r}: query_start_loc decreases ({qsl[r]} -> {qsl[r + 1]}); accepted: non-decreasing offsets"
            )
        if s < 0:
            raise BatchMetaError(f"request {r}: seq_lens[{r}] is {s}; accepted: >= 0")
        if s and q > s:
            raise BatchMetaError(
                f"request {r}: query_len {q} is larger than seq_lens[{r}] = {s}; accepted: "
                "query_len <= seq_len (the new tokens are part of the context), or seq_len 0 for padding"
            )
        if qsl[r + 1] > N:
            raise BatchMetaError(
                f"request {r}: query_start_loc[{r + 1}] is {qsl[r + 1]}, past the {N} rows of "
                "slot_mapping; accepted: non-decreasing offsets ending at the number of query tokens"
            )
        nblk = math.ceil(s / bs)
        if nblk > width:
            raise BatchMetaError(
                f"request {r}: seq_lens[{r}] = {s} needs {nblk} blocks of {bs} but block_table "
                f"has {width} columns; accepted: a table at least ceil(max_seq_len / block_size) wide"
            )
        if num_blocks is not None:
            for j in range(nblk):
                b = row[j]
                if not 0 <= b < num_blocks:
                    raise BatchMetaError(
                        f"request {r}: block_table[{r}, {j}] = {b} is outside the cache; "
                        f"accepted: block ids 0 .. {num_blocks - 1}"
                    )
        for i in range(q):
            rw = qsl[r] + i
            if s == 0:
                want = -1
            else:
                pos = s - q + i
                want = row[pos // bs] * bs + pos % bs
            got = int(slots[rw])
            if got != want and got != -1:
                raise BatchMetaError(
                    f"request {r}: slot_mapping[{rw}] is {got} but the block table puts "
                    f"its token (position {s - q + i if s else 'padding'}) at slot {want}; "
                    "accepted: block_table[r, pos // block_size] * block_size + pos % block_size, "
                    "or -1 for padding requests (and for a token this batch does not write)"
                )
        raise BatchMetaError(f"request {r} breaks an invariant of BatchMeta")  # pragma: no cover

    @staticmethod
    def _desc(t: torch.Tensor) -> str:
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"

    def _check_tensor(self, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
        if not isinstance(t, torch.Tensor):
            raise BatchMetaError(f"{name} is a {type(t).__name__}; accepted: a torch.Tensor")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise BatchMetaError(
                f"{name} is {self._desc(t)}; accepted: {str(dtype).removeprefix('torch.')} {list(shape)}"
            )


def _last_dim_dense(t: torch.Tensor) -> bool:
    # A stride of a size-1 dimension means nothing: torch.empty(1, 1).expand(3, 1) is as good.
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def _is_dense(meta: BatchMeta) -> bool:
    """Whether every metadata tensor is laid out as the kernels read it: 1-D tensors contiguous
    (kernels index them with the request), the block table's last dimension contiguous (the
    kernels take its row stride; vendors' tables need unit column strides)."""
    return (
        meta.query_start_loc.is_contiguous()
        and meta.seq_lens.is_contiguous()
        and meta.slot_mapping.is_contiguous()
        and _last_dim_dense(meta.block_table)
        and (meta.query_start_loc_cpu is None or meta.query_start_loc_cpu.is_contiguous())
        and (meta.seq_lens_cpu is None or meta.seq_lens_cpu.is_contiguous())
    )


def shared_prefix_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """Leading logical blocks that every request of a batch shares (the same physical ids): what
    cascade attention reads once for the whole batch.

    SYNCS with the device (reads block_table and seq_lens): call it off the hot path, e.g.
    once per scheduler step, never inside a CUDA graph.

    Counts the blocks whose physical id in the first request with ``seq_len > 0`` equals the id
    in every other such request (padding rows are ignored, whatever their table holds), capped
    by the shortest non-padding request's full blocks. Cascade kernels read the prefix through
    that first request's row.

    >>> import torch
    >>> bt = torch.tensor([[3, 4, 5], [3, 4, 9]], dtype=torch.int32)
    >>> shared_prefix_blocks(bt, torch.tensor([40, 48], dtype=torch.int32), 16)
    2
    """
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            found = f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else str(t.dtype).removeprefix("torch.")
            raise InputError(
                f"{name} is {found}; accepted: an integer tensor (a batch's meta.block_table and "
                "meta.seq_lens; torch.tensor(...) for lists)"
            )
    _check_block_size(block_size)
    if block_table.dim() != 2 or seq_lens.shape != (block_table.shape[0],):
        raise InputError(
            f"the shapes of block_table / seq_lens are {list(block_table.shape)} / {list(seq_lens.shape)}; "
            "accepted: [num_reqs, max_blocks] and [num_reqs] (a batch's block table and its seq_lens)"
        )
    bt = block_table.cpu()
    sl = seq_lens.cpu()
    if bt.shape[0] == 0 or not bool((sl > 0).any()):
        return 0
    active = sl > 0
    first = int(active.int().argmax())
    same = (bt[active] == bt[first : first + 1]).all(dim=0)  # [max_blocks]
    common = int(same.int().cumprod(0).sum())
    shortest_full = int(sl[sl > 0].min()) // block_size
    return min(common, shortest_full)
