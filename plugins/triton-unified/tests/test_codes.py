"""The in-register code conversions of ``_codes_to_dot``, checked on the CPU.

The GPU runs them as inline PTX (``_codes_to_dot``), which the interpreter cannot execute (it takes the ``.to()``
path, which the conformance suite covers). Here a model of the few PTX instructions they use
runs the asm text of ``kernels.py`` itself on every code in every one of the four positions of
a packed register, against PyTorch's dequantization, bit for bit. The conformance suite's
int8/fp8 cases check the same conversions on the GPU, through the attention kernel.
"""

from __future__ import annotations

import re

import pytest
import torch
from paged_triton_unified import kernels

_HALF = {"bf16": torch.bfloat16, "f16": torch.float16}


def _half_to_float(bits: int, kind: str) -> float:
    signed = bits - 0x10000 if bits >= 0x8000 else bits
    return torch.tensor([signed], dtype=torch.int16).view(_HALF[kind]).double().item()


def _float_to_half(x: float, kind: str) -> int:
    return int(torch.tensor([x], dtype=torch.float64).to(_HALF[kind]).view(torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): result byte i is byte (sel >> 4i) & 7 of the 8 bytes b:a."""
    assert sel <= 0xFFFF and all((sel >> (4 * i)) & 8 == 0 for i in range(4)), "sign-replicating selectors unmodelled"
    both = (b << 32) | a
    return sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _packed(a: int, b: int, c: int | None, kind: str, op) -> int:
    out = 0
    for half in range(2):
        args = [_half_to_float((x >> (16 * half)) & 0xFFFF, kind) for x in (a, b) + ((c,) if c is not None else ())]
        out |= _float_to_half(op(*args), kind) << (16 * half)
    return out


def _e4m3x2_to_f16x2(a: int) -> int:
    codes = torch.tensor([a & 0xFF, a >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
    lo, hi = (int(x) & 0xFFFF for x in codes.to(torch.float16).view(torch.int16).tolist())
    return lo | (hi << 16)


def run_ptx(asm: str, word: int) -> tuple[int, int]:
    """Execute ``asm`` (outputs $0, $1; input $2 = ``word``); returns ($0, $1)."""
    regs = {"$2": word}

    def val(x: str) -> int:
        x = x.strip()
        return regs[x] if x in regs else int(x, 0)

    body = asm.strip().removeprefix("{").removesuffix("}")
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        op, _, rest = stmt.partition(" ")
        if op == ".reg":
            continue
        if op == "mov.b32" and rest.startswith("{"):  # unpack into two 16-bit registers
            lo_hi, src = rest.split("},")
            lo, hi = (r.strip() for r in lo_hi.strip("{ ").split(","))
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *a = (x.strip() for x in rest.split(","))
        if op == "mov.b32":
            r = val(a[0])
        elif op == "prmt.b32":
            r = _prmt(val(a[0]), val(a[1]), val(a[2]))
        elif op in ("and.b32", "or.b32", "xor.b32"):
            x, y = val(a[0]), val(a[1])
            r = x & y if op == "and.b32" else x | y if op == "or.b32" else x ^ y
        elif op == "shr.b32":
            r = val(a[0]) >> val(a[1])
        elif op == "fma.rn.bf16x2":
            r = _packed(val(a[0]), val(a[1]), val(a[2]), "bf16", lambda x, y, z: x * y + z)
        elif op == "sub.f16x2":
            r = _packed(val(a[0]), val(a[1]), None, "f16", lambda x, y: x - y)
        elif op == "cvt.rn.f16x2.e4m3x2":
            r = _e4m3x2_to_f16x2(val(a[0]))
        else:
            raise AssertionError(f"no model of {op!r} (from {stmt!r}): add one")
        regs[d] = r & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


# (asm, cache format, output kind)
CONVERSIONS = {
    "int8->bf16": (kernels._S8_TO_BF16, "int8", "bf16"),
    "int8->f16": (kernels._S8_TO_F16, "int8", "f16"),
    "e4m3->f16": (kernels._E4M3_TO_F16, "fp8", "f16"),
}


@pytest.mark.parametrize("name", CONVERSIONS)
def test_every_code_in_every_position_converts_exactly(name):
    asm, kv, kind = CONVERSIONS[name]
    asm = getattr(asm, "value", asm)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    source = codes.view(torch.int8) if kv == "int8" else codes.view(torch.float8_e4m3fn)
    want = source.float().to(_HALF[kind]).view(torch.int16).int() & 0xFFFF  # PyTorch's dequantization
    nan_code = torch.tensor([(c & 0x7F) == 0x7F and kv == "fp8" for c in range(256)])
    for shift in range(4):  # code c at position (c + shift) % 4 of its register
        order = [(c - shift) % 256 for c in range(256)]
        for w in range(64):
            four = order[4 * w: 4 * w + 4]
            out0, out1 = run_ptx(asm, sum(c << (8 * k) for k, c in enumerate(four)))
            got = [out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16]  # e0, e1 | e2, e3
            for c, g in zip(four, got, strict=True):
                if nan_code[c]:
                    assert _half_to_float(g, kind) != _half_to_float(g, kind), (name, hex(c))
                else:
                    assert g == int(want[c]), f"{name}: code 0x{c:02x} gave 0x{g:04x}, want 0x{int(want[c]):04x}"


def test_the_model_knows_prmt_and_the_packing_order():
    # prmt's documented examples: selector 0x5410 interleaves the low halves, 0x3210 is a.
    assert _prmt(0x33221100, 0x77665544, 0x5410) == 0x55441100
    assert _prmt(0x33221100, 0x77665544, 0x3210) == 0x33221100
    # The int8 -> fp16 asm on codes 1, 2, 3, 4 (e0 in the low byte): halves 1, 2 | 3, 4.
    out0, out1 = run_ptx(kernels._S8_TO_F16.value, 0x04030201)
    assert [_half_to_float(h, "f16") for h in (out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16)] == [1, 2, 3, 4]


def test_every_asm_instruction_is_modelled():
    ops = {re.split(r"\s", s.strip())[0] for asm, _, _ in CONVERSIONS.values()
           for s in asm.value.strip("{}").split(";") if s.strip()}
    assert ops <= {".reg", "mov.b32", "prmt.b32", "and.b32", "or.b32", "xor.b32", "shr.b32", "fma.rn.bf16x2",
                   "sub.f16x2", "cvt.rn.f16x2.e4m3x2"}, ops
