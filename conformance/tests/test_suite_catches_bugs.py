"""The suite is only worth what it catches: each broken backend fails exactly where its bug shows.

Every broken backend (``broken_backends.py``) is the reference with one bug. For each, the check
that should notice it must fail on exactly the cases that expose the bug, and pass on all the
others (so the check is neither blind nor trigger-happy); the reference must pass everything.
"""

from __future__ import annotations

import dataclasses
import json
import re

import broken_backends as bb
import pytest
import torch
from paged_conformance import runner
from paged_conformance.backends import BackendPool
from paged_conformance.cases import Case, cases
from paged_conformance.checks import CHECKS, DECLARATION_CASES, NotApplicable, check_random_batches, run
from paged_conformance.tolerances import ConformanceFailure
from paged_core import Capabilities, ReferenceBackend

SMALL = cases("small")


def failing_cases(backend, check: str, device: torch.device, only=lambda case: True) -> set[str]:
    """Ids of the small cases (those ``only`` keeps) on which ``check`` fails for ``backend``."""
    failed = set()
    for case in SMALL:
        if not CHECKS[check].applies(case) or case.options or not only(case):
            continue
        assert not backend.reasons(case.spec(device)), "broken backends claim what the reference claims"
        try:
            CHECKS[check].func(backend, case, device)
        except NotApplicable:
            continue  # e.g. the CUDA-graph check on a CPU
        except ConformanceFailure as exc:
            # "[backend/case]", or "[backend, layer 1 of 2 .../case]" from the layers check.
            assert re.match(rf"\[{re.escape(backend.name)}(, [^/\]]*)?/{re.escape(case.id)}\]", str(exc)), str(exc)
            failed.add(case.id)
    return failed


def everywhere(case: Case) -> bool:
    return True


def nowhere(case: Case) -> bool:
    return False


# (broken backend, check, the cases that expose its bug to that check)
EXPOSED = [
    # Every case has a query row whose next position is a real key or garbage.
    (bb.CausalOffByOne, "matches_reference", everywhere),
    (bb.WindowIgnored, "matches_reference", lambda c: c.window > 0),
    (bb.ScaleIgnored, "matches_reference", lambda c: c.scale is not None),
    # With one KV head "the next KV head" is the same one: only cases with several KV heads.
    (bb.WrongKVHead, "matches_reference", lambda c: c.num_kv_heads > 1),
    (bb.PaddingLeftNaN, "matches_reference", lambda c: bool(c.padding_requests)),
    (bb.QuantSkipsScale, "matches_reference", lambda c: c.kv_dtype != "auto"),
    (bb.QuantSkipsScale, "close_to_full_precision", everywhere),
    (bb.RowsUnwritten, "matches_reference", everywhere),
    (bb.Base2Lse, "lse_matches_reference", everywhere),
    (bb.Base2Lse, "matches_reference", nowhere),
    (bb.PaddingSlotsWritten, "write_then_read", lambda c: bool(c.padding_requests)),
    (bb.PaddingSlotsWritten, "matches_reference", nowhere),
    (bb.NotBatchInvariant, "batch_invariance", everywhere),
    (bb.NotBatchInvariant, "matches_reference", nowhere),
    # Every case's table holds stale, valid ids past each request's blocks (and the longest
    # request has columns past its blocks too), and every case has a query that sees the
    # extra block's positions. Zero-padded tables passed it.
    (bb.ReadsPastLastBlock, "matches_reference", everywhere),
    (bb.GridCappedAt32Requests, "matches_reference", lambda c: c.num_reqs > 32),
    (bb.GridCappedAt32Requests, "batch_invariance", lambda c: c.num_reqs > 32),
    (bb.WritesIntoACopy, "write_then_read", lambda c: c.cache_layout != "nhd"),
    (bb.WritesIntoACopy, "matches_reference", lambda c: c.cache_layout != "nhd"),
    (bb.SinksReadContiguous, "matches_reference", lambda c: c.sinks_layout != "contiguous"),
    (bb.PaddingRowsUnwritten, "matches_reference", lambda c: bool(c.padding_requests)),
    (bb.SeqLensReadContiguous, "matches_reference", lambda c: c.meta_layout != "contiguous"),
    # A plan keyword that declares a shared prefix the requests do not share, taken on trust.
    (bb.PrefixDeclarationTrusted, "false_plan_declaration", lambda c: c.id in DECLARATION_CASES),
    (bb.PrefixDeclarationTrusted, "matches_reference", nowhere),
    # Codes quantized with their own scales, read with the cache's static ones.
    (bb.StaticScalesIgnored, "write_then_read", lambda c: c.kv_scales != "per_slot"),
    (bb.StaticScalesIgnored, "matches_reference", lambda c: c.kv_scales != "per_slot"),
    # Only a second layer of one plan shows it: the layers check on its quantized cases.
    (bb.LayerScalesReused, "layers_share_a_plan", lambda c: c.kv_dtype != "auto"),
    (bb.LayerScalesReused, "matches_reference", nowhere),
]


