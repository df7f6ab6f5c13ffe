"""pretrain_gpt.py with one rank that stops answering: rank HANG_RANK sleeps (for an hour)
at the start of iteration HANG_ITERATION, as a deadlocked or stuck rank would.

    HANG_RANK=1 HANG_ITERATION=3 torchrun --nproc_per_node 2 tests/training/hang_in_step.py ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402


def _hang_at(iteration: int) -> None:
    step = Trainer.train_step

    def train_step(self, data_iterator):
        if self.iteration + 1 == iteration:
            time.sleep(3600)
        return step(self, data_iterator)

    Trainer.train_step = train_step


if __name__ == "__main__":
    if int(os.environ["RANK"]) == int(os.environ["HANG_RANK"]):
        _hang_at(int(os.environ["HANG_ITERATION"]))
    pretrain_gpt.main(sys.argv[1:])
