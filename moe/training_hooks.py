"""What the trainer does for MoE layers around each step (megatron.training.hooks).

- Compute copies of the expert weights (moe.experts.refresh_compute_weights): refreshed before
  the forwards of every step and evaluation (or, when each layer's weights arrive only before
  its forward, --overlap-param-gather, before each layer's first forward), their held
  gradients flushed after the backwards.
- The per-layer expert load (moe.expert_load) at each --log-interval: a line with
  --moe-per-layer-logging, histograms, spreads and each expert's share with
  --tensorboard-dir or --wandb-project.
- Under expert parallelism, the load imbalance over the expert-parallel ranks: its worst layer
  at the end of each iteration line, every layer in TensorBoard and W&B.
- The compile choice: the grouped backend compiles as one graph for the MoE with capacity
  (torch.bmm and plain-PyTorch gathers) and for the dMoE on a grouped GEMM that compiles whole
  (`compiles_whole`: torch._grouped_mm, which a run chooses where it is fast,
  moe.kernels.grouped_gemm.choose_backend); other MoE layers
  launch Triton kernels from Python and run faster eagerly, and so does a capacity of 0 (the
  busiest expert's count, a new size, hence a recompile, at every step). Under
  --moe-expert-parallel-chunked-overlap the chunks' all-to-alls are meant to run under the other
  chunks' experts, which Inductor keeps only with its communication passes
  (megatron.parallelize.steps.COLLECTIVES_UNDER_COMPUTE).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set

import torch
from torch import nn

from megatron import torch_floors
from megatron.initialize import print_rank_0
from megatron.parallelize.data_parallel import DataParallel
from megatron.parallelize.steps import CompileChoice
from megatron.training.hooks import TrainingHooks
from moe.block_factor import SHRINK_WINDOW, BlockFactor
from moe.config import MoEConfig
from moe.expert_load import (
    EXPERT_LOAD_TAG,
    format_expert_load_line,
    gather_expert_load,
    gather_expert_parallel_imbalance,
    gather_layer_losses,
    load_spread,
    tokens_over_mean,
)
from moe.experts import expert_modules, flush_expert_gradients, refresh_compute_weights
from moe.layers import moe_layers
from moe.router import auxiliary_loss_weights

# The iteration line's field (and TensorBoard scalar): the worst MoE layer's mean, over the
# window's forwards, of the most rows an expert-parallel rank received over the mean.
IMBALANCE_FIELD = "expert-parallel load imbalance"

EAGER_NOTE = (
    "this MoE model runs without torch.compile (the grouped backend compiles as one graph: "
    "the MoE with a capacity factor above 0, and the dMoE on torch._grouped_mm, bf16 on "
    f"NVIDIA Hopper with torch {torch_floors.spelled(torch_floors.GROUPED_MM)} or newer)"
)


def _expert_grads_in_place(data_parallel: DataParallel) -> bool:
    """Whether the copies add their gradients into the fp32 expert weights themselves. Not when
    torch DDP reduces the expert gradients: its hooks fire on autograd's accumulation, so the
    copies then stand in for the casts and leave accumulation to autograd (expert-parallel
    shards are outside DDP)."""
    return not (data_parallel.in_ddp and not data_parallel.expert_parallel)


class MoETrainingHooks(TrainingHooks):
    """The trainer's MoE work for a model built with `moe.mlp_spec.MoEMlpSpec(moe)`.
    `copies_dtype`: the run's Numerics.weight_copies_dtype, the dtype of the expert weights'
    per-step copies; None under --no-gradient-accumulation-fusion or in fp32, where autocast
    casts the weights in every micro-batch and autograd accumulates their gradients (less
    memory: no copies, no held gradients; the dMoE 125M fits an 80 GB GPU at micro batch 8 only
    this way)."""

    def __init__(
        self,
        moe: MoEConfig,
        copies_dtype: Optional[torch.dtype],
        num_layers: int,
        writes_metrics: bool,
    ) -> None:
        self.moe = moe
        self.moe_layer_numbers = [n for n in range(num_layers) if moe.is_moe_layer(n)]
        self.log_expert_load = moe.per_layer_logging or writes_metrics
        self.compute_dtype = copies_dtype
        self.grads_in_place = True
        self.expert_parallel = False  # the layout's, from `setup`
        self.device = torch.device("cpu")
        self.imbalance_per_layer: Dict[int, float] = {}
        self.step_start: Optional[StepStart] = None
        factor = moe.expert_parallel_buffer_factor
        self.block_factor = BlockFactor(factor) if factor is not None else None
        self.refresh_by_layer = False
        self.stale_copies: Set[int] = set()

    def compile_choice(self, device: torch.device) -> CompileChoice:
        moe = self.moe
        if moe.dropless:
            whole = moe.grouped_gemm.compiles_whole
        else:
            whole = moe.capacity_factor > 0
        return CompileChoice(
            veto=None if whole and moe.mlp_impl == "grouped" else EAGER_NOTE,
            overlap_collectives=moe.expert_parallel_chunks > 1,
        )

    def setup(self, model: nn.Module, data_parallel: DataParallel, device: torch.device) -> None:
        self.grads_in_place = _expert_grads_in_place(data_parallel)
        if data_parallel.shards_parameters:
            # Sharded outside their forward: the gathered weights are the compute copies.
            self.compute_dtype = None
        self.expert_parallel = data_parallel.expert_parallel
        self.device = device

    def before_step(self, model: nn.Module) -> bool:
        if self.moe.expert_parallel_buffer_factor is None:
            return False
        self.step_start = StepStart.of(model)
        return True

    def rerun_step(self, model: nn.Module) -> Optional[str]:
        """With fixed-size expert-parallel blocks: a step whose routing needed larger blocks
        than some layer had dropped rows, so it runs again with blocks that fit (the same
        routing: same weights, micro-batches and random draws); a stretch of steps that needed
        much smaller blocks shrinks them from the next step (moe.block_factor). One sync and
        one all-reduce per step."""
        layers = [layer for _, layer in moe_layers(model)]
        worst = torch.zeros(2, dtype=torch.float64, device=self.device)
        for layer in layers:
            worst = torch.maximum(worst, layer.step_block_need.to(self.device))
            layer.step_block_need.zero_()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
        # A pipeline stage may hold no MoE layer; it decides as the others do.
        ratio, need = worst.tolist()
        old = self.block_factor.factor
        if ratio <= 1.0:
            shrunk = self.block_factor.after_step(need)
            if shrunk is not None:
                window_need, smaller = shrunk
                self._set_block_factor(layers, smaller)
                print_rank_0(
                    f"note: the expert-parallel blocks shrink: the last {SHRINK_WINDOW} "
                    f"iterations needed at most {window_need:.2f}x the balanced share in their "
                    f"fullest block; the buffer factor goes from {old} to {smaller}"
                )
            return None
        factor = self.block_factor.grown(need)
        self._set_block_factor(layers, factor)
        self.step_start.restore(model)
        return (
            f"the expert-parallel blocks were {ratio:.2f}x too small for its routing; "
            f"the buffer factor grows from {old} to {factor} (pass "
            f"--moe-expert-parallel-buffer-factor {factor} to start there)"
        )

    @staticmethod
    def _set_block_factor(layers: List[nn.Module], factor: float) -> None:
        for layer in layers:
            layer.expert_parallel_buffer_factor = factor

    def weights_arrive_by_layer(self) -> None:
        self.refresh_by_layer = True

    def before_forwards(self, model: nn.Module) -> None:
        if self.moe.load_balancing_type == "global_aux_loss":
            # The step's balancing counts start afresh (a step run again included).
            for _, layer in moe_layers(model):
                layer.router.step_assignments.zero_()
        if self.compute_dtype is None:
            return
        if self.refresh_by_layer:
            # Each layer's copies are refreshed when its weights have arrived.
            self.stale_copies = {id(module) for module in expert_modules(model)}
            return
        refresh_compute_weights(model, self.compute_dtype, self.grads_in_place)

    def before_layer_forward(self, layer: nn.Module) -> None:
        if not self.stale_copies:
            return
        for module in expert_modules(layer):
            if id(module) in self.stale_copies:
                self.stale_copies.discard(id(module))
                module.refresh_compute_weights(self.compute_dtype, self.grads_in_place)

    def after_backwards(self, model: nn.Module) -> None:
        # Adds the expert gradients the copies still hold (moe.weight_copies.GradientAccumulator)
        # into the fp32 gradients, before anything reduces or reads them.
        if self.compute_dtype is not None and self.grads_in_place:
            flush_expert_gradients(model)

    def iteration_fields(self, model: nn.Module) -> Dict[str, float]:
        if not self.expert_parallel:
            return {}
        imbalance = gather_expert_parallel_imbalance(model, self.moe_layer_numbers, self.device)
        # The capacity-limited MoE exchanges fixed-size slots, balanced by construction: it
        # measures nothing, and the line carries no field rather than a 0.
        self.imbalance_per_layer = imbalance if max(imbalance.values()) > 0 else {}
        if not self.imbalance_per_layer:
            return {}
        return {IMBALANCE_FIELD: max(self.imbalance_per_layer.values())}

    def log(
        self,
        model: nn.Module,
        iteration: int,
        print_fn: Callable[[str], None],
        metric_writers: Optional[Any],
    ) -> Dict[str, Any]:
        if metric_writers is not None:
            for number, imbalance in self.imbalance_per_layer.items():
                metric_writers.log_scalars(
                    {f"{IMBALANCE_FIELD} layer {number}": imbalance}, iteration
                )
        if self.moe.per_layer_logging:
            # A collective: every rank takes part, rank 0 writes.
            names = tuple(auxiliary_loss_weights(self.moe))
            losses = gather_layer_losses(model, self.moe_layer_numbers, names, self.device)
            if metric_writers is not None:
                for number, values in losses.items():
                    metric_writers.log_scalars(
                        {f"moe/{name} layer {number}": value for name, value in values.items()},
                        iteration,
                    )
        if not self.log_expert_load:
            return {}
        load = gather_expert_load(model, self.moe_layer_numbers, self.moe.num_experts, self.device)
        if self.moe.per_layer_logging:
            print_fn(format_expert_load_line(load))
        if metric_writers is not None:
            for number, counts in load.items():
                highest, lowest = load_spread(counts)
                per_expert = {
                    EXPERT_LOAD_TAG.format(layer=number, expert=expert): share
                    for expert, share in enumerate(tokens_over_mean(counts))
                }
                metric_writers.log_scalars(
                    {
                        f"moe/tokens-per-expert max-over-mean layer {number}": highest,
                        f"moe/tokens-per-expert min-over-mean layer {number}": lowest,
                        **per_expert,
                    },
                    iteration,
                )
                metric_writers.log_histogram(
                    f"moe/tokens-per-expert layer {number}", counts, iteration
                )
        return {"expert load": {number: counts.tolist() for number, counts in load.items()}}


class StepStart:
    """What a training step changes in the MoE layers beyond their weights (counters, the
    expert bias and its pending counts, the imbalance window), kept so that a step run again
    starts from the same state."""

    def __init__(self, saved: Dict[nn.Module, Dict[str, torch.Tensor]]) -> None:
        self.saved = saved

    @classmethod
    @torch.no_grad()
    def of(cls, model: nn.Module) -> StepStart:
        saved = {}
        for _, layer in moe_layers(model):
            saved[layer] = {name: buffer.clone() for name, buffer in layer.named_buffers()}
        return cls(saved)

    @torch.no_grad()
    def restore(self, model: nn.Module) -> None:
        for _, layer in moe_layers(model):
            for name, buffer in layer.named_buffers():
                buffer.copy_(self.saved[layer][name])
