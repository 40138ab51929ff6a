"""Launch Triton kernels without Triton's per-call Python, and compile safely inside a CUDA graph.

``DirectKernel(kernel)[grid](**kwargs)`` is a drop-in for ``kernel[grid](**kwargs)`` (a
``@triton.jit`` function or a ``@triton.autotune`` wrapper of one). Two things differ:

* **Host cost.** Triton's ``Autotuner.run`` and ``JITFunction.run`` rebuild and specialise every
  argument on every call (NVIDIA H200, Triton 3.6, 2026-12-01: ~100 us of the ~180 us one
  triton-unified forward cost). Here the first call of each *specialisation key* goes through
  Triton as usual (it compiles and, autotuned, benchmarks); later calls with the same key launch
  the cached binary directly (``compiled.run(...)``, ~5 us for 22 arguments). The key holds
  everything Triton specialises a binary on: constexpr and autotune-key values, tensor dtypes,
  16-byte alignment of each pointer, and for plain ints whether they are 1, divisible by 16 and
  fit int32 (``do_not_specialize`` ints: only the int32 range). See :func:`specialization_key`.
* **CUDA-graph capture on the first call.** Inside a capture, a key never seen before cannot
  go through Triton: compiling, loading the module and benchmarking configs are forbidden while
  a stream captures ("operation failed due to a previous error during capture"). Such a miss
  switches this thread to the driver's relaxed capture mode for the compile and module load
  only, compiles the ``capture_config`` (for an autotuned kernel; no benchmarking), and records
  the launch into the graph. That binary is not remembered as tuned: the next eager call tunes.

The normal Triton path is always taken under ``TRITON_INTERPRET=1``, for autotuners with
``pre_hook``/``reset_to_zero``/``restore_value`` (Triton runs those around each launch), and
while a launch hook is installed (``triton.knobs.runtime.launch_enter_hook``, e.g. a profiler).

This is the one module that reaches into Triton's internals (``compiled.run`` and its
``packed_metadata``, the autotuner's ``nargs``/``prune_configs``/``check_disk_cache``,
``triton.runtime._async_compile``, ``_init_handles``). It is enabled only on the releases in
:data:`TESTED_TRITON` (which says how each was tested); on any other release every launch takes
Triton's own ``kernel[grid](...)`` path (correct, with Triton's host cost per call), after one
warning. The same warning and fallback follow when the first direct launch finds that
``compiled.run`` takes other arguments (a ``TypeError``: a launcher whose signature changed).
"""

from __future__ import annotations

import ctypes
import inspect
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any, NamedTuple, cast

import torch

__all__ = [
    "TESTED_TRITON",
    "DirectKernel",
    "LayerTensors",
    "Recording",
    "direct_launch_supported",
    "relaxed_capture_mode",
    "specialization_key",
]

#: The (major, minor) Triton releases the direct launch is enabled on, each as far as it was tested:
#:
#: * 3.6: on NVIDIA GPUs (H200, H100): direct launches, recordings and first-call CUDA-graph
#:   capture. Every GPU run of record used Triton 3.6.0.
#: * 3.9: on the CPU only (CI's pin, ``noxfile.TRITON``): the specialisation key against 3.9's own
#:   binder for an sm_90 target, and which launcher kernels launch directly when compiled
#:   (tests/test_direct.py). The kernels themselves ran under the interpreter, which always takes
#:   Triton's own path: no direct launch has run on 3.9, and a ``compiled.run`` that refuses its
#:   arguments falls back (:meth:`DirectKernel.launch`).
#:
#: 3.7 and 3.8 were never tested, so they take Triton's path. paged-triton-common's ``triton``
#: requirement stops after the newest.
TESTED_TRITON = ((3, 6), (3, 9))
_supported: bool | None = None
# Whether a direct ``compiled.run`` has succeeded in this process: until one has, a TypeError from
# it means the launcher takes other arguments than this module passes (see _run).
_run_works = False

# How each argument enters the key (see specialization_key).
_INT, _INT_NOSPEC, _EXACT = range(3)
_I32_MIN, _I32_MAX = -(2**31), 2**31

