"""Which transformers releases offer a hook for a paged attention implementation, and which one.

- **5.17, 5.18** (``"pool"``): ``AttentionInterface.register("paged|<name>", fn)``; continuous
  batching keeps a registered ``paged|`` name, passes ``fn`` its paged cache object and the
  step's metadata, and builds no attention mask for it. ``fn`` writes and reads transformers'
  own pool. Tested: 5.17.0 (CI); 5.18.0 by hand.
- **5.19 to 5.23**: refused. Untested; from 5.19 continuous batching accepts only ``paged|eager``,
  ``sdpa`` and names containing ``flash``, and these releases changed the cache and the kwargs
  release by release.
- **5.24** (``"gathered"``): continuous batching accepts a name only if it is ``paged|eager``,
  ``sdpa`` or contains ``flash``, and the model writes the step's K/V into the pool itself
  (``cache.update`` inside each attention layer) before it calls ``fn`` with each request's whole
  K/V gathered from the pool, request after request. The cache object is no longer passed. ``fn``
  runs the backend on that gathered copy seen as a paged cache of one-token blocks. Tested:
  5.24.0 (CI).
- **5.25 and later**: refused until tested.
"""

from __future__ import annotations

from paged_core import UnsupportedSpecError

__all__ = ["SUPPORTED", "TESTED", "check_transformers_version", "hook_of"]

#: The release ranges with a hook: (lowest, first excluded) as major.minor -> the hook's name.
SUPPORTED = {((5, 17), (5, 19)): "pool", ((5, 24), (5, 25)): "gathered"}
#: The releases the tests ran on (CI: 5.17.0 and 5.24.0).
TESTED = ("5.17.0", "5.18.0", "5.24.0")
_ACCEPTED = "5.17.x, 5.18.x or 5.24.x"
_FIX = "pip install 'transformers==5.24.0' (or 'transformers>=5.17,<5.19')"


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def hook_of(version: str) -> str | None:
    """The hook transformers ``version`` offers (``"pool"`` or ``"gathered"``), or None.

    >>> hook_of("5.17.0"), hook_of("5.24.0"), hook_of("5.21.0")
    ('pool', 'gathered', None)
    """
    mm = _major_minor(version)
    for (low, high), hook in SUPPORTED.items():
        if low <= mm < high:
            return hook
    return None


def check_transformers_version(version: str | None = None) -> str:
    """Return transformers' version, or raise if paged has no tested hook in that release.

    >>> check_transformers_version("5.24.0")
    '5.24.0'
    >>> check_transformers_version("5.21.0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    paged_core._errors.UnsupportedSpecError: Backend 'paged-transformers' cannot run this attention:
      - transformers 5.21.0 is not supported: 5.19 to 5.23 are untested...
    """
    if version is None:
        try:
            import transformers
        except ImportError as exc:
            raise UnsupportedSpecError("paged-transformers", [
                f"transformers is not installed ({exc}); install it with: {_FIX}"
            ]) from exc
        version = transformers.__version__
    if hook_of(version) is not None:
        return version
    mm = _major_minor(version)
    if mm < (5, 17):
        why = (f"transformers {version} predates the continuous-batching attention interface paged uses "
               f"(5.17)")
    elif mm < (5, 24):
        why = (f"transformers {version} is not supported: 5.19 to 5.23 are untested (their continuous "
               "batching accepts only 'paged|eager', 'sdpa' and names containing 'flash', and each changed "
               "how the cache reaches the attention function)")
    else:
        why = (f"transformers {version} is newer than the newest release paged-transformers was tested "
               "with (5.24.0)")
    raise UnsupportedSpecError("paged-transformers", [
        f"{why}; accepted: transformers {_ACCEPTED} (tested: {', '.join(TESTED)}). Fix: {_FIX}"
    ])
