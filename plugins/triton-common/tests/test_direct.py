"""paged_triton_common.direct: the specialisation key against Triton's own binder, the fallback to
Triton's launch path outside the tested releases, recordings (CPU) and first-call CUDA-graph capture (GPU)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton.language as tl
from paged_triton_common.direct import DirectKernel, LayerTensors, specialization_key

KINDS = DirectKernel.kinds_of(["x_ptr", "n", "stride", "BLOCK"], constexprs={"BLOCK"}, nospec={"n"})


def _key(x, *, n=100, stride=64, block=32):
    return specialization_key(KINDS, {"x_ptr": x, "n": n, "stride": stride, "BLOCK": block})


def test_same_specialisation_same_key():
    buf = torch.zeros(256, dtype=torch.float16)
    # Another 16-byte-aligned view, another request count, another stride divisible by 16.
    assert _key(buf) == _key(buf[8:], n=7, stride=128)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(x=torch.zeros(256, dtype=torch.float16)[1:]), id="pointer-alignment"),
        pytest.param(dict(x=torch.zeros(256, dtype=torch.bfloat16)), id="tensor-dtype"),
        pytest.param(dict(block=64), id="constexpr"),
        pytest.param(dict(stride=1), id="int-equal-to-1"),
        pytest.param(dict(stride=72), id="int-not-divisible-by-16"),
        pytest.param(dict(stride=2**31), id="int-beyond-int32"),
        pytest.param(dict(n=2**31), id="unspecialised-int-beyond-int32"),
        pytest.param(dict(stride=2**63), id="int-beyond-int64"),
    ],
)
def test_each_specialisation_changes_the_key(change):
    base = torch.zeros(256, dtype=torch.float16)
    assert _key(base) != _key(change.pop("x", base), **change)


def test_autotune_key_values_enter_exactly():
    kinds = DirectKernel.kinds_of(["occupancy"], constexprs={"occupancy"})
    assert specialization_key(kinds, {"occupancy": 2}) != specialization_key(kinds, {"occupancy": 4})


def test_launch_options_and_unknown_names_enter_with_their_value():
    kinds = {**KINDS, "num_warps": 2}  # _EXACT
    x = torch.zeros(16)
    a = specialization_key(kinds, {"x_ptr": x, "num_warps": 4})
    assert a != specialization_key(kinds, {"x_ptr": x, "num_warps": 8})
    assert specialization_key(KINDS, {"other": 1}) != specialization_key(KINDS, {"other": 2})


def _probe(x_ptr, y_ptr, n, m, f, BLOCK: tl.constexpr):
    pass


def _variants():
    """Arguments of ``_probe`` that differ in everything Triton specialises on, and in what it
    does not (the values of unspecialised ints and floats, other aligned pointers)."""
    buf = torch.zeros(512, dtype=torch.float16)
    xs = [buf, buf[8:], buf[1:], torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.float32)[4:]]
    ns = [1, 16, 48, 17, 0, -32, 2**31 - 16, 2**31, 2**40 + 16, 2**63]
    for x, y, n, m, f, block, warps in itertools.product(
        xs, [buf, None], ns, [5, 1, 2**33], [1.0, 2.5], [32, 64], [4, 8]
    ):
        yield {"x_ptr": x, "y_ptr": y, "n": n, "m": m, "f": f, "BLOCK": block, "num_warps": warps}


def test_the_key_is_tritons_own_specialisation():
    """Two calls share a DirectKernel key exactly when Triton's binder (the installed release's,
    for an sm_90 target) specialises them alike: a coarser key would launch the wrong binary."""
    from paged_triton_common import direct

    if not direct.direct_launch_supported():
        pytest.skip("this Triton release is outside TESTED_TRITON: its launches take Triton's own path")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(_probe, do_not_specialize=["m"])
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    kinds = DirectKernel(jit).kinds
    ours, theirs = {}, {}
    for i, kwargs in enumerate(_variants()):
        _, specialization, options = binder(**kwargs)
        ours.setdefault(specialization_key(kinds, kwargs), set()).add(i)
        theirs.setdefault((tuple(specialization), str(options)), set()).add(i)
    assert sorted(map(sorted, ours.values())) == sorted(map(sorted, theirs.values()))


@pytest.mark.parametrize("version", ["3.10.0", "3.8.0", "3.5.1"], ids=["newer", "between-the-tested-two", "older"])
def test_outside_the_tested_releases_every_launch_takes_tritons_path(version, monkeypatch):
    import triton
    from paged_triton_common import direct
    from triton.runtime.jit import JITFunction

    jit = JITFunction(_probe)
    monkeypatch.setattr(direct, "_supported", None)
    monkeypatch.setattr(triton, "__version__", version)
    message = (
        rf"Triton {re.escape(version)} is installed, which is not a tested release.*tested with Triton 3\.6 and 3\.9"
    )
    with pytest.warns(RuntimeWarning, match=message + r".*'triton==3\.6\.\*'") as seen:
        kernels = [DirectKernel(jit), DirectKernel(jit)]
    assert len(seen) == 1, "warned more than once"
    assert not any(k.enabled for k in kernels)
    for tested in ("3.6.0", "3.9.0"):
        monkeypatch.setattr(direct, "_supported", None)
        monkeypatch.setattr(triton, "__version__", tested)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert DirectKernel(jit).enabled


class _RefusingBinary:
    """A compiled binary whose launcher takes other arguments than the direct launch passes (a
    Triton release whose ``CompiledKernel.run`` signature changed)."""

    function, packed_metadata = "fn", "md"

    def run(self, *args):
        raise TypeError(f"function takes exactly 12 arguments ({len(args)} given)")


class _TritonsPath:
    """``kernel[grid](**kwargs)``, Triton's own launch, logged."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append((grid, kwargs))


