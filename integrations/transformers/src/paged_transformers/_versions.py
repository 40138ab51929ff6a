"""Which transformers releases paged supports, and the hook through which each reaches paged's
attention function.

:data:`SUPPORTED` is the one table: a release (major.minor) -> its :class:`Release` (the hook,
and the patch release the integration's tests ran on). Supporting a new release of a known hook
is one line there, once ``integrations/transformers/tests`` pass on it (``test_hook_shape.py``
checks that the release still offers the hook's shape). :data:`HOOKS` describes each hook: what
transformers hands the attention function, and which of its own functions a paged name stands
in for.

- **"pool"** (5.17, 5.18): ``AttentionInterface.register("paged|<name>", fn)``; continuous
  batching keeps a registered ``paged|`` name, passes ``fn`` its paged cache object and the
  step's metadata, and builds no attention mask for it. ``fn`` writes and reads transformers'
  own pool.
- **"gathered"** (5.24, 5.25): continuous batching accepts a name only if it is ``paged|eager``,
  ``sdpa`` or contains ``flash``, and the model writes the step's K/V into the pool itself
  (``cache.update`` inside each attention layer) before it calls ``fn`` with each request's whole
  K/V gathered from the pool, request after request. The cache object is no longer passed. ``fn``
  runs the backend on that gathered copy seen as a paged cache of one-token blocks.

Releases missing from the table are refused: 5.19 to 5.23 (untested; from 5.19 continuous
batching accepts only ``paged|eager``, ``sdpa`` and names containing ``flash``, and these
releases changed the cache and the kwargs release by release), and anything newer than the
newest entry until it is tested.
"""

from __future__ import annotations

from typing import NamedTuple

from paged_core import UnsupportedSpecError

__all__ = ["HOOKS", "SUPPORTED", "TESTED", "Hook", "Release", "check_transformers_version", "hook_of"]


class Release(NamedTuple):
    #: How paged's attention function is reached: a key of :data:`HOOKS`.
    hook: str
    #: The release the integration's tests ran on.
    tested: str


class Hook(NamedTuple):
    #: transformers' own attention implementation that a paged name takes the place of: paged's
    #: function is called exactly as transformers calls that one.
    stands_in_for: str
    #: The keyword arguments of a continuous-batching step (transformers' ``PagedAttentionArgs``)
    #: that paged's attention function reads.
    step_kwargs: tuple[str, ...]


#: Every supported transformers release (major.minor) -> its hook and the release tested.
SUPPORTED: dict[str, Release] = {
    "5.17": Release("pool", "5.17.0"),
    "5.18": Release("pool", "5.18.0"),
    "5.24": Release("gathered", "5.24.0"),
    "5.25": Release("gathered", "5.25.0"),
}

#: What each hook relies on in transformers (checked by ``tests/test_hook_shape.py``).
HOOKS: dict[str, Hook] = {
    "pool": Hook(
        "paged|sdpa",
        ("cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_seqlen_q", "max_seqlen_k", "read_index", "write_index"),
    ),
    "gathered": Hook(
        "flash_attention_2",
        ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "read_index", "write_index", "block_table"),
    ),
}

#: The releases the tests ran on, oldest first.
TESTED = tuple(release.tested for release in SUPPORTED.values())


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _key(major_minor: tuple[int, int]) -> str:
    return f"{major_minor[0]}.{major_minor[1]}"


def hook_of(version: str) -> str | None:
    """The hook transformers ``version`` offers (``"pool"`` or ``"gathered"``), or None.

    >>> hook_of("5.17.0"), hook_of("5.25.1"), hook_of("5.21.0")
    ('pool', 'gathered', None)
    """
    release = SUPPORTED.get(_key(_major_minor(version)))
    return release.hook if release else None


def _accepted() -> str:
    names = [f"{key}.x" for key in SUPPORTED]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _fix() -> str:
    newest = SUPPORTED[max(SUPPORTED, key=_major_minor)].tested
    return f"pip install 'transformers=={newest}'"


def check_transformers_version(version: str | None = None) -> str:
    """Return transformers' version, or raise if paged has no tested hook in that release.

    >>> check_transformers_version("5.25.0")
    '5.25.0'
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
            raise UnsupportedSpecError(
                "paged-transformers", [f"transformers is not installed ({exc}); install it with: {_fix()}"]
            ) from exc
        version = transformers.__version__
    if hook_of(version) is not None:
        return version
    mm = _major_minor(version)
    minors = sorted(_major_minor(key) for key in SUPPORTED)
    if mm < minors[0]:
        why = (
            f"transformers {version} predates the continuous-batching attention interface paged uses "
            f"({_key(minors[0])})"
        )
    elif mm > minors[-1]:
        why = (
            f"transformers {version} is newer than the newest release paged-transformers was tested "
            f"with ({SUPPORTED[_key(minors[-1])].tested})"
        )
    else:
        below = max(m for m in minors if m < mm)
        above = min(m for m in minors if m > mm)
        gap = (
            f"{below[0]}.{below[1] + 1} to {above[0]}.{above[1] - 1}"
            if below[0] == above[0]
            else f"the releases after {below[0]}.{below[1]} and before {above[0]}.{above[1]}"
        )
        why = (
            f"transformers {version} is not supported: {gap} are untested (each changed how the cache "
            "reaches the attention function)"
        )
    raise UnsupportedSpecError(
        "paged-transformers",
        [
            f"{why}; accepted: transformers {_accepted()} (tested: {', '.join(r.tested for r in SUPPORTED.values())}). "
            f"Fix: {_fix()}"
        ],
    )
