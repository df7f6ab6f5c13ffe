"""tools/estimate_memory.py and the megatron-dmoe-estimate-memory console script: the memory
planner's command line (megatron.memory_plan.command_line) for the run pretrain_gpt.py trains,
gpt_pretraining.GPT_RUN, so that the estimate and training build the same Config."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from gpt_pretraining import GPT_RUN
from megatron.memory_plan.command_line import main as memory_plan_main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the estimate of GPT_RUN for `argv` (default: sys.argv[1:]); 0, or 1 after one
    `error:` line."""
    return memory_plan_main(GPT_RUN, argv)


if __name__ == "__main__":
    sys.exit(main())
