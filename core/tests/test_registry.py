"""The registry: a real installed plugin distribution, broken plugins, fake plugins, threads.

Every test builds its own ``Registry()`` (nothing leaks between tests) and narrows loading with
``PAGED_PLUGINS`` to the reference and the fixture plugins (see conftest.py), so plugins that
happen to be installed in the environment do not change the expected results.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading

import paged_core
import pluggy
import pytest
import torch
from paged_core import (
    HOOK_API_VERSION,
    AttentionSpec,
    Backend,
    BackendNotFoundError,
    BackendUnavailableError,
    BatchMeta,
    InputError,
    ReferenceBackend,
    Registry,
    hookimpl,
    hookspecs,
)

SPEC16 = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
SPEC32 = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
MISSING_CAUSE = (
    "importing paged_fixture_good.missing:MissingBackend failed: ModuleNotFoundError: "
    "No module named 'paged_fixture_extra_dependency_that_is_not_installed'"
)

#: How every install hint for one of paged's own distributions says where its wheels come from.
WHEELS = " (build dist/ in a clone of paged: python3 -m nox -s wheels)"


# ---------------------------------------------------------------------------------- real plugin
def test_real_plugin_is_discovered_and_loaded_lazily(fixture_plugins):
    reg = Registry()
    assert "paged_fixture_good" not in sys.modules
    # Best first: fixture-good (priority 5), fixture-missing (0), reference (-100).
    assert reg.names() == ["fixture-good", "fixture-missing", "reference", "auto"]
    # The entry point's module is imported to call its hook; the backend modules are not.
    assert "paged_fixture_good" in sys.modules
    assert "paged_fixture_good.backend" not in sys.modules
    assert "paged_fixture_good.missing" not in sys.modules

    r = reg.registration("fixture-good")
    assert (r.plugin, r.distribution, r.version, r.priority) == (
        "fixture-good",
        "paged-fixture-plugins",
        "0.3.1",
        5,
    )
    assert r.target == "paged_fixture_good.backend:GoodBackend" and r.cls is None
    ref = reg.registration("reference")
    assert (ref.distribution, ref.version, ref.priority) == ("paged-core", paged_core.__version__, -100)

    backend = reg.get("fixture-good", tag="chosen")
    assert "paged_fixture_good.backend" in sys.modules
    cls = sys.modules["paged_fixture_good.backend"].GoodBackend
    assert type(backend) is cls and backend.tag == "chosen" and backend.name == "fixture-good"
    assert reg.registration("fixture-good").cls is cls
    assert reg.get("fixture-good").tag == "default"
    assert "paged_fixture_good.missing" not in sys.modules  # still never asked for

    # It computes (it is a narrowed reference) through the public forward.
    meta = BatchMeta.build([2, 1], [5, 9], block_size=16)
    cache = backend.allocate(4, 16, 2, 16, dtype=torch.float32)
    backend.write(cache, torch.randn(3, 2, 16), torch.randn(3, 2, 16), meta)
    q = torch.randn(3, 4, 16)
    assert torch.equal(backend.forward(q, cache, meta), ReferenceBackend().forward(q, cache, meta))


def test_get_rejects_unknown_options(fixture_plugins):
    with pytest.raises(InputError, match=r"Backend 'fixture-good' does not accept options \['bogus'\]"):
        Registry().get("fixture-good", bogus=1)


def test_broken_plugins_are_reported_and_skipped(fixture_plugins):
    reg = Registry()
    problems = {p.source: p for p in reg.problems()}
    assert set(problems) == {"fixture-broken", "fixture-badhook"}

    imp = problems["fixture-broken"]
    assert imp.stage == "import"
    assert imp.message == (
        "ImportError: paged_fixture_broken needs libfixture.so.3, which is not installed (simulated)"
    )
    assert imp.traceback.startswith("Traceback (most recent call last)")
    assert "paged_fixture_broken" in imp.traceback and "__init__.py" in imp.traceback
    assert str(imp) == f"fixture-broken (import): {imp.message}"

    hook = problems["fixture-badhook"]
    assert hook.stage == "register_backends"
    assert hook.message == "RuntimeError: fixture-badhook exploded while registering"
    assert "raise RuntimeError" in hook.traceback

    # The others still work.
    assert reg.names() == ["fixture-good", "fixture-missing", "reference", "auto"]
    assert isinstance(reg.get("reference"), ReferenceBackend)
    assert reg.get("fixture-good").name == "fixture-good"


def test_get_of_a_broken_backend_names_cause_and_fix(fixture_plugins):
    reg = Registry()
    with pytest.raises(BackendUnavailableError) as exc:
        reg.get("fixture-missing")
    assert str(exc.value) == (
        f"Backend 'fixture-missing' (plugin 'fixture-good') cannot be loaded: {MISSING_CAUSE}. "
        "To fix: pip install paged-fixture-extra"
    )
    assert isinstance(exc.value, LookupError)
    late = [p for p in reg.problems() if p.source == "fixture-missing"]
    assert len(late) == 1 and late[0].stage == "backend" and late[0].message == MISSING_CAUSE
    assert "ModuleNotFoundError" in late[0].traceback
    # Asking again neither re-imports nor records the problem twice.
    with pytest.raises(BackendUnavailableError):
        reg.get("fixture-missing")
    assert len([p for p in reg.problems() if p.source == "fixture-missing"]) == 1
    assert reg.unavailable("fixture-missing") == [f"{MISSING_CAUSE} (to fix: pip install paged-fixture-extra)"]
    assert reg.capabilities("fixture-missing") is None


def test_paged_plugins_narrows_loading(fixture_plugins, monkeypatch):
    monkeypatch.setenv("PAGED_PLUGINS", "reference")
    reg = Registry()
    assert reg.names() == ["reference", "auto"] and reg.problems() == []
    assert "paged_fixture_good" not in sys.modules and "paged_fixture_broken" not in sys.modules

    monkeypatch.setenv("PAGED_PLUGINS", " fixture-good , fixture-broken ")
    reg = Registry()
    assert reg.names() == ["fixture-good", "fixture-missing"]
    assert [p.source for p in reg.problems()] == ["fixture-broken"]

    monkeypatch.delenv("PAGED_PLUGINS")
    reg = Registry()
    assert {"fixture-good", "fixture-missing", "reference"} <= set(reg.names())
    assert {"fixture-broken", "fixture-badhook"} <= {p.source for p in reg.problems()}


def test_reload_rediscovers(fixture_plugins, monkeypatch):
    monkeypatch.setenv("PAGED_PLUGINS", "reference")
    reg = Registry()
    assert reg.names() == ["reference", "auto"]
    monkeypatch.setenv("PAGED_PLUGINS", "reference,fixture-good")
    assert reg.names() == ["reference", "auto"]  # loaded once, cached
    reg.reload()
    assert reg.names() == ["fixture-good", "fixture-missing", "reference", "auto"]


@pytest.mark.parametrize(
    ("name", "needles"),
    [
        (
            "nope",
            [
                "Unknown backend 'nope'. Installed: fixture-good, fixture-missing, reference, auto.",
                "Not installed: triton-unified (pip install --find-links dist 'paged-core[triton]'" + WHEELS + ")",
                "flashinfer (pip install --find-links dist 'paged-core[flashinfer]'" + WHEELS + ")",
                "Plugin problem: fixture-broken (import): ImportError: paged_fixture_broken needs libfixture.so.3",
            ],
        ),
        ("refrence", ["Unknown backend 'refrence'.", "Did you mean 'reference'?"]),
        ("fixture-god", ["Did you mean 'fixture-good'?"]),
        (
            "flashinfr",
            [
                "Did you mean 'flashinfer'?",
                "flashinfer (pip install --find-links dist 'paged-core[flashinfer]'" + WHEELS + ")",
            ],
        ),
        (
            "triton-unified",
            [
                "Unknown backend 'triton-unified'.",
                "To install it: pip install --find-links dist 'paged-core[triton]'" + WHEELS + ".",
            ],
        ),
    ],
)
def test_unknown_backend_message(fixture_plugins, name, needles):
    # The fixture narrows PAGED_PLUGINS, so a first-party plugin installed in this environment is
    # left out, not missing: its install advice is replaced (see the next test).
    import importlib.metadata

    installed = {ep.name for ep in importlib.metadata.entry_points(group="paged_core")}
    for n in {"triton-unified", "flashinfer"} & installed:
        if name == n:
            needles = [f"Unknown backend '{n}'.", f"Its plugin '{n}' is installed but PAGED_PLUGINS="]
        needles = [x for x in needles if not x.startswith((f"Not installed: {n} (", f"{n} (pip install"))]
    with pytest.raises(BackendNotFoundError) as exc:
        Registry().get(name)
    msg = str(exc.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert isinstance(exc.value, LookupError)
    if name == "nope":
        assert "Did you mean" not in msg


def test_unknown_backend_left_out_by_paged_plugins_is_not_called_missing(fixture_plugins, monkeypatch):
    # It used to say "Installed: reference" and suggest pip-installing what is installed.
    monkeypatch.setenv("PAGED_PLUGINS", "reference")
    with pytest.raises(BackendNotFoundError) as exc:
        Registry().get("fixture-good")
    assert (
        "Its plugin 'fixture-good' is installed but PAGED_PLUGINS='reference' leaves it out: "
        "add it to PAGED_PLUGINS, or unset PAGED_PLUGINS."
    ) in str(exc.value)
    with pytest.raises(BackendNotFoundError) as exc:
        Registry().get("fixture-gooood")
    msg = str(exc.value)
    assert "Did you mean 'fixture-good'?" in msg
    assert "Installed but left out by PAGED_PLUGINS='reference': " in msg and "fixture-good" in msg


# ---------------------------------------------------------------------------------- specs
def test_select_explain_available(fixture_plugins):
    reg = Registry()
    missing_reason = f"{MISSING_CAUSE} (to fix: pip install paged-fixture-extra)"
    assert reg.explain(SPEC16) == {"fixture-good": [], "fixture-missing": [missing_reason], "reference": [], "auto": []}
    assert reg.available(SPEC16) == ["fixture-good", "reference", "auto"]
    assert reg.select(SPEC16).name == "fixture-good"

    assert reg.explain(SPEC32) == {
        "fixture-good": ["head_dim 32 is not supported (accepted: 16)"],
        "fixture-missing": [missing_reason],
        "reference": [],
        # auto serves what one of its backends serves (here the reference).
        "auto": [],
    }
    assert reg.available(SPEC32) == ["reference", "auto"]
    chosen = reg.select(SPEC32, compute_dtype=torch.float64)
    assert type(chosen) is ReferenceBackend and chosen.compute_dtype == torch.float64
    assert reg.available() == ["fixture-good", "reference", "auto"]  # runnable here, any spec


def test_select_with_nothing_that_fits_explains_each_backend(fixture_plugins):
    spec = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=16, block_size=16, dtype=torch.float32)
    with pytest.raises(BackendNotFoundError) as exc:
        Registry().select(spec)
    lines = str(exc.value).splitlines()
    assert lines[0] == "No installed backend can run 6/4x16 bs16 float32 cpu:"
    assert lines[1].startswith("  fixture-good: num_heads 6 is not a multiple of num_kv_heads 4")
    assert lines[2].startswith("  fixture-missing: importing paged_fixture_good.missing:MissingBackend failed")
    assert lines[3].startswith("  reference: num_heads 6 is not a multiple of num_kv_heads 4")


# ---------------------------------------------------------------------------------- fake plugins
class FakePlugin:
    """An in-process plugin calling ``register`` with whatever arguments a test gives it."""

    def __init__(self, *calls, fail: Exception | None = None):
        self.calls = calls
        self.fail = fail

    @hookimpl
    def register_backends(self, register):
        for args, kwargs in self.calls:
            register(*args, **kwargs)
        if self.fail:
            raise self.fail


class Tiny(ReferenceBackend):
    name = "tiny"


class NotABackend:
    name = "not-a-backend"


class Misnamed(ReferenceBackend):
    name = "something-else"


@pytest.fixture
def reference_only(monkeypatch):
    """A fresh registry with only the reference loaded from entry points."""
    monkeypatch.setenv("PAGED_PLUGINS", "reference")
    return Registry()


def call(*args, **kwargs):
    return (args, kwargs)


def problems_of(reg, source):
    return [p for p in reg.problems() if p.source == source]


def test_fake_plugin_with_a_class_target(reference_only):
    reg = reference_only
    reg.add_plugin(FakePlugin(call("tiny", Tiny, priority=3)), name="fake")
    assert reg.names() == ["tiny", "reference", "auto"]
    r = reg.registration("tiny")
    assert r.cls is Tiny and r.plugin == "fake" and r.distribution is None
    assert r.install_hint == "pip install fake"
    assert type(reg.get("tiny")) is Tiny
    assert reg.problems() == []


def test_duplicate_name_keeps_the_first(reference_only):
    reg = reference_only
    reg.add_plugin(FakePlugin(call("reference", Tiny)), name="impostor")
    assert reg.names() == ["reference", "auto"]
    assert type(reg.get("reference")) is ReferenceBackend
    (p,) = problems_of(reg, "impostor")
    assert p.stage == "register"
    assert p.message == (
        "backend 'reference' is already registered by plugin 'reference'; keeping that one "
        "and ignoring 'impostor''s (uninstall one of them)"
    )


def test_newer_hook_api_is_refused_with_a_message(reference_only):
    reg = reference_only
    reg.add_plugin(FakePlugin(call("tiny", Tiny, api_version=HOOK_API_VERSION + 1)), name="future")
    assert "tiny" not in reg.names()
    (p,) = problems_of(reg, "future")
    assert p.message == (
        f"backend 'tiny' was written for hook API {HOOK_API_VERSION + 1}, but this paged-core speaks "
        f"{HOOK_API_VERSION}; upgrade paged-core (pip install --find-links dist -U paged-core{WHEELS})"
    )
    # The current version (and older ones) are accepted.
    reg.add_plugin(FakePlugin(call("tiny", Tiny, api_version=HOOK_API_VERSION)), name="now")
    assert "tiny" in reg.names()


@pytest.mark.parametrize("bad", ["Tiny", "has space", "", "trailing-", "under_score", "-lead", 42, None])
def test_bad_names_are_refused(reference_only, bad):
    reg = reference_only
    reg.add_plugin(FakePlugin(call(bad, Tiny)), name="badname")
    assert reg.names() == ["reference", "auto"]
    (p,) = problems_of(reg, "badname")
    assert p.message == (
        f"register_backends(register) was called with name {bad!r}; accepted: lowercase "
        "words joined by '-', such as 'triton-unified'"
    )


def test_good_names_are_accepted(reference_only):
    reg = reference_only
    reg.add_plugin(FakePlugin(call("flash-attn2", Tiny), call("x", Tiny), call("a-b-c", Tiny)), name="ok")
    assert set(reg.names()) == {"flash-attn2", "x", "a-b-c", "reference", "auto"}


def test_non_backends_are_refused(reference_only):
    reg = reference_only
    reg.add_plugin(
        FakePlugin(call("not-a-backend", NotABackend), call("no-colon", "paged_core.plugin"), call("an-int", 42)),
        name="wrong",
    )
    assert reg.names() == ["reference", "auto"]
    msgs = [p.message for p in problems_of(reg, "wrong")]
    assert msgs == [
        "backend 'not-a-backend' target NotABackend is not a paged_core.Backend subclass",
        "backend 'no-colon' target is 'paged_core.plugin'; accepted: 'module.path:ClassName' or a Backend subclass",
        "backend 'an-int' target is 42; accepted: 'module.path:ClassName' or a Backend subclass",
    ]


def test_dotted_path_to_a_non_backend_fails_on_get(reference_only):
    reg = reference_only
    reg.add_plugin(
        FakePlugin(
            call("lazy-wrong", "paged_core._cache:KVCache"),
            call("lazy-misnamed", f"{__name__}:Misnamed"),
            call("lazy-nothing", "paged_core:NoSuchThing"),
        ),
        name="lazy",
    )
    assert {"lazy-wrong", "lazy-misnamed", "lazy-nothing"} <= set(reg.names())  # registered by path
    with pytest.raises(
        BackendUnavailableError,
        match=r"paged_core._cache:KVCache is <class "
        r"'paged_core._cache.KVCache'>, not a paged_core.Backend subclass. To fix: pip install lazy",
    ):
        reg.get("lazy-wrong")
    with pytest.raises(
        BackendUnavailableError, match=r"has name 'something-else' but was registered as 'lazy-misnamed'"
    ):
        reg.get("lazy-misnamed")
    with pytest.raises(
        BackendUnavailableError, match=r"AttributeError: module 'paged_core' has no attribute 'NoSuchThing'"
    ):
        reg.get("lazy-nothing")
    assert reg.available() == ["reference", "auto"]
    assert {"lazy-wrong", "lazy-misnamed", "lazy-nothing"} <= {p.source for p in reg.problems()}


def test_a_raising_hook_keeps_what_others_registered(reference_only):
    reg = reference_only
    reg.add_plugin(FakePlugin(fail=ValueError("boom")), name="raiser")
    reg.add_plugin(FakePlugin(call("tiny", Tiny)), name="fine")
    assert reg.names() == ["tiny", "reference", "auto"]
    (p,) = problems_of(reg, "raiser")
    assert p.stage == "register_backends" and p.message == "ValueError: boom"
    assert "ValueError: boom" in p.traceback


def test_a_plugin_with_a_wrong_hook_signature_is_named(reference_only):
    class WrongSignature:
        @hookimpl
        def register_backends(self, register, backend_list):
            pass

    with pytest.raises(pluggy.PluginValidationError) as exc:
        reference_only.add_plugin(WrongSignature(), name="wrong-sig")
    msg = str(exc.value)
    assert "wrong-sig" in msg and "register_backends" in msg and "backend_list" in msg
    assert reference_only.names() == ["reference", "auto"]


def test_unavailable_probe_that_raises_is_a_reason(reference_only):
    class Flaky(ReferenceBackend):
        name = "flaky"

        @classmethod
        def unavailable(cls):
            raise OSError("driver not loaded")

    reg = reference_only
    reg.add_plugin(FakePlugin(call("flaky", Flaky)), name="flaky-plugin")
    assert reg.unavailable("flaky") == ["flaky.unavailable() raised OSError: driver not loaded"]
    assert reg.available() == ["reference", "auto"]
    with pytest.raises(
        BackendUnavailableError,
        match="Backend 'flaky' cannot run on this machine: flaky.unavailable\\(\\) raised OSError: driver not loaded",
    ):
        reg.get("flaky")


# ---------------------------------------------------------------------------------- threads
def test_concurrent_access_is_safe_and_consistent(fixture_plugins):
    reg = Registry()  # not loaded yet: the threads race to load it
    n = 8
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def work(i):
        try:
            barrier.wait()
            names = reg.names() if i % 2 else None
            good = reg.get("fixture-good")
            ref = reg.get("reference")
            names = names or reg.names()
            with pytest.raises(BackendUnavailableError):
                reg.get("fixture-missing")
            results[i] = (
                names,
                type(good),
                type(ref),
                sorted(p.source for p in reg.problems()),
                reg.available(SPEC16),
            )
        except BaseException as exc:  # report it from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    names, good_cls, ref_cls, problems, avail = results[0]
    assert names == ["fixture-good", "fixture-missing", "reference", "auto"]
    assert good_cls.__module__ == "paged_fixture_good.backend" and ref_cls is ReferenceBackend
    # Loaded once: each broken plugin and the broken backend recorded exactly once.
    assert problems == ["fixture-badhook", "fixture-broken", "fixture-missing"]
    assert avail == ["fixture-good", "reference", "auto"]
    assert all(r == results[0] for r in results)


# ---------------------------------------------------------------------------------- hookspecs
def test_every_hookspec_is_documented():
    specs = {
        name: obj
        for name, obj in vars(hookspecs).items()
        if callable(obj) and hasattr(obj, f"{hookspecs.PROJECT}_spec")
    }
    assert "register_backends" in specs
    for name, fn in specs.items():
        doc = inspect.getdoc(fn)
        assert doc and len(doc) > 80, f"hookspec {name} has no real docstring"
        for param in inspect.signature(fn).parameters:
            assert param in doc, f"hookspec {name}'s docstring does not mention its argument {param!r}"
    assert isinstance(HOOK_API_VERSION, int) and HOOK_API_VERSION >= 1
    assert hookspecs.PROJECT == "paged_core"


def test_the_reference_registers_through_the_hook():
    from paged_core import plugin

    calls = []
    plugin.register_backends(register=lambda *a, **k: calls.append((a, k)))
    assert calls == [
        (("reference", "paged_core._reference:ReferenceBackend"), {"priority": -100}),
        (("auto", "paged_core._auto:AutoBackend"), {"priority": -200}),
    ]
    assert issubclass(ReferenceBackend, Backend)


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [None, 123, ["reference"]])
def test_get_of_a_name_that_is_not_a_str(reference_only, bad):
    # Used to reach difflib and raise its TypeError.
    with pytest.raises(InputError) as exc:
        reference_only.get(bad)
    assert f"backend name is {bad!r}" in str(exc.value)
    assert "accepted: a backend name as a str, one of: reference" in str(exc.value)


@pytest.mark.parametrize("bad", ["no", 1, 0, "true"])
def test_validate_option_must_be_a_bool(reference_only, bad):
    # validate="no" used to turn validation on (a non-empty string is truthy).
    with pytest.raises(InputError, match=rf"validate is {bad!r}; accepted: True, False, or None"):
        reference_only.get("reference", validate=bad)
    assert reference_only.get("reference", validate=False).validate is False
    assert reference_only.get("reference", validate=True).validate is True


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(api_version="2"), "register(..., api_version='2') is not an int"),
        (dict(api_version=1.0), "register(..., api_version=1.0) is not an int"),
        (dict(priority="high"), "register(..., priority='high'); accepted: an int"),
        (dict(install=["pip"]), "register(..., install=['pip']); accepted: None or the install command"),
    ],
)
def test_register_arguments_of_the_wrong_type_are_problems(reference_only, kwargs, needle):
    # api_version="2" used to raise a raw TypeError from the comparison.
    reg = reference_only
    reg.add_plugin(FakePlugin(call("tiny", Tiny, **kwargs)), name="typed")
    assert "tiny" not in reg.names()
    (p,) = problems_of(reg, "typed")
    assert p.stage == "register" and needle in p.message, p.message


def test_a_typo_in_paged_plugins_is_a_problem(monkeypatch):
    monkeypatch.setenv("PAGED_PLUGINS", "reference,refrence")
    reg = Registry()
    assert reg.names() == ["reference", "auto"]
    (p,) = problems_of(reg, "refrence")
    assert p.stage == "PAGED_PLUGINS"
    assert "PAGED_PLUGINS names 'refrence', but no installed plugin has that entry point" in p.message
    assert "reference" in p.message.split("installed:")[1]


def test_auto_in_paged_plugins_names_the_plugin_that_registers_it(monkeypatch):
    # PAGED_PLUGINS names plugins; auto is a backend of paged-core's plugin "reference".
    monkeypatch.setenv("PAGED_PLUGINS", "auto")
    reg = Registry()
    assert reg.names() == []
    (p,) = problems_of(reg, "auto")
    assert "'auto' is a backend of plugin 'reference' (paged-core's): name that plugin" in p.message


@pytest.mark.parametrize("bad", [{"num_heads": 4}, "4/2x16"])
def test_explain_and_select_of_something_that_is_not_a_spec(reference_only, bad):
    # select() used to raise an AttributeError from spec.describe().
    for call_ in (reference_only.explain, reference_only.select, reference_only.available):
        with pytest.raises(InputError, match=f"spec is a {type(bad).__name__}; accepted: a paged_core.AttentionSpec"):
            call_(bad)


def test_a_triton_backend_on_a_cpu_without_the_interpreter_is_unavailable_everywhere():
    # Without TRITON_INTERPRET=1, `paged list` showed triton-unified "available ... cpu,cuda",
    # get() and write() succeeded, and forward raised. One answer now: list, get, select.
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the Triton backends run compiled")
    code = "\n".join(
        [
            "import json, torch",
            "from paged_core import AttentionSpec, BackendUnavailableError, registry",
            "from paged_core._cli import main",
            "out = {}",
            "for name in ('triton-unified', 'triton-splitkv'):",
            "    try:",
            "        registry.get(name)",
            "        out[name] = 'got'",
            "    except BackendUnavailableError as exc:",
            "        out[name] = str(exc)",
            "spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)",
            "out['select'] = registry.select(spec).name",
            "out['available'] = registry.available()",
            "print(json.dumps(out))",
            "main(['list'])",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PAGED_PLUGINS"] = "reference,triton-unified,triton-splitkv"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first, _, listing = proc.stdout.partition("\n")
    got = json.loads(first)
    for name in ("triton-unified", "triton-splitkv"):
        assert "cannot run on this machine" in got[name] and "TRITON_INTERPRET=1" in got[name], got[name]
        assert name not in got["available"]
        row = next(line for line in listing.splitlines() if line.startswith(name))
        assert "unavailable" in row, listing
    assert "set TRITON_INTERPRET=1" in listing
    assert got["select"] == "reference"
