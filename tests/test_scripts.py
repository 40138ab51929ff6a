"""The repository's scripts (most of them GPU measurements) start and explain themselves here.

A script that no longer imports or parses its options would otherwise be found on the GPU
machine, at the cost of a run there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "scripts"
# The offline GPU machine's shell layer (install, the recorded runs, the vLLM recipe).
GPU_DIR = SCRIPTS_DIR / "gpu"
# A leading underscore marks a module the scripts import (``_harness.py``), not a script.
SCRIPTS = sorted(s for s in SCRIPTS_DIR.glob("*.py") if not s.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_help(script):
    # kernel_resources.py compiles for the GPU and refuses the interpreter; --help needs neither.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


def test_the_scripts_are_found():
    # An empty glob (a moved folder) would leave the test above with no case at all.
    assert len(SCRIPTS) >= 6 and all(s.suffix == ".py" for s in SCRIPTS)


def _load_script(name):
    """``scripts/<name>.py`` as a module, its folder first on ``sys.path`` as when it runs (the
    scripts import ``_harness`` beside them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SCRIPTS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS_DIR))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS_DIR))
    return module


@pytest.mark.parametrize("time_unit, scale", [("ns", 1e3), ("nsecond", 1e3), ("usecond", 1.0)])
def test_gpu_profile_reads_ncus_raw_csv(time_unit, scale):
    # The layout of `ncu --csv --page raw`: tool lines, a header of metric names, a row of
    # units, one row per kernel (numbers may carry thousands separators). The H200's ncu
    # (2026-12-01) writes times in "ns"; older releases spell units out.
    names = [
        "ID",
        "Kernel Name",
        "Grid Size",
        "Block Size",
        "gpu__time_duration.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active",
        "sm__maximum_warps_per_active_cycle_pct",
        "dram__bytes_read.sum",
        "launch__registers_per_thread",
        "launch__shared_mem_per_block_dynamic",
        "launch__shared_mem_per_block_static",
        "launch__occupancy_limit_registers",
        "launch__occupancy_limit_shared_mem",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    ]
    units = [
        "",
        "",
        "",
        "",
        time_unit,
        "%",
        "%",
        "%",
        "Mbyte",
        "register/thread",
        "Kbyte",
        "byte",
        "block",
        "block",
        "",
        "",
        "",
        "",
    ]
    row = [
        "0",
        "unified_attention_kernel(float *, int)",
        "(64, 8, 1)",
        "(128, 1, 1)",
        f"{1260.35 * scale:,}",
        "46.2",
        "18.9",
        "25",
        "553.6",
        "255",
        "40.96",
        "1,024",
        "2",
        "5",
        "12.5",
        "0.7",
        "3.1",
        "1.9",
    ]
    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            ",".join(f'"{x}"' for x in names),
            ",".join(f'"{x}"' for x in units),
            ",".join(f'"{x}"' for x in row),
        ]
    )
    [k] = _load_script("gpu_profile").parse_raw_csv(text)
    assert k["kernel"] == "unified_attention_kernel"
    assert k["us"] == pytest.approx(1260.35)
    assert (k["dram_pct"], k["occupancy_pct"], k["regs"]) == (46.2, 18.9, 255)
    assert k["dram_mb"] == pytest.approx(553.6)
    assert k["smem_kb"] == pytest.approx(41.0)  # 40,960 dynamic + 1,024 static bytes
    assert k["limits"]["registers"] == 2 and k["limits"]["shared_mem"] == 5
    assert [name for name, _ in k["stalls"]] == ["long_scoreboard", "wait", "math_pipe_throttle"]
    # A unit the parser does not know gives no number, not one off by its factor.
    [k] = _load_script("gpu_profile").parse_raw_csv(text.replace(f'"{time_unit}"', '"fortnight"'))
    assert k["us"] is None


def test_gpu_profile_cases_run_on_the_cpu():
    # Every case builds its batch and runs its call (interpreter, tiny shapes, no ncu).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "gpu_profile.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(": ran") == len(_load_script("gpu_profile").CASES), proc.stdout


def test_prefill_ceiling_variants_match_the_reference_on_the_cpu():
    # Each load path of the minimal kernel and triton-unified's prefill run once and are checked.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "prefill_ceiling.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ceiling")]
    modes = _load_script("prefill_ceiling").MODES
    assert len(lines) == 2 * len(modes) + 2, proc.stdout  # two configs per mode, two product rows
    assert all(" err " in line and "BAD" not in line for line in lines), proc.stdout


def test_gpu_tune_variants_run_and_match_the_reference_on_the_cpu():
    # Every section's variants run once (interpreter, tiny shapes) and are checked; a variant whose
    # call reads a tensor on the host (which its CUDA-graph capture would refuse) fails here.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "gpu_tune.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if " | " in line]
    assert len(lines) >= 60, proc.stdout
    bad = [line for line in lines if "Error" in line or "BAD" in line or "skipped" in line]
    assert not bad, "\n".join(bad)


def test_kernel_resources_lists_every_loop_in_address_order():
    # cuobjdump -sass lines: /*address*/ instruction ; a backward branch closes a loop. In its own
    # process: the script imports the kernels compiled, never interpreted.
    body = [
        "MOV R1, R2",
        "LDS.U8 R2, [R3]",
        "HMMA.16816.F32 R4, R8, R12, R4",
        "STL [R1], R4",
        "@P0 BRA 0x10",
        "MOV R5, R6",
        "LDL R7, [R1]",
        "FADD R8, R7, R7",
        "@!P1 BRA 0x50",
        "EXIT",
    ]
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(body))
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import kernel_resources as r; "
        "print(json.dumps([r.loop_stats(sys.argv[2], min_len=2), r.loop_stats(sys.argv[2], min_len=5)]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(SCRIPTS_DIR), sass], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats, longer = json.loads(proc.stdout)
    assert stats["loops"] == [4, 4]  # 0x10..0x40 and 0x50..0x80, not only the longest
    assert (stats["lds8"], stats["local"]) == (1, 2)
    assert stats["prologue"] == 1  # the MOV before the first loop
    assert longer["loops"] == [] and longer["prologue"] is None


