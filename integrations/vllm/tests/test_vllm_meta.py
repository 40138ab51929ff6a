"""batch_meta_from_vllm refuses what is not vLLM's step metadata, by name. Needs no vLLM: the
metadata is a namespace with the fields of ``CommonAttentionMetadata``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_core import InputError
from paged_vllm._meta import batch_meta_from_vllm


def common() -> SimpleNamespace:
    return SimpleNamespace(
        num_reqs=2,
        num_actual_tokens=4,
        max_query_len=3,
        max_seq_len=5,
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 5], dtype=torch.int32),
        block_table_tensor=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([8, 9, 10, 12]),
    )


def test_a_dict_is_refused_with_the_fields_it_lacks():
    # Used to be an AttributeError ('dict' object has no attribute 'num_reqs').
    with pytest.raises(InputError) as exc:
        batch_meta_from_vllm(vars(common()), block_size=4)
    assert str(exc.value).startswith("common is a dict without num_reqs, num_actual_tokens, ")
    assert "accepted: vLLM's CommonAttentionMetadata" in str(exc.value)


@pytest.mark.parametrize("block_size", [4.7, 4.0, 0, -16, True, "16"])
def test_block_size_must_be_a_positive_int(block_size):
    # 4.7 was truncated to 4 without a word.
    with pytest.raises(InputError, match=f"block_size is {block_size!r}; accepted: a positive int"):
        batch_meta_from_vllm(common(), block_size=block_size)


def test_the_metadata_of_a_step_is_accepted():
    meta = batch_meta_from_vllm(common(), block_size=4)
    assert meta.block_size == 4 and meta.num_tokens == 4
    meta.validate(num_blocks=4)