def _hit(monkeypatch, binary):
    """A DirectKernel (enabled, Triton's path faked) whose cache already holds ``binary`` for
    :data:`PROBE`'s arguments: the next launch with them is a direct ``binary.run``."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    kernel = DirectKernel(JITFunction(_probe))
    if not kernel.enabled:
        pytest.skip("this Triton release is outside TESTED_TRITON: its launches take Triton's own path")
    monkeypatch.setattr(kernel, "kernel", _TritonsPath())
    kernel._cache[(0, specialization_key(kernel.kinds, PROBE))] = (binary, {})
    return kernel


PROBE = {"x_ptr": torch.zeros(16), "y_ptr": None, "n": 4, "m": 1, "f": 1.0, "BLOCK": 16}


def test_a_launcher_that_refuses_the_direct_arguments_falls_back_to_tritons_path(monkeypatch):
    """A TypeError from the first ``compiled.run`` turns direct launches off, with the warning of
    an untested release, and the launch goes through Triton's own path instead."""
    from paged_triton_common import direct

    monkeypatch.setattr(direct, "_supported", None)
    monkeypatch.setattr(direct, "_run_works", False)
    kernel, other = _hit(monkeypatch, _RefusingBinary()), _hit(monkeypatch, _RefusingBinary())
    with pytest.warns(RuntimeWarning, match=r"refused a direct launch's arguments \(function takes exactly") as seen:
        kernel[(2,)](**PROBE)
        other[(2,)](**PROBE)
        kernel[(3,)](**PROBE)
    assert len(seen) == 1, "warned more than once"
    assert kernel.kernel.calls == [((2,), PROBE), ((3,), PROBE)] and other.kernel.calls == [((2,), PROBE)]
    assert not kernel.enabled and not direct.direct_launch_supported()


def test_once_a_direct_launch_worked_a_type_error_is_the_callers(monkeypatch):
    from paged_triton_common import direct

    monkeypatch.setattr(direct, "_supported", None)
    monkeypatch.setattr(direct, "_run_works", False)
    working = _FakeBinary()
    _hit(monkeypatch, working)[(2,)](**PROBE)
    assert len(working.calls) == 1 and direct._run_works
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="function takes exactly"):
            _hit(monkeypatch, _RefusingBinary())[(2,)](**PROBE)
    assert direct.direct_launch_supported()