_CU_STREAM_CAPTURE_MODE_RELAXED = 2


class _Active(threading.local):
    active: Recording | None = None  # the Recording this thread's launches are added to


_recording = _Active()  # per thread: engines run their generation loop in threads of their own
_libcuda: Any = None
_libcuda_lock = threading.Lock()


def _exchange_capture_mode(mode: int) -> int:
    """``cuThreadExchangeStreamCaptureMode``: set this thread's capture mode, return the old one."""
    global _libcuda
    with _libcuda_lock:
        if _libcuda is None:
            _libcuda = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(mode)
    rc = _libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(value))
    if rc != 0:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode({mode}) failed with CUresult {rc}")
    return value.value


class relaxed_capture_mode:  # a context manager, named like one
    """While active, this thread may make calls a global-mode capture forbids (module loads).

    Work launched on the capturing stream is still captured; only the driver's check against
    "unsafe" calls (``cuModuleLoad``, ``cudaMalloc``) on this thread is relaxed.
    """

    def __enter__(self) -> None:
        self._previous = _exchange_capture_mode(_CU_STREAM_CAPTURE_MODE_RELAXED)

    def __exit__(self, *exc: object) -> None:
        _exchange_capture_mode(self._previous)


def _int_type(v: int) -> int:
    """Triton's type for a Python int: 0 int32, 1 int64, 2 uint64."""
    return 0 if _I32_MIN <= v < _I32_MAX else 1 if v < 2**63 else 2


def specialization_key(kinds: Mapping[str, int], kwargs: Mapping[str, Any]) -> tuple:
    """What Triton specialises a binary on, for ``kwargs`` classified by ``kinds``.

    Tensors enter as (dtype, 16-byte aligned); ``kinds`` says how every other argument enters:
    ``_EXACT`` (the value: constexprs, autotune keys, launch options), ``_INT`` (== 1,
    divisible by 16, fits int32) or ``_INT_NOSPEC`` (``do_not_specialize``: fits int32); a name
    not in ``kinds`` enters with its name and value. Other values (floats, bools, None) that
    are not ``_EXACT`` enter as their type.

    >>> kinds = DirectKernel.kinds_of(["x_ptr", "n", "m", "BLOCK"], constexprs={"BLOCK"}, nospec={"m"})
    >>> x = torch.zeros(64, dtype=torch.float16)
    >>> a = specialization_key(kinds, {"x_ptr": x, "n": 48, "m": 5, "BLOCK": 64})
    >>> a == specialization_key(kinds, {"x_ptr": x[8:], "n": 96, "m": 7, "BLOCK": 64})
    True
    >>> a == specialization_key(kinds, {"x_ptr": x[1:], "n": 48, "m": 5, "BLOCK": 64})  # misaligned
    False
    """
    key = []
    for name, v in kwargs.items():
        kind = kinds.get(name)
        if kind == _EXACT:
            key.append(v)
        elif kind is None:
            key.append((name, v))
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        elif type(v) is not int:
            key.append(type(v))
        elif kind == _INT:
            key.append((v == 1, v % 16 == 0, _int_type(v)))
        else:
            key.append(_int_type(v))
    return tuple(key)


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a Triton version string; None when it does not start with them."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def _tested() -> str:
    """The tested releases, for messages: '3.6 and 3.9'."""
    names = [f"{a}.{b}" for a, b in TESTED_TRITON]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def _fall_back(why: str) -> None:
    """Warn that every launch takes Triton's own path from now on, because of ``why``."""
    (a, b) = TESTED_TRITON[0]  # the release of every GPU run of record
    warnings.warn(
        f"paged_triton_common.direct: {why}, so every kernel launch takes Triton's own path "
        f"(kernel[grid](...): the same results, with Triton's host work per launch). Direct launches "
        f"were tested with Triton {_tested()} (TESTED_TRITON says how); to launch directly on a GPU, "
        f"install the release every GPU run of record used: pip install 'triton=={a}.{b}.*'",
        RuntimeWarning,
        stacklevel=3,
    )


