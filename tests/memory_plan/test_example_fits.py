"""The Mixtral-shaped example (examples/mixtral_dmoe_1gpu.sh) and the fine-grained dMoE-125M
(examples/dmoe_fine_125m_1gpu.sh) fit one H100 and one H200 by the memory planner's estimate, as
docs/examples.md and the script say: a DRY_RUN picks the setting without the "no choice fits"
warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


BF16_STATE = "--exp-avg-sq-dtype bf16"


@pytest.mark.parametrize(
    "script, gpu_memory_gib, micro_batch, bf16_state",
    [
        ("mixtral_dmoe_1gpu", 80, 8, True),
        ("mixtral_dmoe_1gpu", 141, 8, False),
        ("dmoe_fine_125m_1gpu", 80, 32, True),
        ("dmoe_fine_125m_1gpu", 141, 64, False),
    ],
)
def test_the_example_fits_one_gpu(script, gpu_memory_gib, micro_batch, bf16_state):
    python = Path(sys.executable).parent
    env = dict(
        os.environ,
        DRY_RUN="1",
        GPU_MEMORY_GIB=str(gpu_memory_gib),
        PATH=f"{python}{os.pathsep}{os.environ['PATH']}",
    )
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "examples" / f"{script}.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-2000:]
    chosen = [line for line in output.splitlines() if "memory settings:" in line]
    assert len(chosen) == 1 and not chosen[0].startswith("WARNING"), output[-2000:]
    settings = chosen[0].split("(")[0]
    assert f"--micro-batch-size {micro_batch} " in settings, chosen[0]
    assert (BF16_STATE in settings) == bf16_state, chosen[0]
