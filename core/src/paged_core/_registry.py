"""The backend registry: pluggy, fed by the ``paged_core`` entry-point group.

Loading is lazy and fault-isolated. Each entry point is loaded on its own (so one that raises
on import is recorded and the next still loads), each plugin's hook is called on its own (so
one that raises while registering is recorded too), and backend classes are imported only when
asked for (so ``registry.names()`` imports no CUDA code). ``PAGED_PLUGINS=a,b`` narrows which
entry points load. Every public method is safe to call from several threads.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import re
import threading
import traceback
from collections.abc import Mapping
from typing import Any, cast

import pluggy

from . import hookspecs
from ._backend import Backend
from ._errors import BackendNotFoundError, BackendUnavailableError, InputError
from ._spec import AttentionSpec, Capabilities
from .hookspecs import pip_install

__all__ = ["Registry", "Registration", "Problem", "registry", "FIRST_PARTY"]

#: Backends of this project and what installs each, for messages about missing ones.
FIRST_PARTY = {
    "reference": pip_install("paged-core"),
    "triton-unified": pip_install("'paged-core[triton]'"),
    "triton-splitkv": pip_install("'paged-core[triton]'"),
    "flashinfer": pip_install("'paged-core[flashinfer]'"),
    "flash-attn2": pip_install("'paged-core[flash-attn]'"),
}
#: paged-core's own plugin (entry point) and the backends it registers besides the one of its
#: name (paged_core/plugin.py): PAGED_PLUGINS names plugins, and "auto" is one of these backends.
_CORE_PLUGIN = "reference"
_BACKENDS_OF_CORE_PLUGIN = frozenset({"auto"})
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclasses.dataclass
class Problem:
    """A plugin or backend that could not be loaded, with why."""

    #: The entry point / plugin name, or the backend name for a failed backend import.
    source: str
    #: Where it failed: "import", "register_backends", "register", "backend", the name of
    #: another hook whose implementation raised ("register_commands"), or the environment
    #: variable (``PAGED_PLUGINS``) that names a plugin not installed.
    stage: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.source} ({self.stage}): {self.message}"


@dataclasses.dataclass
class Registration:
    """One registered backend, before or after its class is imported."""

    name: str
    target: str | type
    plugin: str
    priority: int = 0
    install: str | None = None
    distribution: str | None = None
    version: str | None = None
    cls: type[Backend] | None = None
    error: str | None = None

    @property
    def install_hint(self) -> str:
        return self.install or FIRST_PARTY.get(self.name) or f"pip install {self.distribution or self.plugin}"


class Registry:
    """All discovered backends. Use the module-level ``registry``; build others in tests."""

    def __init__(self, *, group: str = hookspecs.PROJECT, env_var: str = "PAGED_PLUGINS") -> None:
        self.group = group
        self.env_var = env_var
        self._lock = threading.RLock()
        self._loaded = False
        self._regs: dict[str, Registration] = {}
        self._problems: list[Problem] = []
        self._pm: pluggy.PluginManager | None = None
        # Entry points installed but not loaded because of ``env_var`` (for "not found" messages).
        self._skipped: list[str] = []
        # Every installed entry-point name of ``group``, loaded or not (for :meth:`not_installed`).
        self._entry_points: list[str] = []

    # ----------------------------------------------------------------------------- loading
    def reload(self) -> None:
        """Forget everything and discover again on next use (after installing a plugin)."""
        with self._lock:
            self._loaded = False
            self._regs, self._problems, self._pm, self._skipped, self._entry_points = {}, [], None, [], []

    def add_plugin(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin object (a module or class with a ``register_backends`` hookimpl).

        Entry points are the normal way; this is for tests and for applications that define a
        backend in their own code.
        """
        with self._lock:
            self._ensure_loaded()
            assert self._pm is not None
            name = self._pm.register(plugin, name=name)
            impls = [i for i in self._pm.hook.register_backends.get_hookimpls() if i.plugin is plugin]
            self._call_impls(impls, {})

    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            self._pm = pm
            wanted = os.environ.get(self.env_var)
            allow = {w.strip() for w in wanted.split(",") if w.strip()} if wanted else None
            names = sorted({ep.name for ep in importlib.metadata.entry_points(group=self.group)})
            self._entry_points = names
            for typo in sorted(allow - set(names)) if allow is not None else ():
                # A misspelt name would otherwise just load less, silently.
                fix = "fix the spelling, or install the plugin"
                if typo in _BACKENDS_OF_CORE_PLUGIN and _CORE_PLUGIN in names:
                    fix = f"{typo!r} is a backend of plugin {_CORE_PLUGIN!r} (paged-core's): name that plugin"
                self._problems.append(
                    Problem(
                        typo,
                        self.env_var,
                        f"{self.env_var} names {typo!r}, but no installed plugin has that entry point; "
                        f"installed: {', '.join(names) or 'none'} ({fix})",
                    )
                )
            for ep_name in names:
                if allow is not None and ep_name not in allow:
                    self._skipped.append(ep_name)
                    continue
                try:
                    pm.load_setuptools_entrypoints(self.group, name=ep_name)
                except Exception as exc:  # a broken plugin must never take the others down
                    self._problems.append(
                        Problem(ep_name, "import", f"{type(exc).__name__}: {exc}", traceback.format_exc())
                    )
            dists = {}
            for plugin, dist in pm.list_plugin_distinfo():
                dists[pm.get_name(plugin)] = (dist.metadata["name"], dist.version)
            self._call_impls(pm.hook.register_backends.get_hookimpls(), dists)
            self._loaded = True

    def _call_impls(self, impls: list[pluggy.HookImpl], dists: Mapping[str | None, tuple[str, str]]) -> None:
        assert self._pm is not None
        for impl in impls:
            plugin_name = self._pm.get_name(impl.plugin) or repr(impl.plugin)
            dist, version = dists.get(plugin_name, (None, None))

            def register(
                name: str,
                target: str | type,
                *,
                api_version: int = hookspecs.HOOK_API_VERSION,
                priority: int = 0,
                install: str | None = None,
                _plugin: str = plugin_name,
                _dist: str | None = dist,
                _version: str | None = version,
            ) -> None:
                self._register(
                    name,
                    target,
                    plugin=_plugin,
                    api_version=api_version,
                    priority=priority,
                    install=install,
                    distribution=_dist,
                    version=_version,
                )

            try:
                impl.function(register=register)
            except Exception as exc:  # recorded: the other plugins still register
                self._problems.append(
                    Problem(plugin_name, "register_backends", f"{type(exc).__name__}: {exc}", traceback.format_exc())
                )

    def call_hook(self, hook: str, **kwargs: Any) -> None:
        """Call hook ``hook`` of every loaded plugin with ``kwargs``, one plugin at a time.

        For hooks other than ``register_backends`` (which loading calls), such as
        ``register_commands``: a plugin whose implementation raises is recorded in
        :meth:`problems` (stage: the hook's name) and the other plugins still run.
        """
        with self._lock:
            self._ensure_loaded()
            assert self._pm is not None
            for impl in getattr(self._pm.hook, hook).get_hookimpls():
                plugin_name = self._pm.get_name(impl.plugin) or repr(impl.plugin)
                try:
                    impl.function(**{k: kwargs[k] for k in impl.argnames})
                except Exception as exc:  # recorded: the other plugins' hooks still run
                    problem = Problem(plugin_name, hook, f"{type(exc).__name__}: {exc}", traceback.format_exc())
                    # Once, however often the hook is called (a process may build several parsers).
                    if not any(
                        (p.source, p.stage, p.message) == (problem.source, problem.stage, problem.message)
                        for p in self._problems
                    ):
                        self._problems.append(problem)

    def _register(
        self,
        name: str,
        target: str | type,
        *,
        plugin: str,
        api_version: int,
        priority: int,
        install: str | None,
        distribution: str | None,
        version: str | None,
    ) -> None:
        def problem(msg: str) -> None:
            self._problems.append(Problem(plugin, "register", msg))

        if not isinstance(name, str) or not _NAME.match(name):
            return problem(
                f"register_backends(register) was called with name {name!r}; accepted: lowercase "
                "words joined by '-', such as 'triton-unified'"
            )
        if not isinstance(api_version, int) or isinstance(api_version, bool):
            return problem(
                f"backend {name!r}: register(..., api_version={api_version!r}) is not an int; accepted: "
                f"an int up to {hookspecs.HOOK_API_VERSION} (pass paged_core.hookspecs.HOOK_API_VERSION)"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            return problem(f"backend {name!r}: register(..., priority={priority!r}); accepted: an int")
        if install is not None and not isinstance(install, str):
            return problem(
                f"backend {name!r}: register(..., install={install!r}); accepted: None or the install command as a str"
            )
        if api_version > hookspecs.HOOK_API_VERSION:
            return problem(
                f"backend {name!r} was written for hook API {api_version}, but this paged-core speaks "
                f"{hookspecs.HOOK_API_VERSION}; upgrade paged-core ({pip_install('-U paged-core')})"
            )
        if not (isinstance(target, str) and ":" in target) and not isinstance(target, type):
            return problem(
                f"backend {name!r} target is {target!r}; accepted: 'module.path:ClassName' or a Backend subclass"
            )
        if isinstance(target, type) and not issubclass(target, Backend):
            return problem(f"backend {name!r} target {target.__qualname__} is not a paged_core.Backend subclass")
        if name in self._regs:
            first = self._regs[name]
            return problem(
                f"backend {name!r} is already registered by plugin {first.plugin!r}; keeping that one "
                f"and ignoring {plugin!r}'s (uninstall one of them)"
            )
        self._regs[name] = Registration(
            name,
            target,
            plugin,
            priority,
            install,
            distribution,
            version,
            cls=target if isinstance(target, type) else None,
        )

    def _resolve(self, reg: Registration) -> type[Backend] | None:
        """Import a registration's class on first use; record and remember a failure."""
        with self._lock:
            if reg.cls is not None or reg.error is not None:
                return reg.cls
            # A class target is its own ``cls`` from registration on, so only a path gets here.
            module_name, _, attr = cast(str, reg.target).partition(":")
            try:
                obj = importlib.import_module(module_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:
                reg.error = f"importing {reg.target} failed: {type(exc).__name__}: {exc}"
                self._problems.append(Problem(reg.name, "backend", reg.error, traceback.format_exc()))
                return None
            if not (isinstance(obj, type) and issubclass(obj, Backend)):
                reg.error = f"{reg.target} is {obj!r}, not a paged_core.Backend subclass"
                self._problems.append(Problem(reg.name, "backend", reg.error))
                return None
            if obj.name != reg.name:
                reg.error = f"{reg.target} has name {obj.name!r} but was registered as {reg.name!r}"
                self._problems.append(Problem(reg.name, "backend", reg.error))
                return None
            reg.cls = obj
            return obj

    # ----------------------------------------------------------------------------- queries
    def _sorted(self) -> list[Registration]:
        self._ensure_loaded()
        return sorted(self._regs.values(), key=lambda r: (-r.priority, r.name))

    def names(self) -> list[str]:
        """Every registered backend name, best first (by priority), loaded or not."""
        with self._lock:
            return [r.name for r in self._sorted()]

    def registration(self, name: str) -> Registration:
        with self._lock:
            self._ensure_loaded()
            if not isinstance(name, str):
                installed = ", ".join(r.name for r in self._sorted()) or "none"
                raise InputError(
                    f"backend name is {name!r} (a {type(name).__name__}); accepted: a backend name "
                    f"as a str, one of: {installed}"
                )
            if name not in self._regs:
                raise BackendNotFoundError(self._not_found(name))
            return self._regs[name]

    def backend_class(self, name: str) -> type[Backend]:
        """The class of backend ``name``, imported now; raises if it cannot be imported."""
        reg = self.registration(name)
        cls = self._resolve(reg)
        if cls is None:
            raise BackendUnavailableError(
                f"Backend {name!r} (plugin {reg.plugin!r}) cannot be loaded: {reg.error}. To fix: {reg.install_hint}"
            )
        return cls

    def unavailable(self, name: str) -> list[str]:
        """Why backend ``name`` cannot run on this machine at all (empty: it can)."""
        reg = self.registration(name)
        cls = self._resolve(reg)
        if cls is None:
            return [f"{reg.error} (to fix: {reg.install_hint})"]
        try:
            return list(cls.unavailable())
        except Exception as exc:  # a buggy availability probe is a problem, not a crash
            return [f"{name}.unavailable() raised {type(exc).__name__}: {exc}"]

    def capabilities(self, name: str) -> Capabilities | None:
        cls = self._resolve(self.registration(name))
        return None if cls is None else cls.capabilities

    def get(self, name: str, **options: Any) -> Backend:
        """An instance of backend ``name`` with constructor ``options``.

        Raises :class:`BackendNotFoundError` for an unknown name and
        :class:`BackendUnavailableError` when it cannot run here, each saying what to install.
        """
        cls = self.backend_class(name)
        reasons = self.unavailable(name)
        if reasons:
            raise BackendUnavailableError(f"Backend {name!r} cannot run on this machine: " + "; ".join(reasons))
        accepted = _options_of(cls)
        unknown = sorted(options) if accepted is None else sorted(set(options) - set(accepted))
        if accepted is not None and unknown:
            raise InputError(
                f"Backend {name!r} does not accept options {unknown}; accepted: {', '.join(accepted) or 'none'} "
                "(check the spelling)"
            )
        try:
            return self._instance(cls, **options)
        except TypeError as exc:
            raise InputError(
                f"Backend {name!r} does not accept options {sorted(options)}: {exc}"
                + (f"; accepted: {', '.join(accepted)}" if accepted else "")
            ) from exc

    def _instance(self, cls: type[Backend], **options: Any) -> Backend:
        """``cls(**options)``; a backend that composes others (auto) gets this registry to choose from."""
        accepted = _options_of(cls)
        if accepted is not None and "registry" in accepted and "registry" not in options:
            options = {**options, "registry": self}
        return cls(**options)

    def explain(self, spec: AttentionSpec | None = None) -> dict[str, list[str]]:
        """Every backend with the reasons it cannot serve ``spec`` (empty list: it can)."""
        if spec is not None and not isinstance(spec, AttentionSpec):
            raise InputError(
                f"spec is a {type(spec).__name__}; accepted: a paged_core.AttentionSpec (or None for "
                "every backend that can run here)"
            )
        out = {}
        for reg in self._sorted_locked():
            reasons = self.unavailable(reg.name)
            if not reasons and spec is not None:
                reasons = self._instance(reg.cls).reasons(spec) if reg.cls else []
            out[reg.name] = reasons
        return out

    def _sorted_locked(self) -> list[Registration]:
        with self._lock:
            return self._sorted()

    def available(self, spec: AttentionSpec | None = None) -> list[str]:
        """Names of the backends that can run here (and serve ``spec`` if given), best first."""
        return [name for name, reasons in self.explain(spec).items() if not reasons]

    def select(self, spec: AttentionSpec, **options: Any) -> Backend:
        """The highest-priority backend that serves ``spec`` on this machine."""
        explained = self.explain(spec)
        for name, reasons in explained.items():
            if not reasons:
                return self.get(name, **options)
        lines = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in explained.items())
        raise BackendNotFoundError(f"No installed backend can run {spec.describe()}:\n{lines}")

    def left_out(self) -> list[str]:
        """The installed plugins (entry-point names) that ``PAGED_PLUGINS`` kept from loading."""
        with self._lock:
            self._ensure_loaded()
            return list(self._skipped)

    def not_installed(self) -> dict[str, str]:
        """This project's backends (``FIRST_PARTY``) whose plugin is not installed here, each with
        the command that installs it, in ``FIRST_PARTY``'s order.

        Not installed is neither left out by ``PAGED_PLUGINS`` (:meth:`left_out`; pip install
        would change nothing) nor broken (:meth:`problems`): its entry point is absent. A
        registry of another entry-point group has backends of its own, so none are missing.
        """
        with self._lock:
            self._ensure_loaded()
            if self.group != hookspecs.PROJECT:
                return {}
            return {
                name: install
                for name, install in FIRST_PARTY.items()
                if name not in self._regs and name not in self._entry_points
            }

    def narrowing(self) -> str:
        """How the narrowing variable is set, for messages: ``PAGED_PLUGINS=' , '``."""
        return f"{self.env_var}={os.environ.get(self.env_var, '')!r}"

    def problems(self) -> list[Problem]:
        """Plugins and backends that failed to load, each with its error."""
        with self._lock:
            self._ensure_loaded()
            return list(self._problems)

    def _not_found(self, name: str) -> str:
        installed = ", ".join(r.name for r in self._sorted()) or "none"
        msg = f"Unknown backend {name!r}. Installed: {installed}."
        # Installed is not loaded: for a plugin that PAGED_PLUGINS left out, "pip install" is
        # the wrong advice.
        narrowed = self.narrowing()
        if name in self._skipped:
            msg += (
                f" Its plugin {name!r} is installed but {narrowed} leaves it out: add it to "
                f"{self.env_var}, or unset {self.env_var}."
            )
        elif name in FIRST_PARTY:
            msg += f" To install it: {FIRST_PARTY[name]}."
        else:
            import difflib

            close = difflib.get_close_matches(name, list(self._regs) + list(FIRST_PARTY) + self._skipped, n=1)
            if close:
                msg += f" Did you mean {close[0]!r}?"
            missing = self.not_installed()
            if missing:
                msg += " Not installed: " + ", ".join(f"{n} ({cmd})" for n, cmd in missing.items()) + "."
            if self._skipped:
                msg += f" Installed but left out by {narrowed}: {', '.join(self._skipped)}."
        for p in self._problems:
            msg += f"\nPlugin problem: {p}"
        return msg


def _options_of(cls: type[Backend]) -> list[str] | None:
    """The keyword options ``cls`` takes, or None when it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


#: The process-wide registry of installed backends.
registry = Registry()