#: Broken backends whose bug depends on the number of requests in the batch.
BATCH_SIZE_BUGS = (bb.GridCappedAt32Requests,)


@pytest.mark.parametrize(("cls", "check", "exposed"), EXPOSED, ids=[f"{cls.name}-{check}" for cls, check, _ in EXPOSED])
def test_broken_backend_fails_exactly_where_exposed(cls, check, exposed, cpu):
    # The batches of more than 32 requests cost seconds per call even here: they run for the
    # bugs that depend on the batch size (and for the reference, below).
    def only(c: Case) -> bool:
        return c.num_reqs <= 32 or cls in BATCH_SIZE_BUGS

    want = {c.id for c in SMALL if CHECKS[check].applies(c) and not c.options and only(c) and exposed(c)}
    assert failing_cases(cls(validate=True), check, cpu, only=only) == want


@pytest.mark.parametrize("check", list(CHECKS))
def test_reference_passes_every_check(check, cpu):
    assert failing_cases(ReferenceBackend(validate=True), check, cpu) == set()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (the GPU machine)")
def test_a_backend_whose_graph_replays_a_stale_result_fails_the_graph_check():
    """The graph check's broken backend: triton-unified, except that inside a capture it records
    a copy of its last eager result instead of its kernels, so a replay returns the old answer
    (what a backend that computes on the host and uploads does). Eager calls are right."""
    from paged_conformance.checks import GRAPH_CASES
    from paged_core import registry

    class StaleReplay(type(registry.get("triton-unified"))):
        name = "stale-replay"

        def _forward(self, q, cache, plan, *, out, lse, **kw):
            if torch.cuda.is_current_stream_capturing():
                out.copy_(self._last)
                return
            super()._forward(q, cache, plan, out=out, lse=lse, **kw)
            self._last = out.clone()

    cuda = torch.device("cuda")
    graph_cases = {c.id for c in SMALL if c.id in GRAPH_CASES}
    assert (
        failing_cases(StaleReplay(validate=True), "cuda_graph_replay", cuda, only=lambda c: c.id in GRAPH_CASES)
        == graph_cases
    )
    assert (
        failing_cases(StaleReplay(validate=True), "matches_reference", cuda, only=lambda c: c.id in GRAPH_CASES)
        == set()
    )


def test_failure_says_where(cpu):
    case = next(c for c in SMALL if c.id == "mixed_prefill_and_decode-g1")
    with pytest.raises(ConformanceFailure) as err:
        CHECKS["matches_reference"].func(bb.WrongKVHead(), case, cpu)
    msg = str(err.value)
    assert msg.startswith("[wrong-kv-head/mixed_prefill_and_decode-g1] output differs from the float64")
    for part in ("max abs error", "request", "head", "row", "position", "tolerance", "mean abs error"):
        assert part in msg
    assert err.value.max_error > 0.1


def test_padding_failure_names_padding_rows(cpu):
    case = next(c for c in SMALL if c.id == "padding_rows")
    with pytest.raises(ConformanceFailure, match=r"padding rows .* must be exact zeros.*request 3"):
        CHECKS["matches_reference"].func(bb.PaddingLeftNaN(), case, cpu)