def test_prefill_ceiling_compiles_its_modes_offline():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no cuobjdump: the offline compile report needs it")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / "prefill_ceiling.py"), "--resources", "--modes", "paged-lean"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("paged-lean")]
    assert len(rows) == 7, proc.stdout
    assert all(0 < int(r[6]) <= 255 for r in rows), proc.stdout  # registers per thread


def _vllm_gpu_pins() -> dict[str, str]:
    """scripts/gpu/vllm_gpu_requirements.txt: each package -> its specifier ("==0.26.0", "" unpinned)."""
    from packaging.requirements import Requirement

    text = (GPU_DIR / "vllm_gpu_requirements.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {(req := Requirement(line)).name: str(req.specifier) for line in lines}


def test_the_vllm_gpu_recipe_pins_each_package_in_one_place():
    """The GPU recipe's pins live in scripts/gpu/vllm_gpu_requirements.txt: slim_vllm_wheel.sh reads it,
    no other file pins vLLM or openai apart from it, and its vLLM is one the plugin and its
    distribution accept and its README names. (The script pinned openai 2.8.1, whose
    openai.types.responses lacks the NamespaceTool vLLM 0.26 imports: `from vllm import LLM`
    failed on the GPU machine.)"""
    import ast

    from packaging.requirements import Requirement

    root = ROOT
    pins = _vllm_gpu_pins()
    vllm, openai = pins["vllm"], pins["openai"]
    assert vllm.startswith("==") and openai.startswith("=="), pins
    vllm = vllm[2:]

    slim = (GPU_DIR / "slim_vllm_wheel.sh").read_text()
    assert "vllm_gpu_requirements.txt" in slim
    # Every other pin of vLLM's or openai's release in the repository is the file's.
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    pin = re.compile(r"(?<![\w.-])(openai|vllm)\s*==\s*([0-9][\w.+]*)")
    for name in files:
        path = root / name
        if path.suffix not in {".sh", ".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml"} or not path.is_file():
            continue
        if name == "scripts/gpu/vllm_gpu_requirements.txt":
            continue
        for package, version in pin.findall(path.read_text(errors="replace")):
            assert f"=={version}" == pins[package], f"{name} pins {package}=={version}; the recipe: {pins[package]}"

    # The plugin's release lines and the distribution's `cuda` extra accept the recipe's vLLM.
    init = (root / "integrations" / "vllm" / "src" / "paged_vllm" / "__init__.py").read_text()
    (supported,) = [
        ast.literal_eval(node.value)
        for node in ast.parse(init).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SUPPORTED_VLLM"
    ]
    assert ".".join(vllm.split(".")[:2]) in supported, (vllm, supported)
    import tomllib

    pyproject = tomllib.loads((root / "integrations" / "vllm" / "pyproject.toml").read_text())
    (cuda,) = [Requirement(d) for d in pyproject["project"]["optional-dependencies"]["cuda"]]
    assert cuda.name == "vllm" and cuda.specifier.contains(vllm), (str(cuda), vllm)
    readme = (root / "integrations" / "vllm" / "README.md").read_text()
    assert f"**{vllm}**" in readme and "scripts/gpu/vllm_gpu_requirements.txt" in readme


def test_the_gpu_install_checks_that_vllm_imports():
    """gpu_vllm_install.sh ends by importing vLLM's LLM once both parts are in, and says what to
    fix (the recipe's pins) when that fails, rather than leaving the failure to the first run."""
    script = (GPU_DIR / "gpu_vllm_install.sh").read_text()
    check = script[script.index("from vllm import LLM") :]
    assert "vllm_gpu_requirements.txt" in check and "return 1" in check
    proc = subprocess.run(["bash", "-n", str(GPU_DIR / "gpu_vllm_install.sh")])
    assert proc.returncode == 0


SHELL_SCRIPTS = sorted([*SCRIPTS_DIR.glob("*.sh"), *GPU_DIR.glob("*.sh")])


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=[str(s.relative_to(SCRIPTS_DIR)) for s in SHELL_SCRIPTS])
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_readme_lists_every_script_and_its_tests_exist():
    """scripts/README.md links every file of scripts/ and scripts/gpu/, and each smoke test it
    names is a test function of the file it names (tests/test_scripts.py when it names none)."""
    readme = (SCRIPTS_DIR / "README.md").read_text()
    files = [p for d in (SCRIPTS_DIR, GPU_DIR) for p in sorted(d.iterdir()) if p.is_file() and p.name != "README.md"]
    assert len(files) >= 15, files
    unlisted = [str(p.relative_to(SCRIPTS_DIR)) for p in files if f"]({p.relative_to(SCRIPTS_DIR)})" not in readme]
    assert not unlisted, f"scripts/README.md has no row for {unlisted}"
    cited = re.findall(r"`(?:([\w/.-]+\.py)(?:::))?(test_\w+)", readme)
    assert len(cited) >= 10, cited
    missing = []
    for file, name in cited:
        path = ROOT / (file or "tests/test_scripts.py")
        if not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(f"{file or 'tests/test_scripts.py'}::{name}")
    assert not missing, f"scripts/README.md names tests that do not exist: {missing}"
