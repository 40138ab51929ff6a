"""The pytest plugin of the conformance suite.

Installed as a ``pytest11`` entry point, so ``pytest --pyargs paged_conformance`` needs nothing
else (``-p paged_conformance.plugin`` names the same plugin and is harmless). It:

- adds ``--backends A,B`` (or ``$PAGED_BACKENDS``), ``--paged-size small|full`` (or
  ``$PAGED_CONFORMANCE_SIZE``; default full with CUDA, else small) and ``--paged-report PATH``;
- parametrizes every test that asks for ``paged_backend`` over the registry's backends and,
  with ``paged_case``, over the cases its check applies to:
  ``test_matches_reference[reference-padding_rows]``;
- skips a (backend, case) with the backend's own reasons, never by name;
- writes the backend × case matrix as ``PATH.md`` and ``PATH.json`` at the end of the session.

It acts only on tests that use its fixtures, so other test suites in the same environment run
unchanged, and it imports torch only once such a test is collected.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from .backends import BackendPool
    from .cases import Case
    from .report import Matrix

_PROPERTY = "paged_conformance"


class _State:
    """Per-session state: options, the backend pool, the cases and the matrix (built lazily)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._pool: BackendPool | None = None
        self._matrix: Matrix | None = None
        self._cases: list[Case] | None = None

    @property
    def size(self) -> str:
        from .cases import default_size

        return self.config.getoption("paged_size") or default_size()

    @property
    def device(self) -> torch.device:
        from .cases import default_device

        return default_device()

    @property
    def pool(self) -> BackendPool:
        if self._pool is None:
            from paged_core import BackendNotFoundError

            from .backends import BackendPool, parse_backend_names, use_triton_interpreter_on_cpu

            use_triton_interpreter_on_cpu()
            try:
                self._pool = BackendPool(parse_backend_names(self.config.getoption("paged_backends")))
            except BackendNotFoundError as exc:
                raise pytest.UsageError(f"--backends: {exc}") from None
        return self._pool

    @property
    def cases(self) -> list[Case]:
        if self._cases is None:
            from .cases import cases

            self._cases = cases(self.size)
        return self._cases

    @property
    def matrix(self) -> Matrix:
        if self._matrix is None:
            from .report import Matrix
            from .runner import expected_checks

            pool = self.pool
            self._matrix = Matrix(
                size=self.size,
                device=str(self.device),
                backends={b: pool.unavailable(b) for b in pool.names},
                problems=pool.problems(),
                expected_checks=expected_checks(self.size),
            )
        return self._matrix


_STATE = pytest.StashKey[_State]()


class Conformance:
    """The ``conformance`` fixture: runs one check the way ``paged check`` does."""

    def __init__(self, state: _State, item: pytest.Item) -> None:
        self._state = state
        self._item = item

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def size(self) -> str:
        return self._state.size

    def check(self, name: str, backend: str, case: Case | None = None) -> None:
        """Run check ``name``; skip with the backend's reasons if it does not apply."""
        from . import checks
        from .tolerances import ConformanceFailure

        try:
            result = checks.run(self._state.pool, backend, name, case, self.device, self.size)
        except checks.NotApplicable as exc:
            pytest.skip(str(exc))
        except ConformanceFailure as exc:
            # The message says what, how much and where; the suite's own frames add nothing.
            # (Any other exception is a crash of the backend: pytest shows its traceback.)
            message = "\n".join([str(exc), *getattr(exc, "__notes__", [])])
            self._record(max_error=exc.max_error, message=message)
            pytest.fail(message, pytrace=False)
        self._record(max_error=result.max_error, note=result.note, block_size=result.block_size)

    def _record(self, **info: Any) -> None:
        self._item.user_properties.append((_PROPERTY, info))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("paged-conformance", "paged conformance suite")
    group.addoption(
        "--backends",
        dest="paged_backends",
        action="append",
        metavar="A,B",
        help="only these registered backends (repeatable; default: $PAGED_BACKENDS or all)",
    )
    group.addoption(
        "--paged-size",
        dest="paged_size",
        choices=("small", "full"),
        help="case size (default: $PAGED_CONFORMANCE_SIZE, else full with CUDA, else small)",
    )
    group.addoption(
        "--paged-report",
        dest="paged_report",
        default="conformance-report",
        metavar="PATH",
        help="write the matrix to PATH.md and PATH.json (default: conformance-report)",
    )


def pytest_configure(config: pytest.Config) -> None:
    state = _State(config)
    config.stash[_STATE] = state
    config.pluginmanager.register(_Recorder(state), f"paged-conformance-recorder-{id(config)}")
    if config.getoption("paged_backends"):
        state.pool  # noqa: B018 -- an unknown name is a usage error now, not a collection error


@pytest.fixture
def conformance(request: pytest.FixtureRequest) -> Conformance:
    return Conformance(request.config.stash[_STATE], request.node)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "paged_backend" not in metafunc.fixturenames:
        return
    state = metafunc.config.stash[_STATE]
    names = state.pool.names
    metafunc.parametrize("paged_backend", names, ids=names)
    if "paged_case" in metafunc.fixturenames:
        from .checks import CHECKS

        check = CHECKS.get(metafunc.function.__name__.removeprefix("test_"))
        chosen = [c for c in state.cases if check is None or check.applies(c)]
        metafunc.parametrize("paged_case", chosen, ids=[c.id for c in chosen])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, None]:
    """Attach (backend, case, check, max error) to the report, for the matrix."""
    outcome = yield
    report = outcome.get_result()
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "paged_backend" not in params or (report.when != "call" and report.passed):
        return
    case = params.get("paged_case")
    info: dict[str, Any] = {
        "backend": params["paged_backend"],
        "case": case.id if case is not None else "random_batches",
        "check": getattr(item, "originalname", item.name).removeprefix("test_"),
    }
    for name, value in item.user_properties:
        if name == _PROPERTY and isinstance(value, dict):
            info.update(value)
    if call.excinfo is not None and report.failed and "message" not in info:
        exc = call.excinfo.value  # a crash (or an error in setup)
        info["message"] = f"{type(exc).__name__}: {exc}"
    report.user_properties.append((_PROPERTY, info))


class _Recorder:
    """Per-session hooks that need the session's state: collect outcomes, write the report.

    Registered per config (not module globals), so a pytest run inside a pytest run (pytester)
    keeps its own matrix.
    """

    def __init__(self, state: _State) -> None:
        self.state = state
        self.paths: tuple[Any, Any] | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        info = next(
            (v for n, v in report.user_properties if n == _PROPERTY and isinstance(v, dict) and "backend" in v), None
        )
        if info is None:
            return
        from .report import FAIL, PASS, SKIP, Outcome

        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            status, message = SKIP, reason.removeprefix("Skipped: ")
        elif report.failed:
            status, message = FAIL, info.get("message") or report.longreprtext
        else:
            status, message = PASS, info.get("note", "")
        self.state.matrix.add(
            Outcome(
                info["backend"],
                info["case"],
                info["check"],
                status,
                message,
                info.get("max_error"),
                report.duration,
                info.get("block_size"),
            )
        )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        matrix = self.state._matrix
        if matrix is None or not matrix.outcomes or hasattr(session.config, "workerinput"):
            return  # no conformance test ran, or an xdist worker (the controller writes)
        base = session.config.invocation_params.dir / session.config.getoption("paged_report")
        self.paths = matrix.write(base)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.paths is None:
            return
        terminalreporter.write_sep("=", "paged conformance matrix")
        terminalreporter.write_line(self.state.matrix.to_text())
        terminalreporter.write_line(f"Report: {self.paths[0]} and {self.paths[1]}")
