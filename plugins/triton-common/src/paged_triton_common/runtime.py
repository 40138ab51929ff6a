"""What the Triton launchers read about the process and the device: the interpreter and
autotuning switches, the multiprocessor count and the autotune key's occupancy class."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["AUTOTUNE", "INTERPRET", "cdiv", "head_dim_of", "next_power_of_2", "occupancy_class", "sm_count"]

# Triton picks interpreter or compiler when a kernel is defined (the kernel modules import this
# one first), not when it runs. Under TRITON_INTERPRET=1 the launchers run one fixed config:
# autotuning there would only multiply the (already slow) interpreted run time by the number of
# configs.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# PAGED_AUTOTUNE=0 runs one fixed GPU config per shape class: for test runs, where tuning every
# tiny shape would cost minutes of compiles and the chosen config never changes the result.
AUTOTUNE = os.environ.get("PAGED_AUTOTUNE", "1") != "0"


# Host arithmetic in plain ints: triton.cdiv and triton.next_power_of_2 are constexpr functions
# (Triton 3.9: ~5 us a call, unwrapping their arguments), too slow for a launcher's hot path.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dim a K or V cache tensor holds: its last dimension, twice that for int4 codes
    (``uint8``, two per byte; ``paged_core.pack_int4``)."""
    return int(cache.shape[-1]) * (2 if cache.dtype == torch.uint8 else 1)


def sm_count(device: torch.device | str) -> int | None:
    """Multiprocessors of a CUDA device (cached; no sync); None for any other device.

    >>> sm_count("cpu") is None
    True
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def occupancy_class(programs: int, num_sms: int | None) -> int:
    """The autotune key's occupancy class: programs per SM rounded up to 1, 2, 4 or 8 (8: 8 or
    more); 1 without a GPU.

    >>> [occupancy_class(n * 8, 132) for n in (16, 32, 64, 128, 256)]  # decode batches, 8 KV heads
    [1, 2, 4, 8, 8]
    """
    if not num_sms:
        return 1
    return min(8, 1 << max(0, -(-programs // num_sms) - 1).bit_length())