def direct_launch_supported() -> bool:
    """Whether the installed Triton is one of the releases in :data:`TESTED_TRITON` (read once),
    and no direct launch has failed since. Outside them, warns once that every launch takes
    Triton's own path."""
    global _supported
    if _supported is None:
        import triton

        release = _release(triton.__version__)
        _supported = release in TESTED_TRITON
        if not _supported:
            _fall_back(f"Triton {triton.__version__} is installed, which is not a tested release")
    return _supported


class _NotTuned(Exception):
    """No tuned choice on disk (raised instead of timing configs, which a capture cannot)."""


def _result(compiled: Any) -> Any:
    """The compiled kernel (Triton's asynchronous compile mode returns a future of it)."""
    return compiled.result() if hasattr(compiled, "result") else compiled


def _tuner_hooks(tuner: Any) -> bool:
    """Whether an autotuner runs code of its own around each launch (which a direct launch skips).

    Triton's ``Autotuner`` always holds ``pre_hook``/``post_hook`` callables (no-op lambdas when
    none was given), so what counts is whether the user gave one (``user_defined_*``, Triton
    >= 3.3) or asked for ``reset_to_zero``/``restore_value``, or a config has its own hook.
    """
    if tuner.reset_to_zero or tuner.restore_value or any(c.pre_hook is not None for c in tuner.configs):
        return True
    if hasattr(tuner, "user_defined_pre_hook"):
        return bool(tuner.user_defined_pre_hook or getattr(tuner, "user_defined_post_hook", False))
    # Older Triton: hooks are None unless given.
    return getattr(tuner, "pre_hook", None) is not None or getattr(tuner, "post_hook", None) is not None


