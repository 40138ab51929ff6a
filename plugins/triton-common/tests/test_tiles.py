"""paged_triton_common.tiles: the helpers both Triton kernels call."""

from __future__ import annotations

import os

import pytest
import torch

# Triton runs on a CPU only under its interpreter, read when kernels are defined.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton
import triton.language as tl
from paged_triton_common.tiles import FP8_E4M3, FP8_E5M2, codes8_f16, int4_f16, tanh

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("formula", ["kept", "exp2"])
def test_tanh_matches_torch_over_the_softcap_range(formula):
    """The tiles' tanh (one for both Triton kernels) is the more accurate of the two formulas
    they once had: 1 - 2 / (exp(2x) + 1), against 1 - 2 / (exp2(2x log2 e) + 1)."""
    x = torch.linspace(-20.0, 20.0, 4001, dtype=torch.float32, device=DEVICE)
    got = {name: torch.empty_like(x) for name in ("kept", "exp2")}
    _tanh_kernel[(1,)](x, got["kept"], x.numel(), BLOCK=4096)
    _tanh_exp2_kernel[(1,)](x, got["exp2"], x.numel(), BLOCK=4096)
    want = torch.tanh(x.double())
    err = {name: (y.double() - want).abs().max().item() for name, y in got.items()}
    assert err[formula] <= 5e-7, err
    assert err["kept"] <= err["exp2"], err


def test_tanh_keeps_its_relative_precision_near_zero():
    """A soft-cap far above the scores divides them to tiny ``x``: there tanh(x) ~ x must keep
    its relative precision (1 - 2 / (exp(2x) + 1) cancels to 0 below 3e-8)."""
    mags = torch.logspace(-30, 0, 601, dtype=torch.float64)
    x = torch.cat([-mags.flip(0), mags]).to(torch.float32).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=2048)
    want = torch.tanh(x.double())
    rel = ((y.double() - want).abs() / want.abs()).max().item()
    assert rel <= 1e-6, rel


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, tanh(x), mask=offs < n)


@triton.jit
def _tanh_exp2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0), mask=offs < n)


def test_int4_f16_unpacks_every_byte_as_int4_codes_does():
    """Both int4 unpackings (PTX on the GPU, shifts under the interpreter) give every byte's two
    signed nibbles, low nibble first, exactly."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).to(DEVICE)
    got = torch.empty(16, 32, dtype=torch.float16, device=DEVICE)
    _int4_f16_kernel[(1,)](packed, got, ASM=DEVICE == "cuda")
    b = packed.cpu().to(torch.int32)
    lo, hi = b & 0xF, b >> 4
    want = torch.stack([lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)], dim=-1).reshape(16, 32)
    assert torch.equal(got.cpu().to(torch.int32), want)


@triton.jit
def _int4_f16_kernel(x_ptr, y_ptr, ASM: tl.constexpr):
    r = tl.arange(0, 16)
    x = tl.load(x_ptr + r[:, None] * 16 + r[None, :])
    c = tl.arange(0, 32)
    tl.store(y_ptr + r[:, None] * 32 + c[None, :], int4_f16(x, ASM))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("staged", [False, True])
def test_codes8_f16_converts_every_code_exactly(fmt, staged):
    """Every 8-bit code becomes its exact fp16 value (PTX on the GPU, Triton's conversion under
    the interpreter), staged in the load layout or not; NaN codes stay NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    if fmt == "int8":
        want = codes.view(torch.int8).to(torch.float16)
        src, fp8 = codes.view(torch.int8), 0
    else:
        dtype = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        want = codes.view(dtype).to(torch.float16)
        src, fp8 = codes, FP8_E4M3 if fmt == "fp8_e4m3" else FP8_E5M2
    got = torch.empty(16, 16, dtype=torch.float16, device=DEVICE)
    _codes8_f16_kernel[(1,)](src.to(DEVICE), got, FP8=fp8, ASM=DEVICE == "cuda", STAGED=staged)
    got = got.cpu()
    if DEVICE == "cpu":
        # Triton 3.9's interpreter converts fp8 with numpy: e4m3's NaN codes read +-480 and
        # e5m2's subnormals flush to zero there. The GPU run checks every code.
        skip = {"int8": [], "fp8_e4m3": [0x7F, 0xFF], "fp8_e5m2": [1, 2, 3, 0x81, 0x82, 0x83]}[fmt]
        keep = ~torch.isin(codes.to(torch.int32), torch.tensor(skip, dtype=torch.int32))
        got, want = got[keep], want[keep]
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@triton.jit
def _codes8_f16_kernel(x_ptr, y_ptr, FP8: tl.constexpr, ASM: tl.constexpr, STAGED: tl.constexpr):
    r = tl.arange(0, 16)
    x = tl.load(x_ptr + r[:, None] * 16 + r[None, :])
    tl.store(y_ptr + r[:, None] * 16 + r[None, :], codes8_f16(x, FP8, ASM, STAGED))
