"""The package structure: `moe` uses `megatron`, never the reverse; `gpt_pretraining`, which
composes the run from both, is used by neither; every module imports on its own (no import
cycle that only some import orders survive); the tools and benches are thin users of the
installed package that never edit `sys.path`; and tests/ mirrors the package's rooms."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron", "moe", "gpt_pretraining")
# Each package and the packages of this project it must not import.
LOWER_THAN = {"megatron": ("moe", "gpt_pretraining"), "moe": ("gpt_pretraining",)}
# Directories of tests/ that are not a room of megatron/ (a subdirectory of it), and why.
TEST_DIRECTORIES_BESIDE_THE_ROOMS = {
    "moe": "the moe package's tests",
    "gpt_pretraining": "the gpt_pretraining package's tests (the run pretrain_gpt.py calls)",
    "tools": "the command lines of tools/ and the libraries behind them",
    "bench": "the code bench/'s benchmarks share",
    "fixtures": "data files the tests read; no test modules",
}
# Test modules at the top of tests/: they are about the whole project, not one room.
PROJECT_TESTS = {
    "test_architecture.py": "the packages' dependencies, file sizes and this layout",
    "test_requirements_lock.py": "the lock file against pyproject.toml",
    "test_docker_images.py": "the Dockerfiles against pyproject.toml and the torch floors",
    "test_launch.py": "tests/launch.py's in-process launcher, which serves every room",
}


def _modules(package: str):
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imported_names(path: Path):
    """Every module name an import statement (at any depth, TYPE_CHECKING blocks included) or
    an importlib.import_module("...") call with a literal names."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


@pytest.mark.parametrize("package", sorted(LOWER_THAN))
def test_dependencies_point_one_way(package):
    """megatron imports neither moe nor gpt_pretraining; moe does not import gpt_pretraining."""
    offending = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {name}"
        for _, path in _modules(package)
        for line, name in _imported_names(path)
        if name.split(".")[0] in LOWER_THAN[package]
    ]
    assert not offending, f"{package} must not depend on {LOWER_THAN[package]}:\n" + "\n".join(
        offending
    )


# The process groups and collectives every room builds on: they import no room but these
# modules at the top of megatron/ (the steps that apply parallelism are megatron.parallelize).
GROUPS_ROOM = "megatron.parallel"
GROUPS_ROOM_MAY_IMPORT = ("megatron.main_grads", "megatron.errors")


def test_the_process_groups_import_no_room_above_them():
    offending = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {name}"
        for module, path in _modules("megatron")
        if module == GROUPS_ROOM or module.startswith(GROUPS_ROOM + ".")
        for line, name in _imported_names(path)
        if name.startswith("megatron")
        and name != GROUPS_ROOM
        and not name.startswith(GROUPS_ROOM + ".")
        and name not in GROUPS_ROOM_MAY_IMPORT
    ]
    assert not offending, "\n".join(offending)


def test_the_check_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "import moe\n"
        "from moe.layers import MoE\n"
        "if TYPE_CHECKING:\n    from moe.config import MoEConfig\n"
        "def f():\n    import moe.experts\n    importlib.import_module('moe.router')\n"
        "from . import sibling\n"
    )
    names = [name for _, name in _imported_names(source)]
    assert names == ["moe", "moe.layers", "moe.config", "moe.experts", "moe.router"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports_first_and_alone(package):
    """Each module imported first, in a state where no module of the project is loaded yet (one
    interpreter; the project's modules are dropped from sys.modules between imports). A cycle
    between modules fails here for the module that starts it. No module loads a package it must
    not import (LOWER_THAN)."""
    names = [name for name, _ in _modules(package)]
    script = f"""
import importlib, sys
failures = []
for name in {names!r}:
    for loaded in [m for m in sys.modules if m.split(".")[0] in {PACKAGES!r}]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failures.append(f"{{name}}: {{type(error).__name__}}: {{error}}")
        continue
    pulled = sorted(m for m in sys.modules if m.split(".")[0] in {LOWER_THAN.get(package, ())!r})
    if pulled:
        failures.append(f"{{name}} loads {{pulled}}")
print("\\n".join(failures))
"""
    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", result.stdout


def test_no_source_file_is_over_500_lines():
    """One owner per file: past about 500 lines a file is asking to be split along a seam."""
    long_files = [
        f"{path.relative_to(REPO_ROOT)}: {lines} lines"
        for package in ("megatron", "moe", "gpt_pretraining", "tools")
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > 500
    ]
    assert not long_files, "\n".join(long_files)


# A tool is a module docstring (its usage text), an import of the package's entry and a call.
MAX_TOOL_LINES = 60


def test_tools_and_benches_do_not_edit_sys_path():
    """The package is installed in place, so a tool imports it as any user would; the benches
    run as `python -m bench.X` from the repository root, which puts the root on sys.path."""
    offending = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for folder in ("tools", "bench")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "sys.path" in line
    ]
    assert not offending, "\n".join(offending)


def test_every_tool_is_a_thin_command_line():
    """The library of a tool lives in the package (megatron.data, megatron.memory_plan,
    gpt_pretraining, ...); tools/ holds only the command lines over it."""
    tools = sorted((REPO_ROOT / "tools").rglob("*.py"))
    assert tools, "no tools found"
    long_tools = [
        f"{path.relative_to(REPO_ROOT)}: {lines} lines"
        for path in tools
        if path.name != "__init__.py"
        and (lines := len(path.read_text().splitlines())) > MAX_TOOL_LINES
    ]
    assert not long_tools, (
        f"a tool is at most {MAX_TOOL_LINES} lines; move the work into the package:\n"
        + "\n".join(long_tools)
    )


HUGGING_FACE_PACKAGES = ("transformers", "safetensors", "lm_eval", "accelerate")


def test_the_trainer_does_not_import_hugging_face():
    """`transformers` and `safetensors` are an optional extra (`.[hf]`) of the conversion
    library (gpt_pretraining.huggingface); training, the framework and the MoE layers never
    import them."""
    paths = [
        path
        for package in PACKAGES
        for name, path in _modules(package)
        if not name.startswith("gpt_pretraining.huggingface")
    ]
    paths.append(REPO_ROOT / "pretrain_gpt.py")
    offending = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {name}"
        for path in paths
        for line, name in _imported_names(path)
        if name.split(".")[0] in HUGGING_FACE_PACKAGES
    ]
    assert not offending, "\n".join(offending)


def test_tests_mirror_the_rooms():
    """A room's tests are under its name: every directory directly under tests/ is a room of
    megatron/ or one of TEST_DIRECTORIES_BESIDE_THE_ROOMS, and the only test modules at the top
    of tests/ are the PROJECT_TESTS (shared helpers such as launch.py may sit there too)."""
    rooms = {
        path.name
        for path in (REPO_ROOT / "megatron").iterdir()
        if path.is_dir() and any(path.glob("*.py"))
    }
    tests = REPO_ROOT / "tests"
    strays = [
        f"tests/{path.name}/: neither a room of megatron/ ({', '.join(sorted(rooms))}) nor in "
        "TEST_DIRECTORIES_BESIDE_THE_ROOMS"
        for path in sorted(tests.iterdir())
        if path.is_dir()
        and not path.name.startswith(("_", "."))
        and path.name not in rooms | TEST_DIRECTORIES_BESIDE_THE_ROOMS.keys()
    ] + [
        f"tests/{path.name}: a test module outside the rooms; move it to the room it tests"
        for path in sorted(tests.glob("test_*.py"))
        if path.name not in PROJECT_TESTS
    ]
    assert not strays, "\n".join(strays)
