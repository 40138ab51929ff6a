"""BatchMeta: the builders, the host mirrors, select(), and every invariant of validate()."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from paged_core import BatchMeta, BatchMetaError, BlockAllocator

# A small batch whose every field is worked out by hand below (block_size 4):
#   request 0: 3 new tokens, seq_len 6 -> positions 3, 4, 5 in blocks [5, 2]
#   request 1: decode, seq_len 9       -> position 8 in blocks [7, 1, 3]
#   request 2: whole prompt of 2       -> positions 0, 1 in block [4]
#   request 3: padding, 2 rows          -> slot -1
QLENS, SLENS, TABLES, BS = [3, 1, 2, 2], [6, 9, 2, 0], [[5, 2], [7, 1, 3], [4], []], 4
SLOTS = [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 3 * 4 + 0, 4 * 4 + 0, 4 * 4 + 1, -1, -1]


def small() -> BatchMeta:
    return BatchMeta.from_lists(QLENS, SLENS, TABLES, block_size=BS)


def slots_from_table(query_lens, seq_lens, table, block_size):
    """The slot of each new token, read off the block table (rule of positions)."""
    out = []
    for r, (t, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for i in range(t):
            if s == 0:
                out.append(-1)
            else:
                pos = s - t + i
                out.append(table[r][pos // block_size] * block_size + pos % block_size)
    return out


# ---------------------------------------------------------------------------------- builders
def test_from_lists_fields_by_hand():
    meta = small()
    assert meta.num_reqs == 4 and meta.num_tokens == 8 and meta.block_size == 4
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == [0, 3, 4, 6, 8]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == SLENS
    assert meta.block_table.dtype == torch.int32
    assert meta.block_table.tolist() == [[5, 2, 0], [7, 1, 3], [4, 0, 0], [0, 0, 0]]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == SLOTS
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)
    assert meta.query_lens.tolist() == QLENS
    assert meta.context_lens.tolist() == [3, 8, 0, -2]  # padding: seq_len 0 - 2 rows
    assert not meta.decode_only
    assert meta.validate(num_blocks=8) is meta


def test_from_lists_table_width():
    meta = BatchMeta.from_lists(QLENS, SLENS, TABLES, block_size=BS, table_width=6)
    assert meta.block_table.shape == (4, 6)
    assert meta.block_table[1].tolist() == [7, 1, 3, 0, 0, 0]
    meta.validate()


MIXED = ([5, 16, 1, 1, 3, 2, 1], [25, 16, 70, 33, 40, 0, 1])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_build_mixed_batch(block_size, seed):
    qlens, slens = MIXED
    meta = BatchMeta.build(qlens, slens, block_size=block_size, seed=seed)
    R = len(qlens)
    assert meta.num_reqs == R and meta.num_tokens == sum(qlens)
    expect_qsl = [0]
    for q in qlens:
        expect_qsl.append(expect_qsl[-1] + q)
    assert meta.query_start_loc.tolist() == expect_qsl
    assert meta.seq_lens.tolist() == slens
    assert (meta.max_query_len, meta.max_seq_len) == (16, 70)
    table = meta.block_table.tolist()
    used = []
    for r, s in enumerate(slens):
        n = math.ceil(s / block_size)
        assert len(table[r]) >= n
        used += table[r][:n]
    # Every request gets its own blocks; block 0 stays reserved; all inside the default pool.
    num_blocks = sum(math.ceil(s / block_size) for s in slens) + 1
    assert len(set(used)) == len(used)
    assert 0 not in used and all(0 < b < num_blocks for b in used)
    assert used != sorted(used), "a shuffled allocator hands out non-contiguous blocks"
    assert meta.slot_mapping.tolist() == slots_from_table(qlens, slens, table, block_size)
    # Host mirrors: on the CPU, int32, equal to the device tensors.
    assert meta.query_start_loc_cpu.device.type == "cpu" and meta.seq_lens_cpu.device.type == "cpu"
    assert meta.query_start_loc_cpu.dtype == torch.int32 and meta.seq_lens_cpu.dtype == torch.int32
    assert meta.query_start_loc_cpu.tolist() == expect_qsl and meta.seq_lens_cpu.tolist() == slens
    assert meta.host() == (qlens, slens)
    meta.validate(num_blocks=num_blocks)
    # Same seed, same blocks: batches are reproducible.
    again = BatchMeta.build(qlens, slens, block_size=block_size, seed=seed)
    assert torch.equal(again.block_table, meta.block_table)


def test_build_with_allocator_and_pool():
    alloc = BlockAllocator(64, shuffle=False)
    meta = BatchMeta.build([2, 1], [20, 9], block_size=8, allocator=alloc)
    assert meta.block_table.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert alloc.num_free == 64 - 1 - 5
    meta = BatchMeta.build([1], [5], block_size=8, num_blocks=100, seed=3)
    assert 1 <= meta.block_table[0, 0].item() < 100
    with pytest.raises(ValueError, match=r"out of KV blocks: asked for 3, 2 free of 3"):
        BatchMeta.build([1], [20], block_size=8, allocator=BlockAllocator(3))


def test_allocator():
    alloc = BlockAllocator(8, shuffle=False)
    assert alloc.allocate(3) == [1, 2, 3]
    alloc.free([2])
    assert alloc.num_free == 5
    assert sorted(alloc.allocate(5)) == [2, 4, 5, 6, 7]
    assert BlockAllocator(4, shuffle=False, reserve_zero=False).allocate(4) == [0, 1, 2, 3]
    shuffled = BlockAllocator(50, seed=1).allocate(49)
    assert sorted(shuffled) == list(range(1, 50)) and shuffled != sorted(shuffled)
    with pytest.raises(ValueError, match=r"num_blocks is 0; accepted: an int from 1"):
        BlockAllocator(0)


@pytest.mark.parametrize(
    ("qlens", "slens", "needles"),
    [
        ([1, 2], [5], ["query_lens has 2 entries but seq_lens has 1"]),
        ([1, 5], [4, 3], ["request 1", "query_len 5 is larger than seq_len 3", "query_len <= seq_len"]),
        ([1, -1], [4, 3], ["request 1", "query_len -1 and seq_len 3; accepted: ints >= 0"]),
        ([1, 1], [4, -3], ["request 1", "seq_len -3"]),
    ],
)
def test_build_rejects(qlens, slens, needles):
    with pytest.raises(BatchMetaError) as exc:
        BatchMeta.build(qlens, slens, block_size=16)
    for n in needles:
        assert n in str(exc.value)


def test_decode_only():
    assert BatchMeta.build([1, 1, 1], [5, 90, 1], block_size=16).decode_only
    assert BatchMeta.build([1, 0], [5, 7], block_size=16).decode_only
    assert not BatchMeta.build([1, 2], [5, 7], block_size=16).decode_only  # a verification block
    assert not BatchMeta.build([16], [16], block_size=16).decode_only


def test_empty_batch():
    meta = BatchMeta.build([], [], block_size=16)
    assert meta.num_reqs == 0 and meta.num_tokens == 0
    assert meta.query_start_loc.tolist() == [0]
    meta.validate(num_blocks=1)


def test_to_keeps_mirrors_on_host():
    meta = small().to("meta")
    assert meta.seq_lens.device.type == "meta" and meta.device.type == "meta"
    assert meta.slot_mapping.device.type == "meta" and meta.block_table.device.type == "meta"
    assert meta.seq_lens_cpu.device.type == "cpu"
    assert meta.host() == (QLENS, SLENS)  # from the mirrors: no device read needed


def test_select():
    qlens, slens = MIXED
    meta = BatchMeta.build(qlens, slens, block_size=8, seed=2)
    rows = []
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    picks = [3, 0, 5]
    for r in picks:
        rows += list(range(qsl[r], qsl[r + 1]))
    sub = meta.select(picks)
    assert sub.num_reqs == 3
    assert sub.query_start_loc.tolist() == [0, 1, 6, 8]
    assert sub.seq_lens.tolist() == [33, 25, 0]
    assert sub.block_table.tolist() == [meta.block_table[r].tolist() for r in picks]
    assert sub.slot_mapping.tolist() == [meta.slot_mapping[i].item() for i in rows]
    assert (sub.max_query_len, sub.max_seq_len) == (5, 33)
    assert sub.seq_lens_cpu.tolist() == [33, 25, 0]
    assert sub.block_size == 8
    sub.validate()


def test_copy_in_place_keeps_storage_and_takes_everything_else():
    static = BatchMeta.build([1, 1, 1], [5, 9, 0], block_size=4, table_width=6, seed=1)
    storage = [t.data_ptr() for t in (static.query_start_loc, static.seq_lens, static.block_table, static.slot_mapping)]
    step = BatchMeta.build([1, 1, 1], [13, 2, 7], block_size=4, seed=2)  # a table 4 blocks wide
    assert static.copy_(step) is static
    assert storage == [
        t.data_ptr() for t in (static.query_start_loc, static.seq_lens, static.block_table, static.slot_mapping)
    ]
    assert static.seq_lens.tolist() == [13, 2, 7] and static.slot_mapping.tolist() == step.slot_mapping.tolist()
    assert static.block_table[:, :4].tolist() == step.block_table.tolist()
    assert (static.block_table[:, 4:] == -1).all(), "columns past the source's table are no block"
    assert (static.max_query_len, static.max_seq_len) == (1, 13)
    assert static.host() == ([1, 1, 1], [13, 2, 7]), "host mirrors follow"
    static.validate(num_blocks=64)


def test_copy_in_place_from_another_device_and_without_mirrors():
    static = BatchMeta.build([2, 1], [6, 3], block_size=4).to("meta")
    step = dataclasses.replace(BatchMeta.build([2, 1], [8, 1], block_size=4), seq_lens_cpu=None)
    static.copy_(step)  # host -> "meta" device: shapes and host state only
    assert static.seq_lens_cpu is None and static.max_seq_len == 8
    back = BatchMeta.build([2, 1], [6, 3], block_size=4)
    back.copy_(step)
    assert back.seq_lens_cpu is None and back.seq_lens.tolist() == [8, 1]


@pytest.mark.parametrize(
    ("qlens", "slens", "block_size", "width", "needles"),
    [
        ([1, 1], [5, 9], 4, 8, ["num_reqs 2 (this batch: 3)", "num_tokens 2 (this batch: 3)"]),
        ([1, 1, 1], [5, 9, 3], 8, 8, ["block_size 8 (this batch: 4)"]),
        ([1, 1, 1], [5, 40, 3], 4, 10, ["10 blocks wide (this batch's: 8)"]),
        ([2, 1, 0], [5, 9, 3], 4, 8, []),  # same num_tokens, other split: fine
    ],
)
def test_copy_in_place_refuses_another_shape(qlens, slens, block_size, width, needles):
    static = BatchMeta.build([1, 1, 1], [5, 9, 0], block_size=4, table_width=8)
    step = BatchMeta.build(qlens, slens, block_size=block_size, table_width=width)
    if not needles:
        static.copy_(step)
        assert static.query_start_loc.tolist() == [0, 2, 3, 3]
        return
    with pytest.raises(BatchMetaError, match="same shape") as err:
        static.copy_(step)
    for needle in needles:
        assert needle in str(err.value)
    assert "Pad the source" in str(err.value)


def test_copy_in_place_is_what_a_plan_sees():
    """The reference's plan is the batch: a plan made before copy_ computes the new batch,
    which is what a CUDA graph captured with the static batch relies on."""
    from paged_core import registry

    backend = registry.get("reference")
    static = BatchMeta.build([1, 1], [20, 7], block_size=4, num_blocks=32, table_width=8, seed=3)
    cache = backend.allocate(32, 4, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    plan = backend.plan(static)
    step = BatchMeta.build([1, 1], [9, 26], block_size=4, num_blocks=32, seed=4)
    q = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(2))
    static.copy_(step)
    assert torch.equal(backend.forward(q, cache, plan), backend.forward(q, cache, backend.plan(step)))


# ---------------------------------------------------------------------------------- validate
def mutate(meta: BatchMeta, *, sync_mirrors: bool = True, **fields) -> BatchMeta:
    """``meta`` with ``fields`` replaced; the host mirrors follow the device tensors unless told."""
    new = dataclasses.replace(meta, **fields)
    if sync_mirrors:
        if "query_start_loc" in fields and isinstance(new.query_start_loc, torch.Tensor):
            new.query_start_loc_cpu = new.query_start_loc.to("cpu").clone()
        if "seq_lens" in fields and isinstance(new.seq_lens, torch.Tensor):
            new.seq_lens_cpu = new.seq_lens.to("cpu").clone()
    return new


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def with_table(**edits):
    table = small().block_table.clone()
    for key, b in edits.items():  # keys are "r,j" (** needs strings)
        r, j = map(int, key.split(","))
        table[r, j] = b
    return table


def with_slot(row, value):
    s = small().slot_mapping.clone()
    s[row] = value
    return s


# (id, fields to replace, validate kwargs, substrings the message must contain)
INVARIANTS = [
    (
        "query_start_loc-dtype",
        dict(query_start_loc=i32([0, 3, 4, 6, 8]).long()),
        {},
        ["query_start_loc is int64 [5]", "accepted: int32 [5]"],
    ),
    (
        "query_start_loc-shape",
        dict(query_start_loc=i32([0, 3, 4, 6])),
        {},
        ["query_start_loc is int32 [4]", "accepted: int32 [5]"],
    ),
    (
        "seq_lens-dtype",
        dict(seq_lens=torch.tensor(SLENS)),
        {},
        ["seq_lens is int64 [4]", "accepted: int32 [4]"],
    ),
    ("seq_lens-shape", dict(seq_lens=i32(SLENS + [3])), {}, ["seq_lens is int32 [5]", "accepted: int32 [4]"]),
    (
        "seq_lens-not-a-tensor",
        dict(seq_lens=list(SLENS)),
        {},
        ["seq_lens is a list", "accepted: a torch.Tensor"],
    ),
    (
        "slot_mapping-dtype",
        dict(slot_mapping=torch.tensor(SLOTS, dtype=torch.int32)),
        {},
        ["slot_mapping is int32 [8]", "accepted: int64 [8]"],
    ),
    (
        "slot_mapping-2d",
        dict(slot_mapping=torch.tensor(SLOTS)[:, None]),
        {},
        ["slot_mapping is int64 [8, 1]", "accepted: int64 [8]"],
    ),
    (
        "block_table-dtype",
        dict(block_table=small().block_table.long()),
        {},
        ["block_table is int64 [4, 3]", "accepted: int32 [num_reqs=4, max_blocks_per_req]"],
    ),
    (
        "block_table-rows",
        dict(block_table=small().block_table[:3]),
        {},
        ["block_table is int32 [3, 3]", "accepted: int32 [num_reqs=4, max_blocks_per_req]"],
    ),
    ("block_table-1d", dict(block_table=small().block_table[:, 0]), {}, ["block_table is int32 [4]"]),
    (
        "device",
        dict(block_table=small().block_table.to("meta")),
        {},
        ["block_table is on meta but seq_lens is on cpu", "device of q"],
    ),
    ("block_size", dict(block_size=0), {}, ["block_size is 0", "accepted: a positive int"]),
    (
        "query_start_loc-not-from-0",
        dict(query_start_loc=i32([1, 3, 4, 6, 8])),
        {},
        ["query_start_loc[0] is 1", "accepted: 0"],
    ),
    (
        "query_start_loc-last",
        dict(query_start_loc=i32([0, 3, 4, 6, 7])),
        {},
        [
            "query_start_loc[4] is 7",
            "slot_mapping has 8 rows",
            "the last offset equals the number of query tokens",
        ],
    ),
    (
        "query_start_loc-decreasing",
        dict(query_start_loc=i32([0, 3, 2, 6, 8])),
        {},
        ["request 1", "query_start_loc decreases (3 -> 2)", "accepted: non-decreasing"],
    ),
    (
        "query_len-over-seq_len",
        dict(seq_lens=i32([6, 9, 1, 0])),
        {},
        ["request 2", "query_len 2 is larger than seq_lens[2] = 1", "accepted: query_len <= seq_len"],
    ),
    (
        "negative-seq_len",
        dict(seq_lens=i32([6, -1, 2, 0])),
        {},
        ["request 1", "seq_lens[1] is -1", "accepted: >= 0"],
    ),
    (
        "table-too-narrow",
        dict(block_table=small().block_table[:, :2].contiguous()),
        {},
        [
            "request 1",
            "seq_lens[1] = 9 needs 3 blocks of 4",
            "block_table has 2 columns",
            "accepted: a table at least ceil(max_seq_len / block_size) wide",
        ],
    ),
    (
        "block-id-past-pool",
        dict(block_table=with_table(**{"1,1": 8})),
        dict(num_blocks=8),
        ["request 1", "block_table[1, 1] = 8 is outside the cache", "accepted: block ids 0 .. 7"],
    ),
    (
        "block-id-negative",
        dict(block_table=with_table(**{"2,0": -3})),
        dict(num_blocks=8),
        ["request 2", "block_table[2, 0] = -3 is outside the cache", "accepted: block ids 0 .. 7"],
    ),
    (
        "slot-inconsistent",
        dict(slot_mapping=with_slot(4, 18)),
        {},
        [
            "request 2",
            "slot_mapping[4] is 18",
            "(position 0) at slot 16",
            "accepted: block_table[r, pos // block_size] * block_size + pos % block_size",
        ],
    ),
    (
        "slot-padding-not-minus-1",
        dict(slot_mapping=with_slot(7, 0)),
        {},
        ["request 3", "slot_mapping[7] is 0", "(position padding) at slot -1", "or -1 for padding requests"],
    ),
    (
        "max_query_len",
        dict(max_query_len=2),
        {},
        ["max_query_len is 2 but request lengths reach 3", "accepted: the maximum or an upper bound"],
    ),
    (
        "max_seq_len",
        dict(max_seq_len=8),
        {},
        ["max_seq_len is 8 but seq_lens reach 9", "accepted: the maximum or an upper bound"],
    ),
    (
        "seq_lens_cpu-out-of-sync",
        dict(seq_lens_cpu=i32([6, 9, 3, 0])),
        {},
        ["seq_lens_cpu", "[6, 9, 3, 0]", "[6, 9, 2, 0]", "rebuild the host mirror"],
    ),
    (
        "query_start_loc_cpu-out-of-sync",
        dict(query_start_loc_cpu=i32([0, 3, 4, 6, 9])),
        {},
        ["query_start_loc_cpu", "[0, 3, 4, 6, 9]", "[0, 3, 4, 6, 8]", "rebuild the host mirror"],
    ),
]


@pytest.mark.parametrize(("fields", "kwargs", "needles"), [c[1:] for c in INVARIANTS], ids=[c[0] for c in INVARIANTS])
def test_validate_invariant(fields, kwargs, needles):
    meta = mutate(small(), **fields)
    with pytest.raises(BatchMetaError) as exc:
        meta.validate(**kwargs)
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert isinstance(exc.value, ValueError)


def test_block_range_needs_num_blocks():
    # Block 8 is only "outside the cache" once the cache size is known.
    meta = mutate(small(), block_table=with_table(**{"1,1": 8}))
    meta.validate()
    meta.validate(num_blocks=9)


def test_upper_bounds_are_accepted():
    meta = mutate(small(), max_query_len=100, max_seq_len=1000)
    meta.validate()
    assert not meta.decode_only


def test_mirrors_may_be_absent():
    mutate(small(), query_start_loc_cpu=None, seq_lens_cpu=None).validate()
