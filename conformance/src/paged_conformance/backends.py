"""Which backends the suite runs, and their instances.

Backends come from a :class:`paged_core.Registry` (the process-wide ``paged_core.registry`` by
default), so whatever is installed is checked, the reference included. The suite never looks at
a backend's name to decide anything: capabilities, ``unavailable()`` and ``reasons(spec)`` do.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from paged_core import Backend, BackendUnavailableError, Registry
from paged_core import registry as default_registry

__all__ = ["BackendPool", "parse_backend_names", "use_triton_interpreter_on_cpu"]

#: Environment variable narrowing the backends under test when no option does (``a,b``).
BACKENDS_ENV = "PAGED_BACKENDS"


def use_triton_interpreter_on_cpu() -> bool:
    """On a machine without CUDA, set ``TRITON_INTERPRET=1`` unless the user chose a value.

    Triton kernels run on a CPU only under the interpreter, which Triton reads when a kernel is
    decorated, i.e. when a backend's module is first imported. The registry imports backends
    lazily, so calling this before asking the registry about any backend is early enough.
    Returns whether it set the variable.
    """
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def parse_backend_names(values: Iterable[str] | str | None) -> list[str] | None:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]``; None or nothing -> ``$PAGED_BACKENDS`` or None (all)."""
    if isinstance(values, str):
        values = [values]
    names = [n.strip() for v in values or () for n in v.split(",") if n.strip()]
    if not names:
        env = os.environ.get(BACKENDS_ENV, "")
        names = [n.strip() for n in env.split(",") if n.strip()]
    return list(dict.fromkeys(names)) or None


class BackendPool:
    """The backends under test: their names, why any cannot run, and one instance per options.

    Instances are built with validation on (``BatchMeta.validate`` on every call), so a batch
    the suite gets wrong is reported as such rather than as a backend failure.

    ``requested`` says whether the backends were named (``--backends``, ``paged check
    --backend``, ``$PAGED_BACKENDS``) rather than discovered: a named backend that cannot be
    loaded fails the run (see :meth:`load_error`); a discovered one is skipped with its reason.
    """

    def __init__(self, names: Sequence[str] | None = None, *, registry: Registry | None = None) -> None:
        self.registry = registry if registry is not None else default_registry
        if names:
            for name in names:
                self.registry.registration(name)  # BackendNotFoundError: says what is installed
            self.names = list(names)
        else:
            self.names = self.registry.names()
        self.requested = bool(names)
        self._unavailable: dict[str, list[str]] = {}
        self._load_errors: dict[str, str | None] = {}
        self._instances: dict[tuple[str, tuple[tuple[str, Any], ...]], Backend] = {}

    def problems(self) -> list[str]:
        """Plugins that failed to load (they register nothing, so they have no row to fail in)."""
        return [str(p) for p in self.registry.problems()]

    def unavailable(self, name: str) -> list[str]:
        """Why ``name`` cannot run on this machine at all (missing package, no GPU); empty: it can."""
        if name not in self._unavailable:
            self._unavailable[name] = list(self.registry.unavailable(name))
        return self._unavailable[name]

    def load_error(self, name: str) -> str | None:
        """Why ``name``'s class cannot be imported (the import error and what to install), or None.

        Unlike ``unavailable`` reasons such as "needs a GPU", which say the backend has nothing
        to prove on this machine, a backend that cannot be imported is broken here.
        """
        if name not in self._load_errors:
            try:
                self.registry.backend_class(name)
                self._load_errors[name] = None
            except BackendUnavailableError as exc:
                self._load_errors[name] = str(exc)
        return self._load_errors[name]

    def refused(self, name: str) -> str | None:
        """The failure message when ``name`` was asked for by name and cannot be loaded, else None."""
        error = self.load_error(name) if self.requested else None
        if error is None:
            return None
        return (
            f"{name} was asked for by name (--backends, paged check --backend or ${BACKENDS_ENV}) "
            f"but cannot be loaded: {error}"
        )

    def option_reasons(self, name: str, options: Sequence[tuple[str, Any]]) -> list[str]:
        """Options of a case that the backend's constructor does not take, as reasons."""
        if not options:
            return []
        cls = self.registry.backend_class(name)
        params = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return []
        accepted = [p for p in params if p != "self"]
        return [
            f"{name} takes no option {key!r} (its options: {', '.join(accepted) or 'none'})"
            for key, _ in options
            if key not in params
        ]

    def get(self, name: str, options: Sequence[tuple[str, Any]] = ()) -> Backend:
        """The instance of ``name`` built with ``options``, validation on."""
        key = (name, tuple(options))
        if key not in self._instances:
            backend = self.registry.get(name, **dict(options))
            backend.validate = True
            self._instances[key] = backend
        return self._instances[key]