def test_unwritten_rows_are_reported_as_such(cpu):
    with pytest.raises(ConformanceFailure, match="not written"):
        CHECKS["matches_reference"].func(bb.RowsUnwritten(), SMALL[0], cpu)


@pytest.mark.parametrize(
    "cls",
    [bb.CausalOffByOne, bb.WindowIgnored, bb.WrongKVHead, bb.QuantSkipsScale, bb.PaddingLeftNaN],
    ids=lambda c: c.name,
)
def test_random_batches_catch_it(cls, cpu):
    with pytest.raises(ConformanceFailure):
        check_random_batches(cls(validate=True), cpu, "small")


def test_stale_ids_in_the_table_are_what_expose_reads_past_the_last_block(cpu, monkeypatch):
    """With zero-padded tables (the suite's tables before) the over-read is invisible."""
    import paged_conformance.workload as workload

    case = next(c for c in SMALL if c.id == "mixed_prefill_and_decode-g4")
    check = CHECKS["matches_reference"].func
    try:
        monkeypatch.setattr(workload, "with_stale_ids", lambda tables, num_blocks, g: [list(t) for t in tables])
        workload.clear_workloads(case.id)
        check(bb.ReadsPastLastBlock(validate=True), case, cpu)  # passes: nothing to see
        monkeypatch.undo()
        workload.clear_workloads(case.id)
        with pytest.raises(ConformanceFailure, match="output differs from the float64 reference"):
            check(bb.ReadsPastLastBlock(validate=True), case, cpu)
    finally:
        workload.clear_workloads(case.id)


def test_random_batches_pass_the_reference(cpu):
    result = check_random_batches(ReferenceBackend(validate=True), cpu, "small")
    assert result.max_error is not None and result.max_error < 1e-2


def test_runner_reports_each_broken_backend(use_registry, tmp_path):
    """The whole pipeline (registry -> runner -> matrix -> report) fails the broken backends."""
    matrix = runner.run(case_filter=["sliding_window", "padding_rows", "kv_int8", "g1"], progress=False)
    assert matrix.failed
    verdict = {(b, c): matrix.cell(b, c).status for b in matrix.backends for c in matrix.cases}
    assert all(verdict[("reference", c)] == "pass" for c in matrix.cases)
    for backend, case in [
        ("window-ignored", "sliding_window"),
        ("wrong-kv-head", "mixed_prefill_and_decode-g1"),
        ("padding-nan", "padding_rows"),
        ("quant-skips-scale", "kv_int8"),
        ("padding-slots-written", "padding_rows"),
        ("causal-off-by-one", "kv_int8"),
        ("reads-past-last-block", "mixed_prefill_and_decode-g1"),
        ("padding-rows-unwritten", "padding_rows"),
    ]:
        assert verdict[(backend, case)] == "fail", (backend, case)
    assert verdict[("window-ignored", "padding_rows")] == "pass"
    md, js = matrix.write(tmp_path / "report")
    data = json.loads(js.read_text())
    assert data["passed"] is False
    assert data["matrix"]["window-ignored"]["sliding_window"]["status"] == "fail"
    assert "**FAIL** 1.2e+00" in md.read_text()


def test_a_claim_that_crashes_is_a_failure_not_a_skip(cpu, broken_registry):
    """A backend that claims fp8 and then raises is failed: a claim is a promise."""

    class ClaimsFp8(bb.Wrapping):
        name = "claims-fp8"

        def attend(self, q, cache, meta, **kw):
            if cache.kv_dtype == "fp8":
                raise NotImplementedError("fp8 is not implemented yet")
            return super().attend(q, cache, meta, **kw)

    broken_registry.add_plugin(bb.BackendsPlugin(ClaimsFp8), name="claims-fp8")
    matrix = runner.run(["claims-fp8"], case_filter=["kv_fp8", "kv_int8"], registry=broken_registry, progress=False)
    cell = matrix.cell("claims-fp8", "kv_fp8")
    assert cell.status == "fail"
    assert "NotImplementedError: fp8 is not implemented yet" in cell.outcomes[0].message
    assert matrix.cell("claims-fp8", "kv_int8").status == "pass"