def _hooks_empty() -> bool:
    from triton import knobs

    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        # HookChain objects in Triton 3.6 and 3.9 (never None there); None in older releases.
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class DirectKernel:
    """``kernel[grid](**kwargs)`` with a direct launch on a cached key and capture-safe misses.

    Args:
        kernel: a ``@triton.jit`` function or a ``@triton.autotune`` wrapper of one.
        capture_config: for an autotuned kernel, ``f(kwargs) -> triton.Config`` giving the config
            to compile on a miss inside a CUDA-graph capture (no benchmarking is possible there);
            default: the first config of the autotuner.
    """

    def __init__(self, kernel: Any, *, capture_config: Callable[[Mapping[str, Any]], Any] | None = None) -> None:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        self.tuner = kernel if isinstance(kernel, Autotuner) else None
        jit = kernel.fn if self.tuner is not None else kernel
        self.jit = jit
        self.capture_config = capture_config
        self._cache: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        # The interpreter's kernels are not JITFunctions: they always take the normal path.
        self.enabled = (
            isinstance(jit, JITFunction)
            and (self.tuner is None or not _tuner_hooks(self.tuner))
            and direct_launch_supported()
        )
        if isinstance(jit, JITFunction):
            params = jit.params
            self.names = tuple(p.name for p in params)
            self.defaults = {
                n: p.default for n, p in jit.signature.parameters.items() if p.default is not inspect.Parameter.empty
            }
            constexprs = {p.name for p in params if p.is_constexpr}
            nospec = {p.name for p in params if p.do_not_specialize}
        else:  # the interpreter's InterpretedFunction: the same facts from the Python function
            signature = inspect.signature(jit.fn).parameters
            self.names = tuple(signature)
            self.defaults = {n: p.default for n, p in signature.items() if p.default is not inspect.Parameter.empty}
            constexprs = {n for n, p in signature.items() if "constexpr" in str(p.annotation)}
            nospec = set(getattr(jit, "kwargs", {}).get("do_not_specialize") or ())
        tuned = set(self.tuner.keys) if self.tuner else set()
        self.kinds = self.kinds_of(self.names, constexprs=constexprs | tuned, nospec=nospec)
        # What Triton compiles a binary on: autotune-key ints specialise like any other int.
        self.binary_kinds = self.kinds_of(self.names, constexprs=constexprs, nospec=nospec)
        for option in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
            self.kinds[option] = self.binary_kinds[option] = _EXACT

    def tuning_key(self, kwargs: Mapping[str, Any]) -> tuple | None:
        """The autotuner's key for a launch with ``kwargs``, as ``Autotuner.run`` builds it (the
        key arguments' values, then every tensor argument's dtype); None for a kernel that is not
        autotuned. A launch with a key not tuned yet times the configs."""
        if self.tuner is None:
            return None
        args = {k: v for k, v in kwargs.items() if k in self.tuner.arg_names}
        return tuple(
            [args[k] for k in self.tuner.keys if k in args]
            + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")]
        )

    def binary_key(self, kwargs: Mapping[str, Any]) -> tuple:
        """What Triton compiles a binary of one config on, for a launch with ``kwargs``: a
        launch with a key not seen yet compiles (each config, when the autotuner times them)."""
        return specialization_key(self.binary_kinds, kwargs)

    @staticmethod
    def kinds_of(
        names: Iterable[str], *, constexprs: Set[str] = frozenset(), nospec: Set[str] = frozenset()
    ) -> dict[str, int]:
        """Classify argument names for :func:`specialization_key`."""
        kinds = {}
        for n in names:
            if n in constexprs:
                kinds[n] = _EXACT
            elif n in nospec:
                kinds[n] = _INT_NOSPEC
            else:
                kinds[n] = _INT
        return kinds

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda **kwargs: self.launch(grid, kwargs)

    def _args(self, kwargs: Mapping[str, Any], extra: Mapping[str, Any]) -> list[Any]:
        d = self.defaults
        return [kwargs[n] if n in kwargs else extra[n] if n in extra else d[n] for n in self.names]

    def _run(self, compiled: Any, args: list[Any], grid: tuple[int, ...], device: int) -> bool:
        """Launch ``compiled`` directly; False (nothing launched, direct launches off from now on,
        after one warning) when the first ``compiled.run`` of the process refuses its arguments."""
        global _run_works, _supported
        # What Triton itself calls for the stream (~0.3 us; torch.cuda.current_stream() ~5 us).
        stream = torch._C._cuda_getCurrentRawStream(device)
        n = len(grid)
        try:
            compiled.run(
                grid[0],
                grid[1] if n > 1 else 1,
                grid[2] if n > 2 else 1,
                stream,
                compiled.function,
                compiled.packed_metadata,
                None,
                None,
                None,
                *args,
            )
        except TypeError as exc:
            # Triton's launcher parses its arguments before launching, so nothing ran. Once a
            # direct launch has worked, the signature is right and the error is the caller's.
            if _run_works:
                raise
            self.enabled = False
            if _supported:
                import triton

                _supported = False
                _fall_back(f"Triton {triton.__version__}'s compiled kernel refused a direct launch's arguments ({exc})")
            return False
        _run_works = True
        return True

    def launch(self, grid: tuple[int, ...], kwargs: dict[str, Any]) -> Any:
        """Launch on ``grid`` with ``kwargs`` (every argument by keyword); returns the binary."""
        if not self.enabled or not _supported or not _hooks_empty():
            return self._tritons_path(grid, kwargs)
        device = torch.cuda.current_device()
        key = (device, specialization_key(self.kinds, kwargs))
        hit = self._cache.get(key)
        if hit is not None:
            compiled, extra = hit
            args = self._args(kwargs, extra)
            # Triton's grid(meta): the arguments with the config's values
            launch_grid = grid({**kwargs, **extra}) if callable(grid) else grid
            if not self._run(compiled, args, launch_grid, device):
                return self._tritons_path(grid, kwargs)
            grid = launch_grid
        elif torch.cuda.is_current_stream_capturing():
            return self._launch_in_capture(grid, kwargs, device)
        else:
            if self.tuner is not None:
                self._precompile(grid, kwargs)
            compiled = _result(self.kernel[grid](**kwargs))
            extra = dict(self.tuner.best_config.kwargs) if self.tuner is not None else {}
            self._cache[key] = (compiled, extra)
            args = self._args(kwargs, extra)
            if callable(grid):
                grid = grid({**kwargs, **extra})
        recording = _recording.active
        if recording is not None:
            recording.add(compiled, grid, args, device)
        return compiled

    def _tritons_path(self, grid: Any, kwargs: dict[str, Any]) -> Any:
        """``kernel[grid](**kwargs)``: Triton's own launch (and compile, and tuning)."""
        if _recording.active is not None:
            _recording.active.ok = False  # not a direct launch: cannot be replayed
        return self.kernel[grid](**kwargs)

    def _tuned(self, kwargs: Mapping[str, Any]) -> tuple[tuple, list[Any], Any]:
        """(the autotuner's key, its pruned configs, the tuned config or None) for ``kwargs``:
        tuned in this process, or earlier by any process that shares the cache directory
        (``cache_results``: Triton keeps its timings next to the compiled kernels)."""
        tuner: Any = self.tuner  # an Autotuner: only autotuned kernels are asked
        key = cast(tuple, self.tuning_key(kwargs))
        tuner.nargs = {}  # prune_configs reads it; every argument comes by keyword here
        configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else list(tuner.configs)
        if len(configs) == 1:
            return key, configs, configs[0]
        if key in tuner.cache:
            return key, configs, tuner.cache[key]
        if getattr(tuner, "cache_results", False):

            def not_tuned() -> None:
                raise _NotTuned

            try:
                if tuner.check_disk_cache(key, configs, not_tuned):
                    return key, configs, tuner.cache[key]
            except _NotTuned:
                pass
        return key, configs, None

    def _precompile(self, grid: Any, kwargs: dict[str, Any]) -> None:
        """Compile every config the autotuner is about to time, in parallel threads (Triton's
        asynchronous compile mode), so its timing loop finds them compiled.

        A new shape class otherwise compiles its configs one after another inside the timing
        loop: most of a first call's latency.
        """
        import os
        from concurrent.futures import ThreadPoolExecutor

        try:
            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:  # Triton < 3.5: the timing loop compiles them in turn
            return
        _, configs, tuned = self._tuned(kwargs)
        if tuned is not None or len(configs) < 2:
            return
        workers = min(len(configs), os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for config in configs:
                g = grid({**kwargs, **config.kwargs}) if callable(grid) else grid
                # A config that does not compile (out of resources) is timed as inf by the
                # autotuner, which compiles it again and sees the error there.
                self.jit.run(grid=g, warmup=True, **kwargs, **config.all_kwargs())

    def _launch_in_capture(self, grid: tuple[int, ...], kwargs: dict[str, Any], device: int) -> Any:
        extra: dict[str, Any] = {}
        options: dict[str, Any] = {}
        if self.tuner is not None:
            # A choice tuned before (this process or an earlier one), else the capture default.
            # The disk lookup only reads files and device attributes: allowed while capturing
            # (its miss path runs in every first-call capture test).
            config = self._tuned(kwargs)[2]
            if config is None:
                config = self.capture_config(kwargs) if self.capture_config else self.tuner.configs[0]
            extra = dict(config.kwargs)
            # Every compile option of the config (a register cap included), as the autotuner
            # passes them: the binary compiled here is the one a tuned eager call would run.
            options = {k: v for k, v in config.all_kwargs().items() if k not in config.kwargs}
        if callable(grid):
            grid = grid({**kwargs, **extra})
        with relaxed_capture_mode():
            compiled = _result(self.jit.run(grid=grid, warmup=True, **kwargs, **extra, **options))
            compiled._init_handles()
        # Not remembered: the next eager call for this key tunes (or looks up) as usual.
        if not self._run(compiled, self._args(kwargs, extra), grid, device):
            # Triton's own launch of the binary just compiled (no tuning: a capture forbids it).
            with relaxed_capture_mode():
                self.jit.run(grid=grid, **kwargs, **extra, **options)
        if _recording.active is not None:
            _recording.active.ok = False
        return compiled


class LayerTensors(NamedTuple):
    """The tensors of one attention layer's call that a :class:`Recording` swaps between layers
    (None for absent ones); everything else a recorded launch reads is fixed by the batch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    lse: torch.Tensor | None = None


class _Launch:
    """One recorded launch: the binary, its grid, its arguments, and which of them are the
    layer's tensors (argument position, index of the :class:`LayerTensors` field)."""

    __slots__ = ("args", "device", "function", "grid", "keep", "metadata", "run", "slots")

    def __init__(
        self, compiled: Any, grid: tuple[int, ...], args: list[Any], slots: list[tuple[int, int]], device: int
    ) -> None:
        n = len(grid)
        self.grid = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        # Pointers travel as ints: Triton's launcher then skips its per-tensor data_ptr() call
        # and driver pointer query (about a microsecond each). ``keep`` holds the tensors alive.
        self.keep = [a for a in args if isinstance(a, torch.Tensor)]
        self.args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        self.slots, self.device = slots, device


class Recording:
    """The direct launches of one call, to repeat for a few microseconds with other tensors.

    ``with Recording(layer) as rec: <launch kernels through DirectKernel>`` records every
    launch made inside; ``rec.replay(layer2)`` repeats them on the current stream with the
    tensors of ``layer2`` in place of ``layer``'s (both :class:`LayerTensors`), each field's
    tensor matched by data pointer. What depends only on the batch is fixed: a launch
    that reads none of ``layer``'s tensors (a tile plan) is not repeated, and its outputs (and
    every buffer allocated inside) live as long as the recording.

    ``rec.ok`` is False when the call cannot be repeated this way: a launch not made directly
    (interpreter, hooks, a compile inside a capture), an argument that is a view *into* one of
    ``layer``'s tensors other than the tensor itself, or two layer tensors at one address.
    Work other than DirectKernel launches (torch ops such as a copy or a fill) is not recorded:
    record only code that launches nothing else (allocating is fine). Launches made on another
    stream are recorded too and replayed, in the order they were made, on the current stream
    (triton-unified's cascade forks its prefix pass that way). ``replay`` needs tensors of the
    recorded dtypes, shapes, strides and 16-byte alignment: key recordings on them.
    """

    def __init__(self, layer: LayerTensors) -> None:
        self.ok = True
        self.launches: list[_Launch] = []
        self._where: dict[int, int] = {}
        self._storages = set()
        for i, t in enumerate(layer):
            if t is None:
                continue
            ptr = t.data_ptr()
            if ptr in self._where:
                # Two tensors at one address (out=q, say): which one an argument is, is unknown,
                # and the next call's tensors may not alias.
                self.ok = False
            self._where.setdefault(ptr, i)
            self._storages.add(t.untyped_storage().data_ptr())

    def __enter__(self) -> Recording:
        if _recording.active is not None:
            raise RuntimeError("Recording does not nest")
        _recording.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        _recording.active = None
        if exc[0] is not None:
            self.ok = False

    def add(self, compiled: Any, grid: tuple[int, ...], args: list[Any], device: int) -> None:
        slots = []
        for pos, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                i = self._where.get(a.data_ptr())
                if i is not None:
                    slots.append((pos, i))
                elif a.untyped_storage().data_ptr() in self._storages:
                    self.ok = False  # a view into a layer tensor: its offset would be lost
        self.launches.append(_Launch(compiled, grid, list(args), slots, device))

    def replay(self, layer: LayerTensors, *, everything: bool = False) -> None:
        """Repeat the recorded launches with ``layer``'s tensors; ``everything``: also those
        that read none of them (for a batch whose tensors may have changed in place)."""
        for launch in self.launches:
            if not launch.slots and not everything:
                continue
            args = launch.args.copy()
            for pos, i in launch.slots:
                args[pos] = layer[i].data_ptr()  # type: ignore[union-attr]  # slots name the fields that hold tensors
            g = launch.grid
            launch.run(
                g[0],
                g[1],
                g[2],
                torch._C._cuda_getCurrentRawStream(launch.device),
                launch.function,
                launch.metadata,
                None,
                None,
                None,
                *args,
            )
