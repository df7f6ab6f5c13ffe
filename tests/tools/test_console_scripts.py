"""pyproject.toml's console scripts: one for the entry point and each tool in tools/ (but
compile_kernels.py), each naming a function of the installed package that answers --help."""

import importlib
import sys

import pytest

from tests.sample_data import REPO

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
TOOLS = sorted(
    path.relative_to(REPO / "tools").with_suffix("").as_posix()
    for path in (REPO / "tools").rglob("*.py")
    if path.name != "compile_kernels.py"
)
PACKAGES = ("megatron", "moe", "gpt_pretraining")  # [tool.setuptools.packages.find]


def test_every_tool_has_a_console_script_named_after_its_path():
    named = {"megatron-dmoe-" + tool.replace("/", "-").replace("_", "-") for tool in TOOLS}
    assert set(SCRIPTS) == named | {"megatron-dmoe-pretrain"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_answers_help(name, monkeypatch, capsys):
    module_name, function_name = SCRIPTS[name].split(":")
    assert module_name.split(".")[0] in PACKAGES, "a console script must not need the checkout"
    function = getattr(importlib.import_module(module_name), function_name)
    # What the script setuptools writes does: sys.exit(function()) with the script's argv.
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(function())
    assert exit_info.value.code == 0
    assert "--" in capsys.readouterr().out


def test_each_tool_is_a_thin_wrapper_of_the_package():
    for tool in TOOLS:
        source = (REPO / "tools" / f"{tool}.py").read_text()
        imported = [line for line in source.splitlines() if line.startswith(("from ", "import "))]
        assert all(line.split()[1].split(".")[0] in (*PACKAGES, "sys") for line in imported), (
            tool,
            imported,
        )
