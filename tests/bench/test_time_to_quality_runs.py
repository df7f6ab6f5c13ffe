"""bench/time_to_quality_runs.sh: the recipe's flags reach each example script, after the
script's own and before EXTRA_ARGS (which win), and a wrong example name is one error line."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "time_to_quality_runs.sh"


def _run(tmp_path, *examples, **env):
    data = REPO / "data" / "sample"
    arguments = [str(tmp_path / "prefix"), str(data / "gpt2-vocab.json"),
                 str(data / "gpt2-merges.txt"), str(tmp_path / "out"), *examples]  # fmt: skip
    environment = dict(os.environ, DRY_RUN="1", GPU_MEMORY_GIB="80", **env)
    return subprocess.run(
        ["bash", str(SCRIPT), *arguments], capture_output=True, text=True, env=environment
    )


def test_each_example_gets_the_recipe(tmp_path):
    done = _run(tmp_path, "gpt2_46m_1gpu", "dmoe_46m_8gpu", EXTRA_ARGS="--train-iters 7")
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "pretrain_gpt.py" in line]
    assert len(commands) == 2
    for command, name in zip(commands, ("gpt2_46m_1gpu", "dmoe_46m_8gpu")):
        words = command.split()
        assert words[words.index("--nproc_per_node") + 1] == "1"
        assert f"{tmp_path}/out/{name}/tensorboard" in command
        recipe = command.index("--global-batch-size 256 --train-iters 381")
        assert "--eval-interval 50 --eval-iters 10" in command
        assert command.index("--train-iters 7") > recipe  # EXTRA_ARGS last: they win


def test_a_wrong_example_name_is_one_error_line(tmp_path):
    done = _run(tmp_path, "gpt2_125m_1gpu", "dmoe_125m")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: no examples/dmoe_125m.sh (EXAMPLE names a script of examples/ without .sh)"
    )
    assert "pretrain_gpt.py" not in done.stdout  # checked before anything runs
