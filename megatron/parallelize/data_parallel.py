"""A run's data-parallel mode: the one object that says how the replicas of the model keep and
move its parameters and gradients (torchtitan's `apply_ddp` / `apply_fully_shard` steps, as
one owner). `parallelize` builds it (step 7) and the rest of the run asks it:

- parallelize: `apply` wraps the model for its forwards (torch DDP, or nothing), and
  `compiles_by_layer` says whether its gradients must leave the backward layer by layer;
- the trainer: `build_optimizer`, then per step `micro_batch_context`, `last_backward_starts`,
  `after_backwards` (the reductions left after the last backward), and the parameter gathers'
  waits (`gathers_by_layer`, `install_parameter_waits`, `finish_parameter_gather`); around a
  checkpoint's save or load `full_precision_parameters`;
- the MoE hooks: `in_ddp` and `expert_parallel`, which say whether autograd's hooks reduce the
  expert weights' gradients;
- the memory planner, before any process group exists: the mode
  (megatron.parallelize.data_parallel_mode chooses it from the flags, in one place),
  `optimizer_shards` (whether it holds the weights in the compute dtype: Config.numerics).

Three modes:
- `Replicated`: every rank keeps the whole model and its optimizer state; the gradients are
  averaged by torch DDP, by one all-reduce after the last backward (pipeline, main gradients),
  or not at all (one replica): megatron.parallelize.gradient_sync.replicated_reduction.
- `ShardedOptimizerState` (`--use-distributed-optimizer`, ZeRO-1): every rank keeps the whole
  model and a shard of its optimizer state; the parameters and gradients live in flat buffers
  that reduce-scatter the gradients and all-gather the updated weights
  (megatron.optimizer.distributed_optimizer, which this mode builds over them). In a bf16 or
  fp16 run the weights autocast would cast (`autocast_cast_parameters`) are held in that dtype,
  with fp32 master weights of each rank's shard only, and gathered in it.

- `FullyShard` (`--use-torch-fsdp2`, megatron.parallelize.fully_shard): torch's FSDP2 shards
  the weights, gradients and optimizer state, and gathers each layer's weights for its forward
  and backward.

Checkpoints ask the optimizer it built (`MegatronOptimizer.unsharded_view` and
`state_pieces`), whichever mode built it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, List, Optional, Tuple

import torch
from torch import nn

from megatron.config.data_parallel_kind import DataParallelKind
from megatron.initialize import DistributedContext, print_rank_0
from megatron.model.transformer import TransformerLayer
from megatron.optimizer import MegatronOptimizer, build_optimizer
from megatron.optimizer.distributed_optimizer import (
    DistributedOptimizer,
    build_distributed_optimizer,
)
from megatron.parallel import parallel_state
from megatron.parallelize.gradient_sync import (
    DDP,
    OPTIMIZER,
    GradientSync,
    micro_batch_context,
    replicated_reduction,
    wrap_data_parallel,
)

if TYPE_CHECKING:
    from megatron.config import Config


class DataParallel:
    """The base of the modes: what every mode answers, and the gradient reductions left after
    the last backward (`GradientSync`, with the mode's `gradient_reduction`) that they share.
    `optimizer` is None until `build_optimizer`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.sync = GradientSync.of(
            config, self.gradient_reduction(config), self.reduces_expert_gradients_after_backward
        )
        self.optimizer: Optional[MegatronOptimizer] = None

    @classmethod
    def gradient_reduction(cls, config: Config) -> str:
        """Who averages this mode's gradients over the data-parallel group (one of
        megatron.parallelize.gradient_sync's names)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- what the run asks
    @property
    def in_ddp(self) -> bool:
        """Whether torch DDP reduces the gradients (its hooks then wait on autograd's
        accumulation)."""
        return self.sync.in_ddp

    @property
    def expert_parallel(self) -> bool:
        return self.sync.expert_parallel

    @property
    def pipeline(self) -> bool:
        return self.sync.pipeline

    @property
    def compiles_by_layer(self) -> bool:
        """Whether torch.compile must compile each transformer layer on its own, because the
        gradients are reduced while the backward runs, layer by layer."""
        return False

    @property
    def gathers_by_layer(self) -> bool:
        """Whether each layer's parameters arrive only just before its forward (the trainer
        then installs `install_parameter_waits`)."""
        return False

    def optimizer_shards(self) -> Tuple[int, int]:
        """Over how many ranks the optimizer state of (the dense, the expert) parameters is
        divided: the memory planner's question."""
        return 1, 1

    # Whether the expert-parallel shards' gradients (outside DDP and the flat all-reduce) are
    # averaged after the backward; the sharding modes reduce-scatter them with the rest.
    reduces_expert_gradients_after_backward = True

    # The flags' name for this mode (megatron.config.data_parallel_kind), which also says
    # whether it holds the weights in the compute dtype: Config.numerics asks it.
    kind: DataParallelKind

    @property
    def shards_parameters(self) -> bool:
        """Whether the parameters are DTensor shards outside their units' forward and backward
        (FSDP2): nothing may read them then."""
        return False

    # ------------------------------------------------------------------------ the model
    def apply(self, model: nn.Module, context: DistributedContext) -> nn.Module:
        """Step 7 of parallelize: what the forwards run (`model` itself, or it in DDP)."""
        return model

    def build_optimizer(self, model: nn.Module) -> MegatronOptimizer:
        """The optimizer over `model` (the unwrapped model, on its device), kept as
        `self.optimizer`."""
        raise NotImplementedError

    # ------------------------------------------------------------------------- the step
    def micro_batch_context(self, module: nn.Module, index: int, count: int) -> ContextManager:
        """Around micro-batch `index` of `count`'s forward and backward."""
        return micro_batch_context(module, index, count)

    def last_backward_starts(self) -> None:
        """Told before the step's last backward."""

    def after_backwards(self, model: nn.Module) -> None:
        """The reductions left after the last backward, before the optimizer reads the
        gradients; every rank calls it."""
        self.sync.after_backwards(model)

    def wait_for_parameters(self, params: Iterable[nn.Parameter]) -> None:
        """Until `params` hold the last step's values."""

    def finish_parameter_gather(self) -> None:
        """Until every parameter holds the last step's values (before anything but a forward
        reads them: a checkpoint, the end of training)."""

    def full_precision_parameters(self) -> ContextManager:
        """Within it every parameter holds its fp32 value, for a checkpoint to save or load;
        what they hold at its end is what the run goes on with. A collective."""
        return contextlib.nullcontext()


