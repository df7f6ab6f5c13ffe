"""`--use-distributed-optimizer`: the optimizer step sharded over data parallelism (ZeRO-1).

A `MegatronOptimizer` (same step, on shards) for a model *not* wrapped in DDP: every rank keeps
its full parameters but only a shard of their optimizer state, as Megatron-LM's
DistributedOptimizer. Under tensor, pipeline and expert parallelism a rank's parameters are its
tensor-parallel shards, its pipeline stage's layers and its experts, each sharded over the ranks
that hold a replica of it: the data-parallel group, or for expert-parallel shards
(`megatron.parallel.expert_parameters.is_expert_parameter`) the expert-data-parallel group.

Layout. The parameters are grouped by dtype, by that replica group (Megatron-Core's dense and
expert buffers), and by whether they are held in the compute dtype (`compute_dtype_params`, with
a bf16/fp16 `compute_dtype`: the weights autocast would cast, chosen by
megatron.parallelize.data_parallel): those buffers hold bf16/fp16 parameters, fp32 master
weights of this rank's shard only, which the inner optimizer steps, and fp32 main gradients
(megatron.optimizer.sharded_buffer.ShardedBuffer); the all-gather after the step moves the rounded
shards. With `--main-grads-dtype bf16`
the grad buffers are bf16 and hold the parameters' main gradients (megatron.main_grads), and the
pieces carry their shard of them as `main_grad` instead of `.grad`. Each group's parameters lie one
after another, in param-group order, in a flat *parameter buffer* padded at the end to split
into equal shards over its replica group; rank r of the group owns `[r * shard_size,
(r + 1) * shard_size)`. The model's parameters become views into it, so the all-gather writes
updated weights in place. A parameter may straddle a shard boundary: the inner torch optimizer
gets one 1-D *piece* (a view of the buffer, where fp32 parameters are their own master
weights, or of the master shard) per parameter the shard overlaps, in that parameter's group.
Checkpoints read and write the fp32 values (`full_precision_parameters`). A *grad buffer* of the same layout
holds the gradients: `zero_grad` binds each `param.grad` to its view so backward accumulates
there (grads autograd re-created elsewhere are copied in at `step`).

Step. What the trainer reduces before `step` (tied embeddings over the first and last pipeline
stage, sequence-parallel norms over the TP group) it sums into the grad buffers like any
gradient. Reduce-scatter each grad buffer over its replica group into this rank's shard grad and
divide by the data-parallel size: the mean over replicas for dense parameters, as DDP; expert
gradients already hold the tokens of their expert-parallel group, so their sum over the expert-
data-parallel group divided by the data-parallel size is the same mean
(`reduce_expert_gradients`). Then fp16 unscale + inf check (all ranks), the L2 norm from the
shards (`_global_grad_norm`), clip, step the inner optimizer on the pieces, all-gather.

Collectives: `reduce_scatter_single`/`all_gather_single` (torch 2.13; the deprecated `*_tensor`
names before). gloo has both since torch 2.2 (pytorch#112144, all-reduce plus slicing inside)
and this project needs torch>=2.4, so no gloo fallback is needed; the CPU tests run them.

Buckets: with `overlap_grad_reduce` each replica group's parameters are cut into buckets,
each its own flat buffers and shards, reduce-scattered while the last backward still runs
(megatron.optimizer.grad_reduce); otherwise a group's parameters are one bucket. With
`overlap_param_gather` the all-gather after the step is left in flight, and the trainer waits for
each bucket just before the forward that needs it (megatron.optimizer.param_gather).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig, TrainingConfig
from megatron.config.numerics import Numerics
from megatron.main_grads import gradient
from megatron.optimizer.grad_reduce import GradReduce, bucket_parameters, default_bucket_size
from megatron.optimizer.grad_scaler import GradScaler
from megatron.optimizer.memory_report import OptimizerMemoryReport, state_bytes_per_element
from megatron.optimizer.optimizer import (
    MegatronOptimizer,
    _sum_of_squares,
    build_inner_optimizer,
    counted_across_model_parallel_ranks,
    load_keeping_kernel_flags,
)
from megatron.optimizer.param_gather import ParamGather
from megatron.optimizer.sharded_buffer import ShardedBuffer
from megatron.optimizer.unsharded_view import UnshardedView, gather_full_state, load_full_state
from megatron.parallel import parallel_state
from megatron.parallel.expert_parameters import is_expert_parameter


@dataclass
class _Piece:
    """The part of one parameter, `param.view(-1)[start:end]`, that this rank's shard holds."""

    full_index: int  # the parameter's index in a non-distributed optimizer's state_dict
    param: nn.Parameter
    buffer: ShardedBuffer
    start: int
    end: int
    shard_offset: int  # where the piece begins within the local shard
    tensor: torch.Tensor  # view of the parameter buffer the inner optimizer updates


