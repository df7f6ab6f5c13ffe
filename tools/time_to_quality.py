"""Tokens and training time for each of several runs to reach a validation loss: a Markdown
table and a PNG, from their TensorBoard files.

    python tools/time_to_quality.py runs/gpt2_125m_1gpu runs/dmoe_125m_1gpu \\
        [--target-loss 3.3] [--labels dense dMoE] [--output time_to_quality.png] [--no-plot]

Each RUN_DIR is a run's output directory (holding tensorboard/, as examples/common.sh lays it
out) or its --tensorboard-dir itself; the runs should have trained on the same tokens. The
target defaults to the first run's final validation loss, and the speed-ups are over the first
run; runs given the same --labels name are one recipe's seeds, and a second table gives each
recipe's mean and spread against the first recipe's runs. Time is training time: the logged seconds per iteration summed, without start-up,
evaluations, checkpoint saves, each job's warm-up or the gaps between the jobs of a run made in
pieces. The table goes to stdout (it pastes into BENCHMARKS.md); the PNG to --output (default
./time_to_quality.png), which needs matplotlib: pip install -e '.[plot]'. The library, and what
each number means exactly: gpt_pretraining/time_to_quality.py.
"""

import sys

from gpt_pretraining.time_to_quality import main

if __name__ == "__main__":
    sys.exit(main())
