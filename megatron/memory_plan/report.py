"""The planner's start-up lines: the estimate, and a warning naming what would fit."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from megatron.memory_plan.estimate import estimate_memory, format_estimate_line
from megatron.memory_plan.suggestions import SpecBuilder, format_warning, suggest_fits

if TYPE_CHECKING:
    from megatron.config import Config


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of a CUDA `device`; None elsewhere (the comparison is then skipped)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def memory_plan_lines(
    config: Config, build_mlp_spec: SpecBuilder, device_memory: Optional[int]
) -> List[str]:
    """The estimate line, and when it exceeds `device_memory` a `WARNING:` line with the
    flags that would make the run fit (megatron.memory_plan.suggestions)."""
    estimate = estimate_memory(config, build_mlp_spec(config), device_memory)
    lines = [format_estimate_line(estimate)]
    if estimate.fits is False:
        suggestions = suggest_fits(config, build_mlp_spec, device_memory)
        lines.append(format_warning(estimate, suggestions))
    return lines
