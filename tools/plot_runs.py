"""Training runs' loss, throughput and expert load in one PNG, from their TensorBoard files.

    python tools/plot_runs.py runs/gpt2_125m_1gpu runs/dmoe_125m_1gpu --x time \\
        [--output runs_plot.png] [--seq-length N] [--expert-load-layers 4]

Each RUN_DIR is a run's output directory (holding tensorboard/, as examples/common.sh lays it
out) or its --tensorboard-dir itself; each run is one line, labelled by its directory's name.
--x iterations (default), tokens (consumed samples x the run's --seq-length, which runs record
in TensorBoard; --seq-length for older runs) or time (wall-clock since the run started), so a
dense and a dMoE run compare on time to quality. The PNG goes to --output (default
./runs_plot.png). Needs matplotlib: pip install -e '.[plot]'. The library:
gpt_pretraining/plot_runs.py (drawing) and gpt_pretraining/run_events.py (reading).
"""

import sys

from gpt_pretraining.plot_runs import main

if __name__ == "__main__":
    sys.exit(main())