# A mixed batch (the unified kernel) and a decode batch split three ways (the split kernel).
@pytest.mark.parametrize(
    ("options", "query_lens"), [({}, [5, 1, 1]), ({"num_splits": 3}, [1, 1, 1])], ids=["unified", "split"]
)
def test_tritons_path_gives_the_same_output(options, query_lens, monkeypatch):
    """The fallback (every DirectKernel on ``kernel[grid](...)``) against the launches of this
    run (direct on a GPU, the interpreter on a CPU): bitwise the same cache and output."""
    from paged_core import BatchMeta, registry
    from paged_triton_common import direct
    from paged_triton_common import write as write_module
    from paged_triton_unified import launch as unified_launch
    from paged_triton_unified import split_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    b = registry.get("triton-unified", **options)

    def run():
        torch.manual_seed(0)
        meta = BatchMeta.build(query_lens, [37, 20, 60], block_size=16, num_blocks=16, device=device, seed=1)
        cache = b.allocate(16, 16, 2, 32, dtype=torch.float16, device=device)
        k = torch.randn(meta.num_tokens, 2, 32, dtype=torch.float16, device=device)
        b.write(cache, k, -k, meta)
        q = torch.randn(meta.num_tokens, 4, 32, dtype=torch.float16, device=device)
        return cache.k.clone(), b.forward(q, cache, b.plan(meta))

    first = run()
    for module in (unified_launch, split_launch, write_module):
        for kernel in vars(module).values():
            if isinstance(kernel, direct.DirectKernel):
                monkeypatch.setattr(kernel, "enabled", False)
    write_module._seen.clear()
    write_module._plans.clear()
    again = run()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_interpreter_kernels_take_the_normal_path():
    from paged_triton_unified import launch

    if not launch.INTERPRET:
        pytest.skip("checks the TRITON_INTERPRET=1 path; this run compiles for a GPU")
    assert not launch._attention.enabled and not launch._tile_plan.enabled


# Compiled mode needs no GPU to *define* kernels: a fresh process without TRITON_INTERPRET sees
# the DirectKernels the launchers really use on a GPU.
_COMPILED_KERNELS = """
import triton
from paged_triton_common import write
from paged_triton_unified import launch
from paged_triton_unified import split_launch as split
from paged_triton_common.direct import DirectKernel
kernels = {n: getattr(m, n) for m in (launch, write, split) for n in dir(m)
           if isinstance(getattr(m, n), DirectKernel)}
print(sorted(n for n, k in kernels.items() if not k.enabled))

@triton.jit
def f(x_ptr, BLOCK: tl.constexpr):
    pass

hooked = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=[], pre_hook=lambda *a, **k: None)(f)
zeroed = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=[], reset_to_zero=["x_ptr"])(f)
plain = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=[])(f)
print([DirectKernel(k).enabled for k in (hooked, zeroed, plain)])
"""


