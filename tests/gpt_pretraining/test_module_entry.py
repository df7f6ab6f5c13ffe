"""`python -m gpt_pretraining.pretrain` (what `torchrun -m gpt_pretraining.pretrain` starts) runs
pretrain_gpt.py's run, from any directory: nothing in it reads the checkout as the cwd."""

import os
import re
import subprocess
import sys

import pretrain_gpt
from tests.sample_data import REPO
from tests.tiny_gpt import tiny_gpt_args

LOSS_PATTERN = re.compile(r" iteration +(\d+)/ +\d+ \|.* lm loss: ([0-9.E+-]+) \|")

TINY_RUN = {"train_iters": 3, "seq_length": 16, "hidden_size": 32}


def test_module_run_from_another_directory_equals_pretrain_gpt(data_prefix, tmp_path, capsys):
    args = tiny_gpt_args(data_prefix, **TINY_RUN)
    capsys.readouterr()
    pretrain_gpt.main(args)
    in_process = LOSS_PATTERN.findall(capsys.readouterr().out)

    # PYTHONPATH: this checkout's package, as an installed one would be found from anywhere.
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    completed = subprocess.run(
        [sys.executable, "-m", "gpt_pretraining.pretrain", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert [iteration for iteration, _ in in_process] == ["1", "2", "3"]
    assert LOSS_PATTERN.findall(completed.stdout) == in_process
    assert not any(tmp_path.iterdir()), "the run wrote into its working directory"
