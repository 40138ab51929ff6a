"""Fixtures of paged-flash-attn2's tests: flash-attn absent, or replaced by a CPU stand-in."""

from __future__ import annotations

import sys

import fa2_fake
import pytest
from paged_flash_attn2 import backend as fa2_backend


@pytest.fixture
def no_flash_attn(monkeypatch):
    """Make ``import flash_attn`` fail, as on a machine without it (a None entry blocks imports)."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    _clear()
    yield
    _clear()


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """Put the documented-behaviour stand-in of :mod:`fa2_fake` in place of flash_attn."""
    monkeypatch.setitem(sys.modules, "flash_attn", fa2_fake.as_module())
    _clear()
    fa2_fake.CALLS.clear()
    yield fa2_fake
    fa2_fake.CALLS.clear()
    _clear()


def _clear():
    fa2_backend._probe.cache_clear()
    fa2_backend._pruned_build.cache_clear()
