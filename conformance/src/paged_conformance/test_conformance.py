"""The conformance tests: every registered backend × every case of ``cases.py``.

``pytest --pyargs paged_conformance`` collects this module; the plugin (``plugin.py``)
parametrizes ``paged_backend`` over the registry and ``paged_case`` over the cases each check
applies to, and skips what a backend does not claim with the backend's own reasons. Each test
is one check of ``checks.py``, the same function ``paged check`` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cases import Case
    from .plugin import Conformance


def test_matches_reference(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """Output within the dtype's tolerance of the float64 reference; every row written (out=
    poisoned with NaN first); padding rows exact zeros."""
    conformance.check("matches_reference", paged_backend, paged_case)


def test_lse_matches_reference(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """The log-sum-exp, for backends that return one: natural log, float32 [num_tokens, num_heads]."""
    conformance.check("lse_matches_reference", paged_backend, paged_case)


def test_close_to_full_precision(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """A quantized cache's output within the stated bound of attention on full-precision K/V."""
    conformance.check("close_to_full_precision", paged_backend, paged_case)


def test_write_then_read(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """backend.write stores each token at its slot_mapping slot and touches nothing else."""
    conformance.check("write_then_read", paged_backend, paged_case)


def test_layers_share_a_plan(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """One plan serves every layer of a step: layers with their own cache, K/V and q, each
    output matching the reference for that layer."""
    conformance.check("layers_share_a_plan", paged_backend, paged_case)


def test_false_plan_declaration(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """With validation on, a plan keyword that declares something false of the batch (a shared
    prefix the requests do not share) is refused, or changes nothing."""
    conformance.check("false_plan_declaration", paged_backend, paged_case)


def test_batch_invariance(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """Each request run alone equals its rows in the batch (bitwise if the backend promises it)."""
    conformance.check("batch_invariance", paged_backend, paged_case)


def test_cuda_graph_replay(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """For backends claiming CUDA-graph safety (GPU only): a captured forward replayed on new q
    equals an eager call."""
    conformance.check("cuda_graph_replay", paged_backend, paged_case)


def test_plan_captured_with_forward(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """For backends claiming CUDA-graph safety and a device-side plan (GPU only): plan + forward
    captured in one graph on another batch, replayed on this one, equal the reference."""
    conformance.check("plan_captured_with_forward", paged_backend, paged_case)


def test_random_batches(paged_backend: str, conformance: Conformance) -> None:
    """Hypothesis-drawn batches and shapes within the backend's capabilities match the reference."""
    conformance.check("random_batches", paged_backend)


def test_non_finite_stays_in_its_slot(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """A NaN / -inf written into one slot: write_kv's bytes, NaN exactly in the rows that read it."""
    conformance.check("non_finite_stays_in_its_slot", paged_backend, paged_case)


def test_scale_floor(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """A row of the dtype's smallest subnormal and zeros reads back finite, with write_kv's bytes."""
    conformance.check("scale_floor", paged_backend, paged_case)


def test_kivi4_grown_token_by_token(paged_backend: str, paged_case: Case, conformance: Conformance) -> None:
    """A kivi4 block written one token per write: write_kv's bytes, keys within the stated bound."""
    conformance.check("kivi4_grown_token_by_token", paged_backend, paged_case)
