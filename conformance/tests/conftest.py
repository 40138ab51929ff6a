"""Fixtures of the conformance suite's own tests (the ones that prove the suite can fail)."""

from __future__ import annotations

import pytest
import torch
from broken_backends import BackendsPlugin
from paged_core import Registry

pytest_plugins = ["pytester"]


@pytest.fixture
def cpu() -> torch.device:
    return torch.device("cpu")


@pytest.fixture
def broken_registry() -> Registry:
    """A registry of the reference and the broken backends only (no entry points loaded)."""
    # A group no distribution declares: nothing installed leaks into these tests.
    registry = Registry(group="paged_conformance_tests", env_var="PAGED_CONFORMANCE_TESTS_PLUGINS")
    registry.add_plugin(BackendsPlugin(), name="broken-backends")
    return registry


@pytest.fixture
def use_registry(monkeypatch, broken_registry) -> Registry:
    """Make the suite (pytest plugin, runner, ``paged check``) see ``broken_registry`` only."""
    import paged_conformance.backends

    monkeypatch.setattr(paged_conformance.backends, "default_registry", broken_registry)
    monkeypatch.delenv("PAGED_BACKENDS", raising=False)
    return broken_registry
