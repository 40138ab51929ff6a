"""paged-core's own plugin: registers the reference backend through the same hook as everyone."""

from paged_core.hookspecs import Register, hookimpl


@hookimpl
def register_backends(register: Register) -> None:
    # Lowest priority: the oracle is always correct but never the fast choice.
    register("reference", "paged_core._reference:ReferenceBackend", priority=-100)
    # Below every backend it chooses from: registry.select never picks it unasked.
    register("auto", "paged_core._auto:AutoBackend", priority=-200)
