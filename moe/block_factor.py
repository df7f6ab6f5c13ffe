"""How large the fixed-size expert-parallel blocks are (--moe-expert-parallel-buffer-factor,
moe.exchange.fixed_blocks): grown when a step's routing needed more than they hold (the step then
runs again, moe.training_hooks), shrunk when a long stretch of steps needed much less.

Routing is most uneven in a run's first iterations, so a factor only ever grown stays at what
they needed long after the routing evened out (docs/benchmark-log.md, issue 38), and every
padded row crosses the links in each of a layer's four all-to-alls. Each new factor recompiles
the model (its block size is a constant of the graph), so factors lie on a ladder of
FACTOR_STEP (a factor met before reuses its compiled graph) and shrink at most once per
SHRINK_WINDOW steps.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

# Grown or shrunk factors are multiples of this.
FACTOR_STEP = 0.25
# The factor chosen is this much above what the routing needed, so that the next steps'
# routing rarely needs another rerun.
MARGIN = 1.1
# Steps whose largest need decides a shrink.
SHRINK_WINDOW = 100


def on_ladder(factor: float) -> float:
    """The smallest multiple of FACTOR_STEP at or above `factor` (and at least 1)."""
    # The rounding guard keeps an exact multiple (2.0000000001 from float noise) where it is.
    steps = math.ceil(round(factor / FACTOR_STEP, 6))
    return max(1.0, steps * FACTOR_STEP)


class BlockFactor:
    """The factor every MoE layer's blocks use, and the need seen since the last decision.

    `need` is always in factor units: the rows the fullest block of the step needed, over the
    balanced share (so a step with blocks of factor f that were r times too small needed f*r).
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.window_need = 0.0
        self.window_steps = 0

    def grown(self, need: float) -> float:
        """The factor after a step that needed `need` > the factor (the step runs again)."""
        self.factor = on_ladder(need * MARGIN)
        self.window_need, self.window_steps = 0.0, 0
        return self.factor

    def after_step(self, need: float) -> Optional[Tuple[float, float]]:
        """Records a step that fit. When the last SHRINK_WINDOW steps all needed less than the
        factor by a margin: (their largest need, the smaller factor to use from the next
        step); else None."""
        self.window_need = max(self.window_need, need)
        self.window_steps += 1
        if self.window_steps < SHRINK_WINDOW:
            return None
        window_need = self.window_need
        smaller = on_ladder(window_need * MARGIN)
        self.window_need, self.window_steps = 0.0, 0
        if smaller >= self.factor:
            return None
        self.factor = smaller
        return window_need, smaller
