"""Shared fixtures of paged-core's own tests.

``plugin_site``: the tiny real plugin distribution in ``core/tests/fixtures/paged-fixture-plugins``,
installed once per session with pip into a temporary ``--target`` directory, which
``fixture_plugins`` puts on ``sys.path`` for one test at a time. That is a real install (a wheel
built by setuptools, a ``.dist-info`` with ``entry_points.txt``), found by ``importlib.metadata``
like any other, without touching the shared virtualenv (other processes using it never see the
deliberately broken fixture plugins).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton runs on a CPU only under its interpreter, which it reads when kernels are defined:
# set it here, before any test module imports a Triton backend.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FIXTURES = Path(__file__).parent / "fixtures"
# The fixture plugins are installed, not collected: with --doctest-modules pytest would import
# them (one raises on import on purpose). Nor is this file: as a doctest module it is imported as
# plain "conftest", which clashes with any other conftest.py collected in the same run.
collect_ignore = ["fixtures", "conftest.py"]
FIXTURE_DIST = FIXTURES / "paged-fixture-plugins"
FIXTURE_MODULES = ("paged_fixture_good", "paged_fixture_broken", "paged_fixture_badhook")
#: The entry points a test registry loads: the reference and the fixture plugins, never whatever
#: else happens to be installed in the environment running the tests.
FIXTURE_PLUGINS = "reference,fixture-good,fixture-broken,fixture-badhook"


def _forget_fixture_modules() -> None:
    for mod in list(sys.modules):
        if mod.split(".")[0] in FIXTURE_MODULES:
            del sys.modules[mod]


#: PAGED_PLUGINS as the session started (tests narrow it with monkeypatch).
_SESSION_PLUGINS = os.environ.get("PAGED_PLUGINS")


@pytest.fixture(autouse=True)
def _process_registry_forgets_a_narrowed_environment(monkeypatch):
    """The process-wide registry loads once, with the PAGED_PLUGINS of its first use: a test that
    narrows the variable and reaches it would leave every later test in the process with that
    narrowed registry. After such a test it discovers again (while the test's environment is
    still set: this fixture depends on ``monkeypatch``, so it is torn down first)."""
    yield
    if os.environ.get("PAGED_PLUGINS") != _SESSION_PLUGINS:
        import paged_core

        paged_core.registry.reload()


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """Install the fixture plugin distribution once; return the directory it was installed into."""
    root = tmp_path_factory.mktemp("plugin")
    src = root / "src"
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    shutil.copytree(FIXTURE_DIST, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = root / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert proc.returncode == 0, f"installing the fixture plugin failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "paged_fixture_plugins-0.3.1.dist-info" / "entry_points.txt").exists()
    return site


@pytest.fixture
def fixture_plugins(plugin_site, monkeypatch) -> Path:
    """The fixture plugins installed, none of their modules imported yet, loading narrowed to them."""
    _forget_fixture_modules()
    # On sys.path for this test only, so nothing else in the session (the process-wide registry,
    # doctests) ever discovers the deliberately broken fixture plugins.
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.setenv("PAGED_PLUGINS", FIXTURE_PLUGINS)
    yield plugin_site
    _forget_fixture_modules()
    importlib.invalidate_caches()