class Replicated(DataParallel):
    """Every rank keeps the whole model and optimizer; gradients averaged by DDP, by one
    all-reduce after the last backward, or not at all (megatron.parallelize.gradient_sync)."""

    kind = DataParallelKind.REPLICATED

    @classmethod
    def gradient_reduction(cls, config: Config) -> str:
        return replicated_reduction(config)

    def apply(self, model: nn.Module, context: DistributedContext) -> nn.Module:
        if self.sync.reduction != DDP:
            return model
        group = parallel_state.get_data_parallel_group() if context.world_size > 1 else None
        return wrap_data_parallel(model, context.device, group)

    def build_optimizer(self, model: nn.Module) -> MegatronOptimizer:
        self.optimizer = build_optimizer(model, self.config.optimizer, self.config.training)
        return self.optimizer


class ShardedOptimizerState(DataParallel):
    """`--use-distributed-optimizer` (ZeRO-1): the optimizer state sharded over the replicas,
    the gradients reduce-scattered (during the last backward with --overlap-grad-reduce) and
    the updated weights all-gathered (left in flight until each layer's forward with
    --overlap-param-gather); megatron.optimizer.distributed_optimizer."""

    optimizer: Optional[DistributedOptimizer]
    kind = DataParallelKind.SHARDED_OPTIMIZER_STATE
    # It reduce-scatters the expert gradients over the expert-data-parallel group itself.
    reduces_expert_gradients_after_backward = False

    @classmethod
    def gradient_reduction(cls, config: Config) -> str:
        return OPTIMIZER

    @property
    def compiles_by_layer(self) -> bool:
        # A backward compiled as one graph gives its gradients out only at its end.
        return self.config.parallel.overlap_grad_reduce

    @property
    def gathers_by_layer(self) -> bool:
        # Under a pipeline the schedules run the chunks' forwards: all wait before them.
        return self.config.parallel.overlap_param_gather and not self.pipeline

    def optimizer_shards(self) -> Tuple[int, int]:
        parallel = self.config.parallel
        dense = parallel.data_parallel_size
        return dense, max(1, dense // parallel.expert_model_parallel_size)

    def build_optimizer(self, model: nn.Module) -> DistributedOptimizer:
        parallel = self.config.parallel
        group = parallel_state.get_data_parallel_group() if _distributed() else None
        self.optimizer = build_distributed_optimizer(
            model,
            self.config.optimizer,
            self.config.training,
            group,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
            bucket_size=parallel.ddp_bucket_size,
            overlap_param_gather=parallel.overlap_param_gather,
            compute_dtype_params=(
                autocast_cast_parameters(model)
                if self.config.numerics.weights_in_compute_dtype
                else ()
            ),
        )
        print_rank_0(f"> {self.optimizer.memory_report()}")
        return self.optimizer

    def last_backward_starts(self) -> None:
        # With overlap the buckets reduce-scatter during the coming backward as they fill.
        self.optimizer.grad_reduce.arm()

    def wait_for_parameters(self, params: Iterable[nn.Parameter]) -> None:
        self.optimizer.param_gather.wait_for(params)

    def finish_parameter_gather(self) -> None:
        self.optimizer.param_gather.finish()

    def full_precision_parameters(self) -> ContextManager:
        return self.optimizer.full_precision_parameters()


def autocast_cast_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The parameters that autocast casts to the compute dtype wherever they are read, so that
    holding them in it changes no value a kernel sees: those the modules name
    (`autocast_cast_parameters()`: the parallel linear layers' weights and the bias a column-
    parallel layer passes to F.linear, the MoE experts' weights) and those of torch's nn.Linear
    (the untied output layer, the MoE router), which only F.linear reads. The rest stay fp32:
    the embeddings (a lookup, which autocast leaves in fp32), the norms (which it runs in fp32)
    and a row-parallel layer's bias (added to the product in fp32 after the reduction)."""
    chosen: List[nn.Parameter] = []
    for module in model.modules():
        if callable(getattr(module, "autocast_cast_parameters", None)):
            names = module.autocast_cast_parameters()
        elif type(module) is nn.Linear:
            names = ("weight", "bias")
        else:
            continue
        for name in names:
            param = getattr(module, name, None)
            if isinstance(param, nn.Parameter) and param.requires_grad:
                chosen.append(param)
    return chosen


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def install_parameter_waits(
    model: nn.Module,
    wait_for_parameters: Callable[[Iterable[nn.Parameter]], None],
    before_layer_forward: Callable[[nn.Module], None],
) -> None:
    """Forward hooks, ahead of any other, that wait (`wait_for_parameters`) for the all-gather
    of the parameters each module is about to use, so that the first module to run waits for
    the buckets gathered first and the last for the last, never for a bucket gathered behind
    others it does not need yet:
    - a transformer layer: its own, before its forward (then `before_layer_forward`, the
      training hooks' per-layer work);
    - a module outside the layers: its own and its children's, before its forward (a parent
      may read a child's weight without calling it: the tied output layer reads the word
      embedding's);
    - a module holding layers: its direct ones before its forward, and those of its children
      without layers once each child holding layers has run (the model reads its output
      layer's weight after the decoder without calling the output layer).
    """

    def before_layer(layer: nn.Module, _) -> None:
        wait_for_parameters(layer.parameters())
        before_layer_forward(layer)

    def wait_hook(params):
        return lambda *_: wait_for_parameters(params)

    def holds_layers(module: nn.Module) -> bool:
        return any(isinstance(child, TransformerLayer) for child in module.modules())

    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.register_forward_pre_hook(before_layer, prepend=True)
        elif not holds_layers(module):
            continue  # waited for by the module above it, outside the layers
        else:
            direct = list(module.parameters(recurse=False))
            if direct:
                module.register_forward_pre_hook(wait_hook(direct), prepend=True)
            children = list(module.children())
            outside = [
                p for child in children if not holds_layers(child) for p in child.parameters()
            ]
            for child in children:
                if holds_layers(child) and not isinstance(child, TransformerLayer):
                    child.register_forward_hook(wait_hook(outside), prepend=True)
                elif not holds_layers(child) and any(True for _ in child.parameters()):
                    child.register_forward_pre_hook(
                        wait_hook(list(child.parameters())), prepend=True
                    )
