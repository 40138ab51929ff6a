"""The verdict matrix: backend × case, each cell pass / skip + reason / FAIL + max error.

Both the pytest plugin and ``paged check`` fill a :class:`Matrix` with one :class:`Outcome` per
(backend, case, check) and write it as Markdown and JSON. A cell fails if any of its checks
failed, passes if any ran and none failed, and is skipped (with the backend's reason) otherwise.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["Outcome", "Cell", "Matrix", "report_paths", "check_writable"]

PASS, SKIP, FAIL = "pass", "skip", "fail"


@dataclasses.dataclass
class Outcome:
    """The result of one check of one backend on one case."""

    backend: str
    case: str
    check: str
    status: str  # "pass", "skip" or "fail"
    #: The skip reason or the failure message (first line is the summary).
    message: str = ""
    max_error: float | None = None
    seconds: float = 0.0
    #: The block size the case ran at when it is not the case's own (a backend that takes only
    #: larger blocks; see ``Case.block_size_fixed``), else None.
    block_size: int | None = None


@dataclasses.dataclass
class Cell:
    status: str
    #: Short text for tables: the max error of a failure, the reason of a skip.
    detail: str
    outcomes: list[Outcome]


def _fmt_err(x: float | None) -> str:
    if x is None:
        return ""
    return "inf/NaN" if math.isinf(x) or math.isnan(x) else f"{x:.1e}"


def check_writable(option: str, path: str | Path) -> None:
    """Refuse, before any work, an output path that cannot be written (``--report``, ``--json``,
    ``--plot``): a run of minutes must not end in a traceback. Creates missing parent folders."""
    from paged_core import InputError

    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        existed = target.exists()
        with open(target, "a"):
            pass
        if not existed:
            target.unlink()
    except OSError as exc:
        raise InputError(
            f"{option} {str(path)!r} cannot be written ({exc.strerror or exc}); accepted: a path in a "
            "writable folder (missing folders are created)"
        ) from exc


def report_paths(base: str | Path) -> tuple[Path, Path]:
    """``conformance-report`` (or ``.md`` / ``.json``) -> the Markdown and JSON paths."""
    base = Path(base)
    if base.suffix in (".md", ".json"):
        base = base.with_suffix("")
    return base.with_name(base.name + ".md"), base.with_name(base.name + ".json")


class Matrix:
    """Outcomes of a run, with the context needed to read them (size, device, backends)."""

    def __init__(
        self,
        *,
        size: str,
        device: str,
        backends: dict[str, list[str]] | None = None,
        problems: list[str] | None = None,
        expected_checks: dict[str, int] | None = None,
    ) -> None:
        self.size = size
        self.device = device
        #: Backend name -> reasons it cannot run here (empty: available), in column order.
        self.backends: dict[str, list[str]] = dict(backends or {})
        self.problems = list(problems or [])
        #: Case id -> how many checks apply to it, when known: a passing cell where fewer ran
        #: (an interrupted or filtered run) says "pass (2/4 checks)" instead of looking complete.
        self.expected_checks: dict[str, int] = dict(expected_checks or {})
        self.outcomes: list[Outcome] = []
        self._case_order: list[str] = []

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Matrix:
        """A matrix from :meth:`to_json`'s output (a report's ``.json``)."""
        matrix = cls(
            size=data["size"],
            device=data["device"],
            backends={n: list(b.get("reasons", [])) for n, b in data.get("backends", {}).items()},
            problems=data.get("problems", []),
            expected_checks=data.get("expected_checks"),
        )
        fields = {f.name for f in dataclasses.fields(Outcome)}
        for r in data.get("results", []):
            outcome = Outcome(**{k: v for k, v in r.items() if k in fields})
            if "block_size" not in r and outcome.status == PASS and outcome.message.startswith("at block_size "):
                # Reports from before the field (the H200 runs of 2026-11-29) said it only in the note.
                outcome.block_size = int(outcome.message.split()[2])
            matrix.add(outcome)
        return matrix

    @classmethod
    def merged(cls, matrices: list[Matrix], case_order: list[str] | None = None) -> Matrix:
        """One matrix from runs of the same size and device (shards, or runs resumed after an
        interruption): for each (backend, case, check) the *last* run's outcome counts, so a
        re-run after a fix replaces the failure. A backend is available if it was in any run."""
        if not matrices:
            raise ValueError("no matrices to merge")
        kinds = {(m.size, m.device) for m in matrices}
        if len(kinds) > 1:
            raise ValueError(f"cannot merge runs of different size/device: {sorted(kinds)}")
        backends: dict[str, list[str]] = {}
        for m in matrices:
            for name, reasons in m.backends.items():
                backends[name] = [] if not reasons or backends.get(name) == [] else reasons
        expected: dict[str, int] = {}
        for m in matrices:
            expected.update(m.expected_checks)
        out = cls(
            size=matrices[0].size,
            device=matrices[0].device,
            backends=backends,
            problems=list(dict.fromkeys(p for m in matrices for p in m.problems)),
            expected_checks=expected,
        )
        latest: dict[tuple[str, str, str], Outcome] = {}
        for m in matrices:
            for o in m.outcomes:
                latest.pop((o.backend, o.case, o.check), None)  # re-insert: the last run's order
                latest[(o.backend, o.case, o.check)] = o
        rank = {c: i for i, c in enumerate(case_order or [])}
        for o in sorted(latest.values(), key=lambda o: rank.get(o.case, len(rank))):
            out.add(o)
        return out

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.backends.setdefault(outcome.backend, [])
        if outcome.case not in self._case_order:
            self._case_order.append(outcome.case)

    # ----------------------------------------------------------------------------- queries
    @property
    def cases(self) -> list[str]:
        return list(self._case_order)

    @property
    def failed(self) -> bool:
        return any(o.status == FAIL for o in self.outcomes)

    def counts(self) -> dict[str, int]:
        cells = [self.cell(b, c) for b in self.backends for c in self.cases]
        return {s: sum(1 for x in cells if x and x.status == s) for s in (PASS, SKIP, FAIL)}

    def cell(self, backend: str, case: str) -> Cell | None:
        outs = [o for o in self.outcomes if o.backend == backend and o.case == case]
        if not outs:
            return None
        fails = [o for o in outs if o.status == FAIL]
        if fails:
            return Cell(FAIL, _fmt_err(fails[0].max_error), outs)
        passes = [o for o in outs if o.status == PASS]
        if passes:
            errs = [o.max_error for o in passes if o.max_error is not None and o.check != "batch_invariance"]
            return Cell(PASS, _fmt_err(max(errs)) if errs else "", outs)
        return Cell(SKIP, outs[0].message, outs)

    # ----------------------------------------------------------------------------- output
    def to_json(self) -> dict[str, Any]:
        return {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "size": self.size,
            "device": self.device,
            "passed": not self.failed,
            "counts": self.counts(),
            "backends": {n: {"available": not r, "reasons": r} for n, r in self.backends.items()},
            "problems": self.problems,
            "expected_checks": self.expected_checks,
            "matrix": {
                b: {
                    c: {"status": cell.status, "detail": cell.detail}
                    for c in self.cases
                    if (cell := self.cell(b, c)) is not None
                }
                for b in self.backends
            },
            "results": [
                {
                    **dataclasses.asdict(o),
                    "max_error": None if o.max_error is None or not math.isfinite(o.max_error) else o.max_error,
                    "seconds": round(o.seconds, 3),
                }
                for o in self.outcomes
            ],
        }

    def _notes(self) -> tuple[dict[tuple[str, str], int], list[str]]:
        """Footnote numbers per (backend, case) for skips and failures; one note per distinct
        (backend, first line of the reason), so a backend skipped everywhere for one reason has
        one note."""
        numbers: dict[tuple[str, str], int] = {}
        by_text: dict[tuple[str, str], int] = {}
        lines: list[str] = []
        for b in self.backends:
            for c in self.cases:
                cell = self.cell(b, c)
                if cell is None or cell.status == PASS:
                    continue
                if cell.status == SKIP:
                    text = cell.detail
                else:
                    first = next(o for o in cell.outcomes if o.status == FAIL)
                    text = f"{first.check}: {first.message}"
                key = (b, text.splitlines()[0] if text else "")
                if key not in by_text:
                    lines.append(f"{b}: {key[1]}")
                    by_text[key] = len(lines)
                numbers[(b, c)] = by_text[key]
        return numbers, lines

    def _label(self, backend: str, case: str, notes: dict[tuple[str, str], int], markdown: bool) -> str:
        cell = self.cell(backend, case)
        if cell is None:
            return "-"
        if cell.status == PASS:
            said = []
            block = next((o.block_size for o in cell.outcomes if o.status == PASS and o.block_size), None)
            if block:
                said.append(f"block {block}")
            ran, expected = len({o.check for o in cell.outcomes}), self.expected_checks.get(case)
            if expected and ran < expected:
                said.append(f"{ran}/{expected} checks")
            return f"pass ({', '.join(said)})" if said else "pass"
        n = notes[(backend, case)]
        if cell.status == SKIP:
            return f"skip [{n}]"
        fail = "**FAIL**" if markdown else "FAIL"
        return " ".join(x for x in (fail, cell.detail, f"[{n}]") if x)

    def to_markdown(self) -> str:
        notes, lines = self._notes()
        c = self.counts()
        out = [
            "# Conformance report",
            "",
            f"Size **{self.size}** on **{self.device}**: {c[PASS]} passed, {c[FAIL]} failed, "
            f"{c[SKIP]} skipped (backend × case). Every backend is compared with the float64 "
            'reference; a cell is skipped only for the backend\'s own reason. "pass (block N)": '
            'the case ran at N-token blocks, the smallest the backend takes; "pass (k/n checks)": '
            "only k of the case's n checks ran (an interrupted or filtered run), all of them passed.",
            "",
            "| case | " + " | ".join(self.backends) + " |",
            "|---|" + "---|" * len(self.backends),
        ]
        for case in self.cases:
            out.append(f"| `{case}` | " + " | ".join(self._label(b, case, notes, True) for b in self.backends) + " |")
        if lines:
            out += ["", "## Notes", ""] + [f"{i}. {line}" for i, line in enumerate(lines, 1)]
        unavailable = {b: r for b, r in self.backends.items() if r}
        if unavailable:
            out += ["", "## Unavailable backends", ""]
            out += [f"- **{b}**: {'; '.join(r)}" for b, r in unavailable.items()]
        if self.problems:
            out += ["", "## Plugins that failed to load", ""] + [f"- {p}" for p in self.problems]
        fails = [o for o in self.outcomes if o.status == FAIL]
        if fails:
            out += ["", "## Failures", ""]
            for o in fails:
                out += [f"### {o.backend} / {o.case} / {o.check}", "", "```", o.message.strip(), "```", ""]
        return "\n".join(out).rstrip() + "\n"

    def to_text(self) -> str:
        """The matrix as a plain table for a terminal: cases down, backends across."""
        notes, lines = self._notes()
        header = ["case", *self.backends]
        body = [[c, *(self._label(b, c, notes, False) for b in self.backends)] for c in self.cases]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            return "  ".join(f"{x:<{w}}" for x, w in zip(cells, widths, strict=True)).rstrip()

        rows = [line(header), line(["-" * w for w in widths]), *(line(r) for r in body)]
        if lines:
            rows += [""] + [f"[{i}] {text}" for i, text in enumerate(lines, 1)]
        if self.problems:
            rows += ["", "Plugins that failed to load:"] + [f"  {p}" for p in self.problems]
        n = self.counts()
        rows += ["", f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped (size {self.size}, device {self.device})"]
        return "\n".join(rows)

    def write(self, base: str | Path) -> tuple[Path, Path]:
        """Write ``<base>.md`` and ``<base>.json``; return their paths."""
        md, js = report_paths(base)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(self.to_markdown())
        js.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return md, js
