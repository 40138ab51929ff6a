"""paged-bench: ``paged bench``, every installed paged-attention backend timed side by side.

The command reaches ``paged`` through core's ``register_commands`` hook (:mod:`.commands`); it
is this package's only entry, and nothing else imports it. Its batches are built with the
conformance suite's workload builder and every result is checked with the suite's tolerance
table (both imported from ``paged_conformance``) before it is timed.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__: list[str] = []