def test_unclaimed_spec_is_skipped_with_the_backends_reason(cpu, broken_registry):
    class OnlyHeadDim64(bb.Wrapping):
        name = "only-head-dim-64"
        capabilities = Capabilities(head_dims=frozenset({64}))

    broken_registry.add_plugin(bb.BackendsPlugin(OnlyHeadDim64), name="only-head-dim-64")
    matrix = runner.run(["only-head-dim-64"], case_filter=["head_dim"], registry=broken_registry, progress=False)
    assert matrix.cell("only-head-dim-64", "head_dim_64").status == "pass"
    skipped = matrix.cell("only-head-dim-64", "head_dim_96")
    assert skipped.status == "skip"
    assert skipped.detail == "head_dim 96 is not supported (accepted: 64)"
    with pytest.raises(NotApplicable, match="head_dim 96 is not supported"):
        run(
            BackendPool(["only-head-dim-64"], registry=broken_registry),
            "only-head-dim-64",
            "matches_reference",
            next(c for c in SMALL if c.id == "head_dim_96"),
            cpu,
        )


class OnlyLargeBlocks(bb.Wrapping):
    """Takes only 64-token blocks and up, the way flash-attn 2 takes only multiples of 256."""

    name = "only-large-blocks"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities, block_sizes=frozenset({64, 128}))


class LargeBlocksWindowIgnored(OnlyLargeBlocks):
    name = "large-blocks-window-ignored"

    def attend(self, q, cache, meta, **kw):
        return super().attend(q, cache, meta, **{**kw, "window": 0})


def test_a_backend_of_larger_blocks_runs_the_cases_at_its_block_size(cpu, broken_registry):
    """Cases not about the block size run at the smallest block size the backend takes, so its
    windows, padding, mixed batches... are checked; the report says at which block size."""
    for cls in (OnlyLargeBlocks, LargeBlocksWindowIgnored):
        broken_registry.add_plugin(bb.BackendsPlugin(cls), name=cls.name)
    matrix = runner.run(
        ["only-large-blocks", "large-blocks-window-ignored"],
        registry=broken_registry,
        case_filter=["sliding_window", "padding_rows", "block_size", "shared_prefix"],
        progress=False,
    )
    good = matrix.cell("only-large-blocks", "sliding_window")
    assert good.status == "pass"
    assert all(o.message.startswith("at block_size 64 ") for o in good.outcomes if o.status == "pass")
    assert matrix.cell("only-large-blocks", "padding_rows").status == "pass"
    # The bug shows at the larger block size too, and the failure says where it ran.
    bad = matrix.cell("large-blocks-window-ignored", "sliding_window")
    assert bad.status == "fail"
    assert "at block_size 64" in next(o.message for o in bad.outcomes if o.status == "fail")
    # A case about its block size, or one with a prefix counted in blocks, is not moved.
    assert matrix.cell("only-large-blocks", "block_size_16").status == "skip"
    assert matrix.cell("only-large-blocks", "block_size_64").status == "pass"
    assert matrix.cell("only-large-blocks", "shared_prefix").status == "skip"
    assert "| `sliding_window` | pass (block 64) |" in matrix.to_markdown()


@dataclasses.dataclass(frozen=True)
class _MultiplesOf256(Capabilities):
    """A rule no finite set states, as flash-attn 2's (any multiple of 256)."""

    def accepts_block_size(self, block_size: int) -> bool:
        return block_size % 256 == 0


class OnlyMultiplesOf256(bb.Wrapping):
    name = "only-multiples-of-256"
    capabilities = _MultiplesOf256(
        **{f.name: getattr(ReferenceBackend.capabilities, f.name) for f in dataclasses.fields(Capabilities)}
    )


def test_random_batches_draw_a_block_size_the_backend_takes(cpu):
    """The draws ask the capabilities (accepts_block_size), not a set the backend cannot state:
    from the usual 16/32/64 every draw would be refused and the check would not run."""
    from paged_conformance.checks import random_cases

    assert random_cases(OnlyMultiplesOf256.capabilities, "small")[1][2] == [256]
    result = check_random_batches(OnlyMultiplesOf256(), cpu, "small", max_examples=3)
    assert result.max_error is not None and result.max_error < 1e-2
