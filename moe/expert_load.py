"""How many tokens each expert of each MoE layer received over a logging window: the numbers
behind the per-layer expert load in the log line and TensorBoard.

Each MoE layer adds its forward's assignments per expert (before any capacity drop) to its
`window_tokens_per_expert` buffer in every training forward, on the device and without a host
sync. At each `--log-interval` the trainer calls `gather_expert_load`, which takes and clears
those buffers and sums them over all ranks into one table, so that every rank (rank 0 writes
TensorBoard) holds every MoE layer's counts for the whole global batch:
- data-parallel and expert-parallel ranks each count their own tokens over all experts, and the
  sum adds them up;
- tensor-parallel ranks route the same tokens, so only the first rank of each tensor-parallel
  group contributes;
- pipeline stages hold different layers, and each contributes its own layers' rows.

With --moe-per-layer-logging each layer also sums its unweighted auxiliary losses (the
load-balancing loss, the router z-loss) over the window's training forwards, and
`gather_layer_losses` takes their mean over those forwards and the data-parallel ranks: each
layer's losses as Megatron-Core's flag of that name writes them to TensorBoard and W&B.

Under expert parallelism each layer also keeps, per training forward, how unevenly its
expert-parallel group's ranks were loaded: the most rows any rank received over the mean
(moe.exchange.primitives.ExchangeCounts.imbalance; every all-to-all waits for the busiest rank).
`gather_expert_parallel_imbalance` takes the window's mean per layer, the largest over the
groups.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.model.transformer import TransformerLayer
from megatron.parallel import parallel_state
from moe.layers import MoELayer

# The TensorBoard scalar of one expert's tokens over its layer's mean, per logging window: the
# histogram loses which expert got which count, and a plot of experts x iterations needs it.
EXPERT_LOAD_TAG = "moe/tokens-per-expert over-mean layer {layer} expert {expert}"


def take_window_counts(model: nn.Module) -> Dict[int, torch.Tensor]:
    """{layer number (0-based, as in `decoder.layers.<n>`): tokens per expert since the last
    call} of the MoE layers this rank holds; clears their windows."""
    counts = {}
    for module in model.modules():
        if isinstance(module, TransformerLayer) and isinstance(module.mlp, MoELayer):
            window = module.mlp.window_tokens_per_expert
            counts[module.layer_number] = window.clone()
            window.zero_()
    return counts


def gather_expert_load(
    model: nn.Module, moe_layer_numbers: List[int], num_experts: int, device: torch.device
) -> Dict[int, torch.Tensor]:
    """{layer number: int64 tokens per expert [num_experts]} for every MoE layer of the model
    (`moe_layer_numbers`), summed over the window and all ranks (module docstring).

    A collective when torch.distributed is initialized: every rank calls it at the same
    iteration.
    """
    table = torch.zeros(len(moe_layer_numbers), num_experts, dtype=torch.int64, device=device)
    row_of = {number: row for row, number in enumerate(moe_layer_numbers)}
    counts = take_window_counts(model)
    if _counted_here():
        for number, layer_counts in counts.items():
            table[row_of[number]] += layer_counts.to(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    table = table.cpu()
    return {number: table[row] for number, row in row_of.items()}


def _counted_here() -> bool:
    """Whether this rank's windows count: tensor-parallel ranks route the same tokens, so only
    the first of each group does."""
    return (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_tensor_model_parallel_rank() == 0
    )


def gather_layer_losses(
    model: nn.Module, moe_layer_numbers: List[int], names: Tuple[str, ...], device: torch.device
) -> Dict[int, Dict[str, float]]:
    """{layer number: {loss name: its mean over the window's training forwards on every rank}}
    for every MoE layer of the model, from the layers' `window_auxiliary_losses` (which it
    clears); NaN for a layer without a forward in the window. A collective over all ranks."""
    table = torch.zeros(len(moe_layer_numbers), len(names) + 1, dtype=torch.float64, device=device)
    row_of = {number: row for row, number in enumerate(moe_layer_numbers)}
    counted_here = _counted_here()
    for module in model.modules():
        if isinstance(module, TransformerLayer) and isinstance(module.mlp, MoELayer):
            window = module.mlp.window_auxiliary_losses
            if counted_here:
                table[row_of[module.layer_number]] += window.to(device, torch.float64)
            window.zero_()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    table = table.cpu()
    means = table[:, :-1] / table[:, -1:]  # 0 / 0 is NaN: no forward
    return {
        number: {name: means[row, column].item() for column, name in enumerate(names)}
        for number, row in row_of.items()
    }


def load_spread(counts: torch.Tensor) -> Tuple[float, float]:
    """(max, min) tokens per expert over their mean: 1.0 and 1.0 is perfect balance; a max of
    E (the number of experts) means one expert got every token. (nan, nan) without tokens."""
    mean = counts.double().mean()
    if mean == 0:
        return float("nan"), float("nan")
    return (counts.max() / mean).item(), (counts.min() / mean).item()


def tokens_over_mean(counts: torch.Tensor) -> List[float]:
    """Each expert's tokens over the mean of `counts` [num_experts]: 1.0 each at perfect
    balance; NaN each without tokens."""
    mean = counts.double().mean()
    if mean == 0:
        return [float("nan")] * counts.numel()
    return (counts.double() / mean).tolist()


def format_expert_load_line(load: Dict[int, torch.Tensor]) -> str:
    """One log line with each MoE layer's (max / min) tokens per expert over their mean."""
    line = " expert load (max / min tokens per expert over the mean) |"
    for number, counts in load.items():
        highest, lowest = load_spread(counts)
        line += f" layer {number}: {highest:.2f} / {lowest:.2f} |"
    return line


def gather_expert_parallel_imbalance(
    model: nn.Module, moe_layer_numbers: List[int], device: torch.device
) -> Dict[int, float]:
    """{layer number: mean over the window's training forwards of the expert-parallel load
    imbalance} for every MoE layer of the model, the largest over the expert-parallel groups
    (and pipeline stages, each holding its own layers); clears the windows. A layer without a
    forward in the window reads 0. A collective over all ranks."""
    means: Dict[int, Optional[float]] = {}
    for module in model.modules():
        if isinstance(module, TransformerLayer) and isinstance(module.mlp, MoELayer):
            window = module.mlp.window_expert_parallel_imbalance
            total, forwards = window.tolist()
            window.zero_()
            means[module.layer_number] = total / forwards if forwards else None
    row_of = {number: row for row, number in enumerate(moe_layer_numbers)}
    table = torch.zeros(len(moe_layer_numbers), dtype=torch.float64, device=device)
    for number, mean in means.items():
        if mean is not None:
            table[row_of[number]] = mean
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    values = table.tolist()
    return {number: values[row] for number, row in row_of.items()}
