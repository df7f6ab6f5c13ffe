"""The peak GPU memory of one training rank, in parts, from the frozen config.

Bytes per parameter (the model's parameters are fp32 and are the master weights; mixed
precision is autocast, megatron.optimizer.optimizer):
- weights: 4 per parameter on the rank; where the distributed optimizer holds the weights
  autocast would cast in the compute dtype (megatron.parallelize.data_parallel), 2 for those
  and `master_weights`, 4 per element of this rank's shard of them;
- gradients: the fp32 `.grad`, 4; with `--main-grads-dtype bf16` a bf16 main grad, 2, plus the
  fp32 `.grad` autograd still makes for non-expert parameters during each backward, 4; the
  distributed optimizer adds its fp32 shard of the reduced gradients (4 per parameter over the
  replica group: data-parallel, or expert-data-parallel for experts);
- optimizer: Adam's two moments at their dtypes' sizes (4, or 2 for bf16/fp16), SGD's momentum
  4, on the share of parameters not offloaded to the host, sharded like the shard gradients
  under the distributed optimizer; the precision-aware step's fp32 working copies of at most
  `step_chunk_elements` elements of 4 tensors are transient, during the step only;
- what the MLP spec adds (megatron.model.mlp.MlpMemory): persistent weight copies, gradients
  held between micro-batches, weight casts per micro-batch.
Under FSDP2 (`--use-torch-fsdp2`, megatron.parallelize.fully_shard) the parameters are fp32
shards and the master weights themselves: weights 4, gradients 4 (FSDP2 keeps the sharded
gradients in the parameters' dtype, whatever the reduce dtype) and the optimizer state, all per
element of this rank's shard (over the data-parallel ranks, or a hybrid group of them; the
experts over the expert-data-parallel ranks). During a backward it holds, unsharded, the
`gathered_weights` and `gathered_gradients` (`_fully_sharded_gathers` says which). A layer
arrives gathered in the compute dtype, every weight of it, so autocast casts only the weights
of the root unit (embeddings, final norm, output layer), which is gathered in fp32.
Activations are megatron.memory_plan.activations' bytes per token times the tokens of the
micro-batches a stage holds at once; every in-flight micro-batch also keeps autocast's casts
of the matmul weights it used (2 per element). The peak is the larger of the backward's (all of
the above but the step's working copies), the end of a backward's (no activations, but the
gradients a compiled backward returns at once: the MoE experts' in the compute dtype, or
every compute-dtype weight's, of the whole stage, or under full recomputation of one
checkpointed chunk) and the step's (no
activations); the caching
allocator's reserve above it is `ALLOCATOR_OVERHEAD`. The rank estimated is the pipeline stage
with the largest peak.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, List, Optional, Tuple

from megatron.kernels.adamw import STEP_CHUNK
from megatron.memory_plan.activations import (
    CUDA_MASK_BYTES,
    backward_workspace_per_token,
    embedding_bytes_per_token,
    fused_linear_loss_bytes,
    in_flight_micro_batches,
    layer_bytes_per_token,
    logits_bytes_per_token,
    output_bytes_per_token,
    recompute_kept_fraction,
)
from megatron.memory_plan.parameters import (
    ModelParameterCounts,
    ParameterCounts,
    count_parameters,
)
from megatron.model import DENSE_MLP, MlpSpec
from megatron.model.mlp import MlpMemory
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from megatron.pipeline.stages import stage_layer_numbers

if TYPE_CHECKING:
    from megatron.config import Config
    from megatron.parallelize.fully_shard import FullyShard

GIB = 1024**3
# The caching allocator's reserved memory beyond the peak it allocated, as a fraction of that
# peak: measured against torch.cuda.max_memory_reserved (BENCHMARKS.md, "Memory planner";
# bench/memory_plan.py measures it).
ALLOCATOR_OVERHEAD = 0.01
# Elements the precision-aware step's reference upcasts to fp32 at once (megatron.kernels.adamw).
DEFAULT_STEP_CHUNK_ELEMENTS = STEP_CHUNK
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on one GPU, by part; `total` is what the run should reserve at its peak."""

    weights: int
    expert_weight_copies: int
    gradients: int
    held_gradients: int
    optimizer: int
    optimizer_step_buffers: int
    activations: int
    weight_casts: int
    logits: int
    activations_worst_case: int  # `activations` with the worst routing imbalance
    # The compute-dtype gradients of the weights whose modules add their own gradients (the MoE
    # experts' copies), or of the weights held in the compute dtype: a compiled backward
    # returns all of a micro-batch's at its end, before their hooks add them in
    # (moe.weight_copies, megatron.main_grads).
    returned_gradients: int = 0
    # The fp32 master weights of this rank's shard of the weights held in the compute dtype.
    master_weights: int = 0
    # FSDP2's unsharded weights and gradients during a backward (`_fully_sharded_gathers`).
    gathered_weights: int = 0
    gathered_gradients: int = 0
    pipeline_rank: int = 0
    device_memory: Optional[int] = None

    @property
    def state(self) -> int:
        """What every moment of a step holds: weights, their copies and masters, gradients,
        optimizer."""
        return (
            self.weights
            + self.expert_weight_copies
            + self.master_weights
            + self.gradients
            + self.optimizer
        )

    @property
    def gathered(self) -> int:
        """FSDP2's unsharded weights and gradients: the most a backward holds at once."""
        return self.gathered_weights + self.gathered_gradients

    @property
    def backward_peak(self) -> int:
        """Allocated at the start of the last micro-batch's backward."""
        activations = self.activations + self.weight_casts + self.logits
        return self.state + self.held_gradients + self.gathered + activations

    @property
    def backward_end_peak(self) -> int:
        """Allocated as a micro-batch's backward returns: the activations are freed, its
        self-accumulated gradients all exist beside the held ones."""
        return self.state + self.held_gradients + self.gathered + self.returned_gradients

    @property
    def step_peak(self) -> int:
        """Allocated during the optimizer step (activations freed, held gradients flushed)."""
        return self.state + self.optimizer_step_buffers

    @property
    def allocated(self) -> int:
        """The peak the allocator hands out (compare with torch.cuda.max_memory_allocated)."""
        return max(self.backward_peak, self.backward_end_peak, self.step_peak)

    @property
    def allocator_overhead(self) -> int:
        """What the caching allocator reserves beyond `allocated` (ALLOCATOR_OVERHEAD)."""
        return int(self.allocated * ALLOCATOR_OVERHEAD)

    @property
    def total(self) -> int:
        """The estimated peak reserved memory (compare with torch.cuda.max_memory_reserved)."""
        return self.allocated + self.allocator_overhead

    @property
    def worst_case_total(self) -> int:
        """`total` with the activations of the worst routing imbalance."""
        extra = self.activations_worst_case - self.activations
        peak = max(self.backward_peak + extra, self.backward_end_peak, self.step_peak)
        return int(peak * (1 + ALLOCATOR_OVERHEAD))

    @property
    def fits(self) -> Optional[bool]:
        """Whether `total` fits the device memory; None when it is unknown."""
        return None if self.device_memory is None else self.total <= self.device_memory

    def parts(self) -> dict:
        """Every field but the rank and device, in bytes."""
        skip = ("pipeline_rank", "device_memory")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def gib(num_bytes: float) -> str:
    """Bytes in GiB with one decimal."""
    return f"{num_bytes / GIB:.1f}"