def test_every_launcher_kernel_launches_directly_when_compiled(tmp_path):
    """Triton's Autotuner always holds no-op hook lambdas: mistaking them for user hooks sent every
    autotuned kernel through Triton's ~100 us path (and broke first-call capture)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = tmp_path / "probe.py"  # a file: triton.jit reads its kernel's source
    probe.write_text("import triton.language as tl\n" + _COMPILED_KERNELS)
    proc = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    disabled, hooks = proc.stdout.strip().splitlines()[-2:]
    assert disabled == "[]", f"DirectKernels on Triton's slow path: {disabled}"
    assert hooks == "[False, False, True]", "an autotuner with hooks of its own must take Triton's path"


HOST_COST = Path(__file__).resolve().parents[3] / "scripts" / "host_cost.py"
CAPTURE_CASES = ["decode_only-long_and_short", "mixed_prefill_and_decode-g4"]


def first_call_capture(backend: str, case: str, tmp_path: Path, autotune: str) -> None:
    """Run the first-call capture check in a fresh process with an empty Triton cache."""
    if not torch.cuda.is_available():
        pytest.skip("first-call CUDA-graph capture needs a CUDA device")
    if not HOST_COST.exists():
        pytest.skip(f"needs the repository's {HOST_COST.name} (not in an installed distribution)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), PAGED_AUTOTUNE=autotune)
    proc = subprocess.run(
        [sys.executable, str(HOST_COST), "capture", backend, case], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.startswith("ok "), proc.stdout


@pytest.mark.parametrize("autotune", ["1", "0"], ids=["autotune", "fixed-config"])
@pytest.mark.parametrize("case", CAPTURE_CASES)
def test_first_call_is_capture_safe(case, autotune, tmp_path):
    first_call_capture("triton-unified", case, tmp_path, autotune)


FIRST_CALL = HOST_COST.with_name("first_call.py")


def test_a_later_process_does_not_tune_again(tmp_path):
    """Tuned choices persist next to the compiled kernels: the second process times no config."""
    if not torch.cuda.is_available():
        pytest.skip("autotuning times kernels on a CUDA device")
    if not FIRST_CALL.exists():
        pytest.skip(f"needs the repository's {FIRST_CALL.name} (not in an installed distribution)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), PAGED_AUTOTUNE="1")
    timed = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(FIRST_CALL), "child", "triton-unified", "decode 64 x 4096", "128"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        timed.append(json.loads(proc.stdout.strip().splitlines()[-1])["timed_configs"])
    assert timed[0] > 0, "the first process timed no config: nothing was tuned"
    assert timed[1] == 0, f"a later process timed {timed[1]} configs again"


class _FakeBinary:
    """What Recording needs of a compiled Triton binary: ``run`` (here it logs its arguments)."""

    function, packed_metadata = "fn", "md"

    def __init__(self):
        self.calls = []

    def run(self, gx, gy, gz, stream, function, metadata, launch_md, enter, exit_, *args):
        self.calls.append(((gx, gy, gz), args))


def _recorded(monkeypatch, layer, launches):
    from paged_triton_common.direct import Recording

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    rec = Recording(layer)
    for binary, args in launches:
        rec.add(binary, (4, 2), args, 0)
    return rec


def test_recording_replays_with_the_next_layers_tensors(monkeypatch):
    q, k, out, fixed = torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8)
    tiles, attention = _FakeBinary(), _FakeBinary()
    rec = _recorded(
        monkeypatch, LayerTensors(q=q, k=k, v=None, out=out), [(tiles, [fixed, 3]), (attention, [q, fixed, k, out, 7])]
    )
    assert rec.ok
    q2, k2, out2 = torch.ones(8), torch.ones(8), torch.ones(8)
    rec.replay(LayerTensors(q=q2, k=k2, v=None, out=out2))
    assert tiles.calls == []  # reads no layer tensor: ran once, when recorded
    ((grid, args),) = attention.calls
    # Pointers as ints (Triton's launcher takes them so, without a driver query per tensor).
    assert grid == (4, 2, 1) and list(args[:4]) == [q2.data_ptr(), fixed.data_ptr(), k2.data_ptr(), out2.data_ptr()]
    assert args[4] == 7
    rec.replay(LayerTensors(q=q2, k=k2, v=None, out=out2), everything=True)
    assert len(tiles.calls) == 1 and tiles.calls[0][1][0] == fixed.data_ptr()
    assert any(t is fixed for t in rec.launches[0].keep)  # alive as long as the recording


def test_recording_refuses_views_into_layer_tensors_and_aliases(monkeypatch):
    q, out = torch.zeros(16), torch.zeros(16)
    # A kernel argument at an offset into q: its replacement's offset would be lost.
    assert not _recorded(monkeypatch, LayerTensors(q=q, k=None, v=None, out=out), [(_FakeBinary(), [q[8:], out])]).ok
    # out is q: the next layer's distinct q and out could not both be placed.
    assert not _recorded(monkeypatch, LayerTensors(q=q, k=None, v=None, out=q), [(_FakeBinary(), [q])]).ok
