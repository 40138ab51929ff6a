"""``paged bench``: the command this distribution adds to ``paged``.

paged-core owns the ``paged`` entry point and ``paged list``; this module is the plugin (entry
point ``bench`` in the group ``paged_core``) whose ``register_commands`` hook adds the command.
Its options live next to its code (:func:`.cli.add_arguments`); importing that module loads no
backend and no Triton kernel.
"""

from __future__ import annotations

import argparse

from paged_core.hookspecs import hookimpl

__all__ = ["register_commands"]


@hookimpl
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    from . import cli

    timing = subparsers.add_parser("bench", help="time installed backends against the bandwidth floor")
    cli.add_arguments(timing)
    timing.set_defaults(func=cli.main)

    from . import tune

    tuning = subparsers.add_parser(
        "tune", help="time installed backends on this machine's batches and write the table the auto backend reads"
    )
    tune.add_arguments(tuning)
    tuning.set_defaults(func=tune.main)
