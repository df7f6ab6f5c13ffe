"""bench/variant_runs.sh: each variant runs the example with the time-to-quality recipe, its own
flags last (so they win), into its own directory, stopped at STOP_AT; a malformed variant is one
error line before anything runs."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "variant_runs.sh"


def _run(tmp_path, *variants, **env):
    data = REPO / "data" / "sample"
    arguments = [str(tmp_path / "prefix"), str(data / "gpt2-vocab.json"),
                 str(data / "gpt2-merges.txt"), str(tmp_path / "out"), "dmoe_46m_8gpu",
                 *variants]  # fmt: skip
    environment = dict(os.environ, DRY_RUN="1", GPU_MEMORY_GIB="80", **env)
    return subprocess.run(
        ["bash", str(SCRIPT), *arguments], capture_output=True, text=True, env=environment
    )


def test_each_variant_gets_its_flags_and_directory(tmp_path):
    done = _run(
        tmp_path,
        "base=",
        "sigmoid=--moe-router-score sigmoid --moe-loss-weight 0.01",
        STOP_AT="60",
        EXTRA_ARGS="--eval-interval 20",
    )
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "pretrain_gpt.py" in line]
    assert len(commands) == 2
    base, sigmoid = commands
    for command, label in ((base, "base"), (sigmoid, "sigmoid")):
        assert f"{tmp_path}/out/{label}/dmoe_46m_8gpu/tensorboard" in command
        recipe = command.index("--global-batch-size 256 --train-iters 381")
        assert command.index("--eval-interval 20 --exit-interval 60") > recipe
    assert "--moe-router-score" not in base
    flags = sigmoid.index("--moe-router-score sigmoid --moe-loss-weight 0.01")
    assert flags > sigmoid.index("--exit-interval 60")


def test_a_malformed_variant_is_one_error_line(tmp_path):
    done = _run(tmp_path, "base=", "two words=--moe-top-k 2")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: variant 'two words=--moe-top-k 2' is not LABEL=FLAGS (LABEL in letters, digits, "
        "'.', '_', '-')"
    )
    assert "pretrain_gpt.py" not in done.stdout
