"""The memory planner: an analytical estimate of a training run's peak GPU memory per rank.

    estimate = estimate_memory(config, mlp_spec, device_memory=total_bytes)
    print(format_estimate_line(estimate))
    if estimate.fits is False:
        print(format_warning(estimate, suggest_fits(config, build_mlp_spec, total_bytes)))

It counts the parameters exactly on the meta device (megatron.memory_plan.parameters), the bytes
per parameter of weights, gradients and optimizer states by dtype and sharding, and the
activations per token layer by layer (megatron.memory_plan.activations); estimate.py has the
formulas. Extensions add their terms through their MLP spec (megatron.model.mlp.MlpSpec:
`activation_bytes_per_token` and `memory`), so the planner never imports them.
"""

from megatron.memory_plan.estimate import (
    ALLOCATOR_OVERHEAD,
    GIB,
    MemoryEstimate,
    estimate_memory,
    format_estimate_line,
)
from megatron.memory_plan.parameters import ParameterCounts, count_parameters
from megatron.memory_plan.report import device_memory_bytes, memory_plan_lines
from megatron.memory_plan.suggestions import Suggestion, format_warning, suggest_fits

__all__ = [
    "ALLOCATOR_OVERHEAD",
    "GIB",
    "MemoryEstimate",
    "ParameterCounts",
    "Suggestion",
    "count_parameters",
    "device_memory_bytes",
    "estimate_memory",
    "format_estimate_line",
    "format_warning",
    "memory_plan_lines",
    "suggest_fits",
]
