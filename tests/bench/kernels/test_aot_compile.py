"""The benchmark kernels' AOT_SPECS compile for MI300X, MI250X and H100 on this CPU.

tools/compile_kernels.py builds the product's kernel packages only (megatron.kernels and
moe.kernels); this builds bench.kernels the same way, through megatron.kernels.aot, in a child
process without TRITON_INTERPRET (see tests/kernels/test_aot_compile.py for why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not importorskip: importing triton here, before the interpreter tests set TRITON_INTERPRET,
# would turn triton's own jit functions into compiled ones and break those tests.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[3]
TARGETS = ("mi300x", "mi250x", "h100")
FINAL_STAGE = {"mi300x": "hsaco", "mi250x": "hsaco", "h100": "cubin"}
ASSEMBLY_STAGE = {"mi300x": "amdgcn", "mi250x": "amdgcn", "h100": "ptx"}


def _run_aot(flag: str):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = (
        "import sys; from megatron.kernels.aot import main; "
        f"sys.exit(main([{flag!r}], ['bench.kernels']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", command],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not result.stdout.strip():
        raise RuntimeError(f"megatron.kernels.aot.main([{flag!r}]) failed:\n{result.stderr}")
    return json.loads(result.stdout)


# Empty where this Triton has no device-side tensor descriptors (grouped_gemm_tma.available()).
SPEC_NAMES = _run_aot("--list")


@pytest.fixture(scope="module")
def report():
    return _run_aot("--json")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("spec_name", SPEC_NAMES)
def test_compiles(report, spec_name, target):
    result = report[spec_name][target]
    if isinstance(result, str) and "ld.lld not found" in result:
        # As in tests/kernels/test_aot_compile.py: Triton 3.0 needs ROCm's linker for AMD.
        pytest.skip(f"this Triton needs ROCm's linker to build for {target}: {result}")
    assert not isinstance(result, str), f"{spec_name} does not build for {target}: {result}"
    assert result[ASSEMBLY_STAGE[target]] > 0
    assert result[FINAL_STAGE[target]] > 0
