"""The exceptions of paged's public API.

Every error a user can trigger is one of these, so a server can catch ``PagedError`` around a
step and know the library, not the hardware, refused the input. Each subclasses the builtin a
caller would expect (``ValueError`` for bad input, ``LookupError`` for a missing backend), so
code that already catches those keeps working.
"""

from __future__ import annotations

__all__ = [
    "PagedError",
    "BatchMetaError",
    "InputError",
    "UnsupportedSpecError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "PluginError",
]


class PagedError(Exception):
    """Base class of every error raised on purpose by paged."""


class BatchMetaError(PagedError, ValueError):
    """A ``BatchMeta`` breaks one of its invariants; the message names the request and field."""


class InputError(PagedError, ValueError):
    """A tensor passed to the public API has the wrong shape, dtype, device or layout."""


class UnsupportedSpecError(PagedError, ValueError):
    """A backend was asked for something its capabilities do not claim; lists the reasons."""

    def __init__(self, backend: str, reasons: list[str]) -> None:
        self.backend = backend
        self.reasons = list(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"Backend {backend!r} cannot run this attention:\n{lines}")


class BackendNotFoundError(PagedError, LookupError):
    """No backend of that name is registered."""


class BackendUnavailableError(PagedError, LookupError):
    """The backend is registered but cannot run here (import failed, no GPU, missing package)."""


class PluginError(PagedError, RuntimeError):
    """A plugin broke the hook contract (wrong type registered, bad hook API version, ...)."""