def format_estimate_line(estimate: MemoryEstimate) -> str:
    """Megatron-style start-up line: `> estimated peak memory per GPU: X GiB of Y GiB
    (weights A, gradients B, optimizer C, activations D, logits E)`, in GiB; weights include
    the expert copies, the fp32 masters and FSDP2's gathered weights, gradients the held and
    FSDP2's unsharded ones, activations autocast's weight casts."""
    device = "unknown" if estimate.device_memory is None else f"{gib(estimate.device_memory)} GiB"
    weights = (
        estimate.weights
        + estimate.expert_weight_copies
        + estimate.master_weights
        + estimate.gathered_weights
    )
    gradients = estimate.gradients + estimate.held_gradients + estimate.gathered_gradients
    return (
        f"> estimated peak memory per GPU: {gib(estimate.total)} GiB of {device} ("
        f"weights {gib(weights)}, "
        f"gradients {gib(gradients)}, "
        f"optimizer {gib(estimate.optimizer)}, "
        f"activations {gib(estimate.activations + estimate.weight_casts)}, "
        f"logits {gib(estimate.logits)})"
    )


def estimate_memory(
    config: Config,
    mlp_spec: MlpSpec = DENSE_MLP,
    device_memory: Optional[int] = None,
    step_chunk_elements: int = DEFAULT_STEP_CHUNK_ELEMENTS,
    mask_bytes: int = CUDA_MASK_BYTES,
) -> MemoryEstimate:
    """The peak of the pipeline stage that needs most, on a GPU of `device_memory` bytes
    (None: unknown). `mask_bytes` is a dropout mask's element size (1 on CUDA)."""
    whole = count_parameters(config, mlp_spec)
    stages = [
        _estimate_stage(config, mlp_spec, whole, rank, step_chunk_elements, mask_bytes)
        for rank in range(config.parallel.pipeline_model_parallel_size)
    ]
    peak = max(stages, key=lambda estimate: estimate.total)
    return _with_device(peak, device_memory)


