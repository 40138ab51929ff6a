"""Which transformers releases offer a supported hook for a paged attention implementation.

- 5.17, 5.18: ``AttentionInterface.register("paged|<name>", fn)``; continuous batching keeps a
  registered ``paged|`` name, passes the paged cache and the step's metadata to ``fn``, and builds
  no attention mask for it. Tested: 5.17.0, 5.18.0.
- 5.19 and later: continuous batching refuses every implementation that is not ``paged|eager``,
  ``sdpa`` or a flash-attention one ("Implementation ... is not supported for continuous
  batching"), and a name containing ``flash`` is imported from a flash-attention package or
  downloaded from the Hub as a kernel repository. From 5.24 the model writes the cache itself
  and hands the attention function a gathered copy of every request's K/V. None of these is a
  hook an installed backend can register through, so :func:`check_transformers_version` says so.
"""

from __future__ import annotations

from paged_core import UnsupportedSpecError

__all__ = ["SUPPORTED", "TESTED", "check_transformers_version"]

#: The releases with a supported hook: (lowest, first excluded), as major.minor.
SUPPORTED = ((5, 17), (5, 19))
#: The releases the tests ran on.
TESTED = ("5.17.0", "5.18.0")


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_transformers_version(version: str | None = None) -> str:
    """Return transformers' version, or raise if it has no hook paged can register through.

    >>> check_transformers_version("5.17.0")
    '5.17.0'
    >>> check_transformers_version("5.24.0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    paged_core._errors.UnsupportedSpecError: Backend 'paged-transformers' cannot run this attention:
      - transformers 5.24.0 has no supported hook for a paged attention implementation: ...
    """
    if version is None:
        try:
            import transformers
        except ImportError as exc:
            raise UnsupportedSpecError("paged-transformers", [
                f"transformers is not installed ({exc}); install it with: pip install 'transformers>=5.17,<5.19'"
            ]) from exc
        version = transformers.__version__
    mm = _major_minor(version)
    low, high = SUPPORTED
    if low <= mm < high:
        return version
    if mm < low:
        why = (f"transformers {version} predates the continuous-batching attention interface paged uses "
               f"(5.17); accepted: 5.17.x or 5.18.x (tested: {', '.join(TESTED)}). Fix: "
               "pip install 'transformers>=5.17,<5.19'")
    else:
        why = (f"transformers {version} has no supported hook for a paged attention implementation: "
               "from 5.19 its continuous batching accepts only 'paged|eager', 'sdpa' and flash-attention "
               "implementations, and it imports any name containing 'flash' from a flash-attention "
               "package or the Hub. Accepted: transformers 5.17.x or 5.18.x (tested: "
               f"{', '.join(TESTED)}). Fix: pip install 'transformers>=5.17,<5.19'")
    raise UnsupportedSpecError("paged-transformers", [why])