class DistributedOptimizer(MegatronOptimizer):
    """`MegatronOptimizer` with the optimizer state sharded over data parallelism: its step
    (unscale, norm, clip, inner step) runs on this rank's shard of the reduced gradients.

    `optimizer` is a torch optimizer built over the model's parameters with no state yet (as
    `build_optimizer` makes it); its param groups are re-pointed at this rank's shard pieces,
    so the LR scheduler's writes to `param_groups` reach the sharded step. The model's
    parameters become views into flat buffers and are broadcast from the first rank of their
    replica group, as DDP does at construction; do not move the model afterwards. Expert-
    parallel parameters are sharded over `expert_data_parallel_group` (default: parallel_state's).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scaler: Optional[GradScaler],
        clip_grad: float,
        log_num_zeros_in_grad: bool = False,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        expert_data_parallel_group: Optional[dist.ProcessGroup] = None,
        grad_dtype: Optional[torch.dtype] = None,
        overlap_grad_reduce: bool = False,
        bucket_size: Optional[int] = None,
        model_order: Optional[List[nn.Parameter]] = None,
        overlap_param_gather: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        compute_dtype_params: Sequence[nn.Parameter] = (),
    ) -> None:
        if optimizer.state:
            raise ValueError("DistributedOptimizer needs a torch optimizer that has not stepped")
        super().__init__(optimizer, grad_scaler, clip_grad, log_num_zeros_in_grad)
        self.group = data_parallel_group
        self.dp_size, self.dp_rank = _size_and_rank(data_parallel_group)
        # The model's parameters per group; flattened, a non-distributed state_dict's numbering.
        self.model_param_groups = [list(group["params"]) for group in optimizer.param_groups]
        self.model_params = [param for group in self.model_param_groups for param in group]
        in_compute_dtype = {id(param) for param in compute_dtype_params}
        by_kind: Dict[Tuple[torch.dtype, bool, bool], List[nn.Parameter]] = {}
        for param in self.model_params:
            kind = (param.dtype, is_expert_parameter(param), id(param) in in_compute_dtype)
            by_kind.setdefault(kind, []).append(param)
        if expert_data_parallel_group is None and any(expert for _, expert, _ in by_kind):
            expert_data_parallel_group = parallel_state.get_expert_data_parallel_group()
        if overlap_grad_reduce and bucket_size is None:
            bucket_size = default_bucket_size(self.dp_size)
        self.buffers: List[ShardedBuffer] = []
        queues = []
        for (_, expert, low_precision), params in by_kind.items():
            group = expert_data_parallel_group if expert else data_parallel_group
            size, rank = _size_and_rank(group)
            buckets = bucket_parameters(
                params, bucket_size if overlap_grad_reduce else None, model_order
            )
            # Both kinds end as the mean over the data-parallel replicas (module docstring).
            held = compute_dtype if low_precision else None
            queues.append(
                [
                    ShardedBuffer(b, group, size, rank, self.dp_size, grad_dtype, held)
                    for b in buckets
                ]
            )
            self.buffers.extend(queues[-1])
        self.grad_reduce = GradReduce(queues, overlap_grad_reduce)
        self.param_gather = ParamGather(queues, overlap_param_gather)

        location = {
            id(param): (buffer, index)
            for buffer in self.buffers
            for index, param in enumerate(buffer.params)
        }
        self.pieces: List[_Piece] = []  # in the inner optimizer's state_dict numbering
        full_index = 0
        for group in optimizer.param_groups:
            group_pieces = []
            for param in group["params"]:
                buffer, index = location[id(param)]
                local = buffer.local_range(index)
                if local is not None:
                    start, end = local
                    shard_offset = buffer.offsets[index] + start - buffer.shard_start
                    tensor = buffer.step_shard[shard_offset : shard_offset + end - start]
                    shard_grad = buffer.shard_grad[shard_offset : shard_offset + end - start]
                    # A gradient in another dtype than what is stepped is a main gradient.
                    if shard_grad.dtype != tensor.dtype:
                        tensor.main_grad = shard_grad
                    else:
                        tensor.grad = shard_grad
                    piece = _Piece(full_index, param, buffer, start, end, shard_offset, tensor)
                    group_pieces.append(piece)
                full_index += 1
            group["params"] = [piece.tensor for piece in group_pieces]
            self.pieces.extend(group_pieces)
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers and bind every `param.grad` to its view of them.

        `set_to_none` is accepted for `MegatronOptimizer`'s signature; grads are never set to
        None because the buffer is where backward should accumulate.
        """
        self.grad_reduce.reset()
        for buffer in self.buffers:
            buffer.bind_grads()

    def last_backward_starts(self) -> None:
        """With overlap: the buckets reduce-scatter during the coming backward as they fill."""
        self.grad_reduce.arm()

    def wait_for_parameters(self, params) -> None:
        """With overlapped parameter gathering: until `params` hold the last step's values."""
        self.param_gather.wait_for(params)

    def finish_parameter_gather(self) -> None:
        """Until every parameter holds the last step's values."""
        self.param_gather.finish()

    @contextlib.contextmanager
    def full_precision_parameters(self) -> Iterator[None]:
        """Within it every parameter holds its fp32 value (those held in the compute dtype are
        gathered from the master shards, a collective), for a checkpoint to save or load;
        what they hold at its end becomes their master shards and compute-dtype values."""
        self.param_gather.finish()
        with contextlib.ExitStack() as stack:
            for buffer in self.buffers:
                stack.enter_context(buffer.full_precision())
            yield

    def state_pieces(self) -> List[Tuple[torch.Tensor, torch.Tensor, Optional[int]]]:
        return [(piece.param, piece.tensor, piece.start) for piece in self.pieces]

    def _grads_to_step(self) -> List[torch.Tensor]:
        """Collective over the data-parallel group: this rank's shard of the reduced
        gradients, which the inner optimizer's param groups point at."""
        self.param_gather.finish()  # the step writes the parameters' shards
        self.grad_reduce.finish()
        return [buffer.shard_grad for buffer in self.buffers]

    def _after_step(self) -> None:
        self.param_gather.start()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard: `{"optimizer", "grad_scaler" (fp16 only), "shard_layout"}`.

        Loads back only at the same layout and model; to change it use `gather_full_state_dict`
        / `load_full_state_dict` (the checkpoints do, through `unsharded_view`).
        """
        state = {"optimizer": self.optimizer.state_dict(), "shard_layout": self._layout()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this rank's shard from `state_dict()` of a run with the same layout."""
        saved_layout = state_dict.get("shard_layout")
        if saved_layout != self._layout():
            raise ValueError(
                f"the optimizer shard was saved with layout {saved_layout} but this run has "
                f"{self._layout()}; a checkpoint written at another data-parallel size must be "
                "saved with gather_full_state_dict() and loaded with load_full_state_dict()"
            )
        load_keeping_kernel_flags(self.optimizer, state_dict["optimizer"])
        self._load_grad_scaler(state_dict)

    def gather_full_state_dict(self) -> Dict[str, Any]:
        """The unsharded state of this rank's parameters, structured as the state_dict() of a
        `MegatronOptimizer` over the same model (megatron.optimizer.unsharded_view.
        gather_full_state; a collective)."""
        return gather_full_state(self)

    def load_full_state_dict(self, full_state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of an unsharded state, whatever DP size wrote it
        (megatron.optimizer.unsharded_view.load_full_state)."""
        load_full_state(self, full_state_dict)
        self._load_grad_scaler(full_state_dict)

    def unsharded_view(self, gather: bool) -> UnshardedView:
        """This optimizer as the checkpoint code sees a `MegatronOptimizer` of this rank (see
        `UnshardedView`); `gather` collects the full state now, a collective on every rank."""
        return UnshardedView(self, self.gather_full_state_dict() if gather else None)

    def memory_report(self) -> OptimizerMemoryReport:
        """Optimizer-state bytes on this rank vs unsharded, for the log."""
        element_size = self.buffers[0].step_shard.element_size()
        parameters = sum(buffer.numel for buffer in self.buffers)
        local = sum(buffer.local_numel for buffer in self.buffers)
        state_bytes = state_bytes_per_element(self.optimizer)
        expert_sizes = [buffer.size for buffer in self.buffers if buffer.expert]
        distributed = dist.is_available() and dist.is_initialized()
        return OptimizerMemoryReport(
            rank=dist.get_rank() if distributed else 0,
            data_parallel_size=self.dp_size,
            expert_data_parallel_size=expert_sizes[0] if expert_sizes else None,
            parameters=parameters,
            local_parameters=local,
            master_bytes_per_rank=local * element_size,
            state_bytes_per_rank=local * state_bytes,
            master_bytes_unsharded=parameters * element_size,
            state_bytes_unsharded=parameters * state_bytes,
        )

    def _counted_grads(self) -> List[torch.Tensor]:
        """This rank's share of the gradient for the norm, each element counted on one rank.

        Within a replica group every buffer element is in one rank's shard, and the data-
        parallel group is every expert-parallel rank times its expert-data-parallel replicas:
        the shards of the data-parallel group cover this model-parallel rank's parameters,
        every expert included, once. Across model-parallel ranks `MegatronOptimizer`'s rules
        apply: a tensor-parallel-replicated parameter counts on TP rank 0 only, the last stage's
        copy of tied embeddings (`shared_embedding`) nowhere.
        """
        return [
            gradient(piece.tensor)
            for piece in self.pieces
            if counted_across_model_parallel_ranks(piece.param)
        ]

    def _global_grad_norm(self, grads: List[torch.Tensor]) -> float:
        """The norm of the whole model's gradient from every rank's shard (`grads`, the
        step's shard gradients, are not all counted: see `_counted_grads`)."""
        squares = _sum_of_squares(self._counted_grads(), self._device())
        return float(self._sum_over_ranks(squares).sqrt().item())

    def _count_zeros(self) -> int:
        count = sum(int((grad == 0).sum()) for grad in self._counted_grads())
        zeros = torch.tensor(count, dtype=torch.int64, device=self._device())
        return int(self._sum_over_ranks(zeros).item())

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the data-parallel group, then over the model-parallel one."""
        if self.dp_size > 1:
            dist.all_reduce(value, group=self.group)
        if (
            parallel_state.get_tensor_model_parallel_world_size() > 1
            or parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            dist.all_reduce(value, group=parallel_state.get_model_parallel_group())
        return value

    def _layout(self) -> Dict[str, Any]:
        return {
            "data_parallel_size": self.dp_size,
            "data_parallel_rank": self.dp_rank,
            "buffers": [
                (str(buffer.param_buffer.dtype), buffer.expert, buffer.numel, buffer.size)
                for buffer in self.buffers
            ],
        }

    def _device(self) -> torch.device:
        return self.buffers[0].param_buffer.device

    def _load_grad_scaler(self, state_dict: Dict[str, Any]) -> None:
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


def build_distributed_optimizer(
    model: nn.Module,
    optimizer_config: OptimizerConfig,
    training_config: TrainingConfig,
    data_parallel_group: Optional[dist.ProcessGroup] = None,
    log_num_zeros_in_grad: bool = False,
    overlap_grad_reduce: bool = False,
    bucket_size: Optional[int] = None,
    overlap_param_gather: bool = False,
    compute_dtype_params: Sequence[nn.Parameter] = (),
) -> DistributedOptimizer:
    """`build_optimizer`'s optimizer (same groups, hyper-parameters and loss scaler), sharded
    over `data_parallel_group` (the default group when None), expert-parallel parameters over
    parallel_state's expert-data-parallel group. The model must not be in DDP.
    `compute_dtype_params`: those held in the compute dtype, as the data-parallel mode answers
    (the run's Numerics.weights_in_compute_dtype; none without autocast)."""
    optimizer, grad_scaler = build_inner_optimizer(model, optimizer_config, training_config)
    numerics = Numerics.of(training_config, optimizer_config)
    return DistributedOptimizer(
        optimizer,
        grad_scaler,
        optimizer_config.clip_grad,
        log_num_zeros_in_grad,
        data_parallel_group,
        grad_dtype=numerics.main_grads_dtype,
        overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        model_order=list(model.parameters()),
        overlap_param_gather=overlap_param_gather,
        compute_dtype=numerics.compute_dtype,
        compute_dtype_params=compute_dtype_params,
    )


def _size_and_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(size, rank) in `group` (the default group when None); (1, 0) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