def _with_device(estimate: MemoryEstimate, device_memory: Optional[int]) -> MemoryEstimate:
    values = {f.name: getattr(estimate, f.name) for f in fields(estimate)}
    values["device_memory"] = device_memory
    return MemoryEstimate(**values)


def _estimate_stage(
    config: Config,
    mlp_spec: MlpSpec,
    whole: ModelParameterCounts,
    pipeline_rank: int,
    step_chunk_elements: int,
    mask_bytes: int,
) -> MemoryEstimate:
    model, optimizer, parallel = config.model, config.optimizer, config.parallel
    counts = whole.stage(config, pipeline_rank)
    c = config.numerics.compute_bytes
    numbers = _stage_layer_numbers(config, pipeline_rank)
    extra = mlp_spec.memory(config, numbers)

    # Replica groups the optimizer state shards over (FSDP2: the parameters too).
    data_parallel = data_parallel_mode(config)
    dense_shards, expert_shards = data_parallel.optimizer_shards()
    sharded = -(-counts.dense // dense_shards) + -(-counts.expert // expert_shards)
    low = masters = 0
    gathered_weights = gathered_gradients = 0
    if data_parallel.shards_parameters:
        # The fp32 shards are the parameters and the master weights; their gradients are fp32
        # shards beside them.
        weights = gradients = 4 * sharded
        gathered_weights, gathered_gradients = _fully_sharded_gathers(
            config, whole, numbers, counts, data_parallel
        )
    else:
        # Weights held in the compute dtype, with fp32 masters of this rank's shard only.
        if config.numerics.weights_in_compute_dtype:
            low = counts.compute
            masters = 4 * (
                -(-counts.compute_dense // dense_shards)
                + -(-counts.compute_expert // expert_shards)
            )
        weights = 4 * (counts.total - low) + c * low
        gradients = _replica_gradient_bytes(config, counts, extra, dense_shards, expert_shards)

    if optimizer.optimizer == "adam":
        state_bytes = (
            _DTYPE_BYTES[optimizer.exp_avg_dtype] + _DTYPE_BYTES[optimizer.exp_avg_sq_dtype]
        )
    else:
        state_bytes = 4 if optimizer.sgd_momentum else 0
    on_device = 1.0
    if optimizer.optimizer_cpu_offload:
        on_device = 1.0 - optimizer.optimizer_offload_fraction
    optimizer_bytes = int(state_bytes * sharded * on_device)
    step_buffers = 0
    if optimizer.use_precision_aware_optimizer:
        step_buffers = 4 * 4 * min(step_chunk_elements, sharded)

    activations, worst, casts = _activation_bytes(
        config, mlp_spec, whole, pipeline_rank, c, mask_bytes, extra.casts_per_micro_batch
    )
    # A compiled backward returns the self-accumulated gradients of the layers it covers at
    # once. Full recomputation runs each checkpointed chunk's backward on its own (the MoE
    # layer's side effects keep torch.compile from tracing through the checkpoint), so only the
    # largest chunk's, or the layers left outside any checkpoint, exist together.
    kept, _, rerun = recompute_kept_fraction(model, len(numbers))
    together = max(kept, rerun / len(numbers)) if numbers else 1.0
    returned = int(c * (extra.self_accumulated_weights + low) * together)
    last = pipeline_rank == parallel.pipeline_model_parallel_size - 1
    tokens = config.training.micro_batch_size * config.data.seq_length
    fused = config.training.kernels != "reference"
    if not last:
        logits = 0
    elif model.linear_cross_entropy_fusion:
        logits = fused_linear_loss_bytes(model, tokens, c)
    else:
        logits = int(tokens * logits_bytes_per_token(model, c, fused))
    return MemoryEstimate(
        weights=weights,
        expert_weight_copies=extra.weight_copies,
        gradients=gradients,
        held_gradients=extra.held_gradients,
        optimizer=optimizer_bytes,
        optimizer_step_buffers=step_buffers,
        activations=activations,
        weight_casts=casts,
        logits=logits,
        activations_worst_case=worst,
        returned_gradients=returned,
        master_weights=masters,
        gathered_weights=gathered_weights,
        gathered_gradients=gathered_gradients,
        pipeline_rank=pipeline_rank,
    )


def _replica_gradient_bytes(
    config: Config, counts: ParameterCounts, extra: MlpMemory, dense_shards: int, expert_shards: int
) -> int:
    """The gradients of a rank that holds the whole model (DDP, the distributed optimizer):
    the main gradients of every parameter, and each shard's reduced gradient."""
    model = config.model
    low_precision_grads = config.optimizer.main_grads_dtype == "bf16"
    grad_bytes = 2 if low_precision_grads else 4
    gradients = grad_bytes * counts.total
    if low_precision_grads and counts.total > extra.self_accumulated_weights:
        # Autograd's fp32 .grad of one parameter at a time, added into its main gradient and
        # freed by the hook (megatron.main_grads); the word embeddings are the largest.
        vocab_shard = model.padded_vocab_size // model.tensor_model_parallel_size
        gradients += 4 * vocab_shard * model.hidden_size
    # Each shard's reduced gradient; a replica group of one rank reduces in place.
    gradients += grad_bytes * (
        (-(-counts.dense // dense_shards) if dense_shards > 1 else 0)
        + (-(-counts.expert // expert_shards) if expert_shards > 1 else 0)
    )
    return gradients


def _fully_sharded_gathers(
    config: Config,
    whole: ModelParameterCounts,
    numbers: List[int],
    counts: ParameterCounts,
    data_parallel: FullyShard,
) -> Tuple[int, int]:
    """(weights, gradients) in bytes that FSDP2 holds unsharded during a backward, at most
    (megatron.parallelize.fully_shard gathers the layers in the compute dtype and the root unit,
    the embeddings, final norm and output layer, in fp32):
    - weights: the root unit's, which FSDP2 keeps gathered from the forward to the end of the
      backward, and two layer units' (the one running and the one prefetched; a layer's
      experts are in its unit or in a unit inside it);
    - gradients, in the dtype their weights were gathered in: the root unit's (reduced only as
      the backward ends) and one layer unit's beside them; and the reduce-scatter input of the
      larger of the two units in the reduce dtype (FSDP2 copies a unit's gradients into one
      flat input).
    """
    c = config.numerics.compute_bytes
    reduce_bytes = data_parallel.gradient_reduce_dtype.itemsize
    largest_layer = max((whole.layers[n].total for n in numbers), default=0)
    root = counts.total - sum(whole.layers[n].total for n in numbers)
    weights = 4 * root + c * 2 * largest_layer
    gradients = 4 * root + c * largest_layer + reduce_bytes * max(root, largest_layer)
    return weights, gradients


def _activation_bytes(
    config: Config,
    mlp_spec: MlpSpec,
    whole: ModelParameterCounts,
    pipeline_rank: int,
    c: int,
    mask_bytes: int,
    expert_casts: int,
) -> Tuple[int, int, int]:
    """(expected, worst-case activation bytes, weight-cast bytes) of one stage at its peak."""
    model, parallel, training = config.model, config.parallel, config.training
    pipeline = parallel.pipeline_model_parallel_size
    virtual = parallel.virtual_pipeline_model_parallel_size
    numbers = _stage_layer_numbers(config, pipeline_rank)
    layers = [layer_bytes_per_token(model, mlp_spec, n, c, mask_bytes) for n in numbers]
    in_flight, chunks = in_flight_micro_batches(
        pipeline, pipeline_rank, training.num_micro_batches, virtual
    )
    micro_batches = in_flight / chunks  # in-flight micro-batches' worth of the whole stage
    tokens = training.micro_batch_size * config.data.seq_length
    share = (1.0 / model.tensor_model_parallel_size) if model.sequence_parallel else 1.0

    kept, checkpoints, rerun = recompute_kept_fraction(model, len(layers))
    checkpoint_bytes = checkpoints * 4 * model.hidden_size * share
    largest = max(layers, key=lambda layer: layer.worst_case) if layers else None
    expected = sum(layer.expected for layer in layers) * kept + checkpoint_bytes
    worst = sum(layer.worst_case for layer in layers) * kept + checkpoint_bytes
    if pipeline_rank == 0:
        expected += embedding_bytes_per_token(model, mask_bytes)
        worst += embedding_bytes_per_token(model, mask_bytes)
    if pipeline_rank == pipeline - 1:
        expected += output_bytes_per_token(model, c)
        worst += output_bytes_per_token(model, c)
    # Once per stage, not per micro-batch: a recomputed chunk's layers and one layer's backward.
    once_expected = once_worst = 0.0
    if largest is not None:
        once_expected = rerun * largest.expected + backward_workspace_per_token(model, largest)
        once_worst = rerun * largest.worst_case + backward_workspace_per_token(model, largest)

    # Autocast casts of the matmul weights (none in fp32): the layers' follow recomputation.
    stage_matmuls = whole.stage(config, pipeline_rank).matmul_weights
    layer_matmuls = sum(whole.layers[n].matmul_weights for n in numbers)
    layer_casts = (2 * layer_matmuls if c == 2 else 0) + expert_casts
    other_casts = 2 * (stage_matmuls - layer_matmuls) if c == 2 else 0
    rerun_fraction = rerun / len(layers) if layers else 0.0
    casts = micro_batches * (layer_casts * kept + other_casts) + layer_casts * rerun_fraction
    return (
        int(tokens * (micro_batches * expected + once_expected)),
        int(tokens * (micro_batches * worst + once_worst)),
        int(casts),
    )


def _stage_layer_numbers(config: Config, pipeline_rank: int) -> List[int]:
    """Global numbers of the layers pipeline stage `pipeline_rank` holds (all its chunks)."""
    parallel = config.parallel
    virtual = parallel.virtual_pipeline_model_parallel_size
    numbers: List[int] = []
    for chunk in range(virtual or 1):
        numbers += stage_layer_numbers(
            config.model.num_layers,
            parallel.pipeline_model_parallel_size,
            pipeline_rank,
            virtual,
            chunk if virtual else None,
        )
    return numbers
