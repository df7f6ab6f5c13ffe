"""Every Triton kernel (the AOT_SPECS of megatron/kernels and moe/kernels, through
tools/compile_kernels.py) compiles for MI300X, MI250X and H100 on this CPU: the `--covering`
builds, which build each kernel's every argument type and constexpr value for every target and
every specialization for at least one (megatron.kernels.aot.covering_builds; without
`--covering` the tool builds every pair).

The compiling runs in a child process without TRITON_INTERPRET: interpreter tests in this session
set it, and under it `triton.jit` gives functions that cannot be compiled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from megatron.kernels import aot  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("mi300x", "mi250x", "h100")
FINAL_STAGE = {"mi300x": "hsaco", "mi250x": "hsaco", "h100": "cubin"}
ASSEMBLY_STAGE = {"mi300x": "amdgcn", "mi250x": "amdgcn", "h100": "ptx"}


# tools/compile_kernels.py's packages.
PACKAGES = ["megatron.kernels", "moe.kernels"]
BUILDING = (
    f"import sys; from megatron.kernels.aot import main; sys.exit(main(sys.argv[1:], {PACKAGES}))"
)


def _run(*command: str):
    """The JSON a child process without TRITON_INTERPRET prints."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)  # the user's command line on a checkout not installed
    result = subprocess.run(
        [sys.executable, *command],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not result.stdout.strip():
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr}")
    return json.loads(result.stdout)


# Listed here, building in a child: conftest.py set up the interpreter before collection, so
# importing the kernel modules now changes nothing for the tests after this one.
SPECS = aot.discover_specs(PACKAGES)
SPEC_NAMES = [spec.name for spec in SPECS]
BUILDS = [(spec.name, target) for spec, target in aot.covering_builds(SPECS, list(aot.TARGETS))]


@pytest.fixture(scope="module")
def report():
    return _run("-c", BUILDING, "--json", "--covering")


def test_the_tool_lists_every_kernel_file():
    tool_names = _run("tools/compile_kernels.py", "--list")
    assert set(tool_names) == set(SPEC_NAMES)
    modules = {name.split("._", 1)[0] for name in tool_names}
    assert {
        "moe.kernels.grouped_gemm_kernels",
        "moe.kernels.permute_kernels",
        "moe.kernels.token_rows",
        "megatron.kernels.cross_entropy",
    } <= modules


def test_builds_cover_every_specialization_and_every_kernel_on_every_target():
    assert len(set(SPEC_NAMES)) == len(SPEC_NAMES)  # names tell specializations apart
    assert {name for name, _ in BUILDS} == set(SPEC_NAMES)
    kernels = {name.split("[")[0] for name in SPEC_NAMES}
    assert {(name.split("[")[0], target) for name, target in BUILDS} == {
        (kernel, target) for kernel in kernels for target in TARGETS
    }


@pytest.mark.parametrize("spec_name, target", BUILDS)
def test_compiles(report, spec_name, target):
    result = report[spec_name][target]
    if isinstance(result, str) and "ld.lld not found" in result:
        # Triton 3.0 (torch 2.4) links AMD code objects with ROCm's ld.lld, which only a ROCm
        # install has; newer Triton links them itself. The build stops at that last step.
        pytest.skip(f"this Triton needs ROCm's linker to build for {target}: {result}")
    assert not isinstance(result, str), f"{spec_name} does not build for {target}: {result}"
    assert result[ASSEMBLY_STAGE[target]] > 0
    assert result[FINAL_STAGE[target]] > 0
