"""batch_meta_from_transformers recovers the block table from transformers' slot lists."""

from __future__ import annotations

import pytest
import torch
from paged_core import InputError
from paged_transformers import batch_meta_from_gathered, batch_meta_from_transformers

BS = 4


def transformers_step(tables, past, query, *, padded_tokens=0, reads=True):
    """The tensors transformers builds for one step, from block tables the test chose.

    Slots follow transformers' full-attention allocator: position p of a request lives at
    ``table[p // BS] * BS + p % BS``; reads list every position, writes the new ones.
    """
    slot = lambda t, p: t[p // BS] * BS + p % BS
    cu_q, cu_k, read, write = [0], [0], [], []
    for t, p, q in zip(tables, past, query, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + p + q)
        read += [slot(t, i) for i in range(p + q)]
        write += [slot(t, i) for i in range(p, p + q)]
    trash = 99 * BS
    write += [trash] * padded_tokens
    return dict(
        cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32),
        read_index=torch.tensor(read if reads else [], dtype=torch.int64),
        write_index=torch.tensor(write, dtype=torch.int64),
        num_tokens=len(write),
    )


def test_mixed_step_with_reads():
    tables = [[7, 2, 5], [3], [6, 1]]
    past, query = [9, 0, 4], [1, 3, 2]  # a decode, a whole prompt, a prefill chunk
    meta = batch_meta_from_transformers(
        **transformers_step(tables, past, query), block_size=BS, max_query_len=3, max_seq_len=10
    )
    assert meta.num_reqs == 4  # plus the (empty) padding request
    assert meta.seq_lens.tolist() == [10, 3, 6, 0]
    assert meta.block_table[:, :3].tolist() == [[7, 2, 5], [3, 0, 0], [6, 1, 0], [0, 0, 0]]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 6, 6]
    assert meta.slot_mapping.tolist() == [5 * BS + 1, 12, 13, 14, 1 * BS + 0, 1 * BS + 1]
    meta.validate(num_blocks=8)


def test_whole_prompts_without_reads_use_the_write_slots():
    tables = [[4, 2], [0]]
    meta = batch_meta_from_transformers(
        **transformers_step(tables, [0, 0], [6, 2], reads=False), block_size=BS, max_query_len=6, max_seq_len=6
    )
    assert meta.block_table.tolist() == [[4, 2], [0, 0], [0, 0]]
    meta.validate(num_blocks=5)


def test_padded_rows_become_a_padding_request():
    # transformers pads the step to 8 rows for a CUDA graph; its max_seqlen_q is then 8.
    step = transformers_step([[1], [2]], [0, 2], [3, 1], padded_tokens=4)
    meta = batch_meta_from_transformers(**step, block_size=BS, max_query_len=8, max_seq_len=16)
    assert meta.query_start_loc.tolist() == [0, 3, 4, 8]
    assert meta.seq_lens.tolist() == [3, 3, 0]
    assert meta.slot_mapping.tolist()[4:] == [-1] * 4
    assert meta.block_table.shape == (3, 4)  # ceil(16 / 4): the padded max_seqlen_k sizes the table
    meta.validate(num_blocks=3)


def test_a_decode_step_with_one_row_per_request_gets_no_padding_request():
    # transformers without CUDA graphs: max_seqlen_q 1 and one row per request, nothing padded.
    step = transformers_step([[1, 3], [2]], [5, 2], [1, 1])
    meta = batch_meta_from_transformers(**step, block_size=BS, max_query_len=1, max_seq_len=6)
    assert meta.num_reqs == 2 and meta.decode_only and meta.num_tokens == meta.num_reqs
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert meta.seq_lens.tolist() == [6, 3]
    assert meta.slot_mapping.tolist() == [3 * BS + 1, 2 * BS + 2]
    meta.validate(num_blocks=4)


def test_a_padded_decode_step_keeps_its_padding_request():
    # With CUDA graphs transformers pads rows and sets max_seqlen_q to the padded count.
    step = transformers_step([[1, 3], [2]], [5, 2], [1, 1], padded_tokens=2)
    meta = batch_meta_from_transformers(**step, block_size=BS, max_query_len=4, max_seq_len=8)
    assert meta.num_reqs == 3 and meta.query_start_loc.tolist() == [0, 1, 2, 4]
    assert meta.slot_mapping.tolist()[2:] == [-1, -1]


def test_a_gathered_decode_step_with_one_row_per_request_gets_no_padding_request():
    meta = batch_meta_from_gathered(
        cu_seq_lens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        cu_seq_lens_k=torch.tensor([0, 3, 5], dtype=torch.int32),
        num_tokens=2,
        num_kv_rows=5,
        max_query_len=1,
        max_seq_len=3,
    )
    assert meta.num_reqs == 2 and meta.decode_only and meta.num_tokens == meta.num_reqs
    assert meta.block_table.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert meta.slot_mapping.tolist() == [2, 4]
    meta.validate(num_blocks=5)


def test_write_index_must_cover_every_row():
    step = transformers_step([[1]], [0], [3])
    step["num_tokens"] = 5
    with pytest.raises(InputError, match="write_index has shape \\[3\\] but q has 5 rows"):
        batch_meta_from_transformers(**step, block_size=BS, max_query_len=3, max_seq_len=3)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (dict(block_size=0), "block_size is 0; accepted: an int >= 1 (the paged cache's tokens per block)"),
        (dict(block_size=4.0), "block_size is 4.0; accepted: an int >= 1"),
        (dict(cu_seq_lens_q=[0, 1, 4, 6]), "cu_seq_lens_q is a list; accepted: an int tensor"),
        (dict(cu_seq_lens_k=torch.tensor([0.0, 10.0])), "cu_seq_lens_k is float32 [2]; accepted: an int tensor"),
        (dict(write_index=[1, 2]), "write_index is a list; accepted: an int tensor"),
        (dict(max_seq_len=None), "max_seq_len is None; accepted: an int (a host int of the step)"),
        (dict(num_tokens=-1), "num_tokens is -1; accepted: an int >= 0"),
    ],
    ids=["block_size_0", "float_block_size", "list_cu_q", "float_cu_k", "list_write", "none_max", "negative_rows"],
)
def test_bad_step_arguments_are_named(change, needle):
    # block_size=0 was a ZeroDivisionError and a list cu_seq_lens an AttributeError ('list'
    # object has no attribute 'dim').
    step = transformers_step([[7, 2, 5], [3], [6, 1]], [9, 0, 4], [1, 3, 2])
    args = {**step, "block_size": BS, "max_query_len": 3, "max_seq_len": 10, **change}
    with pytest.raises(InputError) as exc:
        batch_meta_from_transformers(**args)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (dict(cu_seq_lens_q=[0, 1, 3]), "cu_seq_lens_q is a list; accepted: an int tensor"),
        (dict(num_kv_rows=None), "num_kv_rows is None; accepted: an int >= 0"),
    ],
    ids=["list_cu_q", "none_kv_rows"],
)
def test_bad_gathered_step_arguments_are_named(change, needle):
    args = dict(
        cu_seq_lens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
        cu_seq_lens_k=torch.tensor([0, 3, 6], dtype=torch.int32),
        num_tokens=4,
        num_kv_rows=8,
        max_query_len=4,
        max_seq_len=3,
    )
    with pytest.raises(InputError) as exc:
        batch_meta_from_gathered(**{**args, **change})
    assert needle in str(exc.value)
