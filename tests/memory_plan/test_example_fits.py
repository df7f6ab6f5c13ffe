"""The Mixtral-shaped example (examples/mixtral_dmoe_1gpu.sh) fits one H100 and one H200 by the
memory planner's estimate, as docs/examples.md says: its DRY_RUN picks a setting without the
"no choice fits" warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("gpu_memory_gib, expected", [(80, "--exp-avg-sq-dtype bf16"), (141, "")])
def test_the_mixtral_shaped_example_fits_one_gpu(gpu_memory_gib, expected):
    python = Path(sys.executable).parent
    env = dict(
        os.environ,
        DRY_RUN="1",
        GPU_MEMORY_GIB=str(gpu_memory_gib),
        PATH=f"{python}{os.pathsep}{os.environ['PATH']}",
    )
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "examples" / "mixtral_dmoe_1gpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-2000:]
    chosen = [line for line in output.splitlines() if "memory settings:" in line]
    assert len(chosen) == 1 and not chosen[0].startswith("WARNING"), output[-2000:]
    assert "--micro-batch-size 8" in chosen[0] and expected in chosen[0], chosen[0]
