"""The experts' weights and their MLP (GELU) or GLU computation, on three token layouts.

Weights are stored per expert as matmul operands: w1 (and v1 for GLU) [E, h, f], w2 [E, f, h],
so one expert is `act(x @ w1[e]) @ w2[e]` (GLU: `(act(x @ w1[e]) * (x @ v1[e])) @ w2[e]`): one
expert's rows for the per-expert loop of the reference, a `torch.bmm` for the MoE's
capacity-padded slots, a grouped GEMM for the dMoE's rows sorted by expert.

Under tensor parallelism (Megatron-core's default, expert tensor parallel size = TP size) each
TP rank holds f / tp of every expert's ffn channels: w1 and v1 split on their last dim like a
column-parallel linear, w2 on its ffn dim like a row-parallel one. The experts then compute a
partial output, which the layer (moe.layers) sums over the TP group. Both that split and the
expert-parallel one are applied to built experts by megatron.parallelize.steps's steps, through
`keep_ffn_channels` (the experts' tensor-parallel style, moe.tensor_parallel) and
`place_experts`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.kernels.fp8_linear import Fp8Recipe, TensorShard
from megatron.parallel.expert_parameters import mark_expert_parallel
from megatron.parallel.parameter_swaps import replace_parameter
from megatron.tensor_parallel import set_tensor_model_parallel_attributes
from moe.kernels.fp8_grouped_gemm import (
    QuantizedExpertWeight,
    fp8_grouped_mm,
    quantize_expert_weight,
)
from moe.kernels.grouped_gemm import MOE, GroupedGemmBackend, grouped_product
from moe.kernels.scaled_activation import scaled_activation
from moe.weight_copies import CachedCast, GradientAccumulator

Projection = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
T = TypeVar("T")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Megatron's and MegaBlocks' default activation)."""
    return F.gelu(x, approximate="tanh")


class Experts(nn.Module):
    """E expert MLPs without biases (MegaBlocks' experts have none; the layer adds one).

    `activation` is "gelu" (tanh approximation) or "silu"; mlp_type "glu" gates it
    (SwiGLU with silu, GeGLU with gelu). With `memory_optimized`, the activation and the second
    projection are recomputed in backward, so only the first projection's output is kept.

    As built it holds every expert whole. After `place_experts(P, r)` it holds only the E / P
    experts of expert-parallel rank r, experts [r * E/P, (r + 1) * E/P), as [E/P, ...]
    parameters marked for moe.exchange; local expert i is global expert r * E/P + i.
    After `keep_ffn_channels(T, t)` (tensor parallelism) it holds channels
    [t * f/T, (t + 1) * f/T) of each expert's ffn (module docstring), marked with Megatron's
    tensor-parallel attributes so checkpoints and the grad norm treat them as shards.

    `grouped_gemm` is the grouped product of `forward_grouped` (a
    moe.kernels.grouped_gemm.GroupedGemmBackend); with `fp8` (an Fp8Recipe, set by
    moe.fp8_experts) its products are FP8 ones (moe.kernels.fp8_grouped_gemm).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        mlp_type: str = "mlp",
        activation: str = "gelu",
        memory_optimized: bool = False,
        init_std: float = 0.02,
        output_init_std: float = 0.02,
        grouped_gemm: GroupedGemmBackend = MOE,
    ) -> None:
        super().__init__()
        if mlp_type not in ("mlp", "glu"):
            raise ValueError(f"mlp_type must be 'mlp' or 'glu', got {mlp_type!r}")
        if activation not in ("gelu", "silu"):
            raise ValueError(f"activation must be 'gelu' or 'silu', got {activation!r}")
        self.num_experts = num_experts
        self.ffn_hidden_size = ffn_hidden_size
        # This rank's share, narrowed by `place_experts` and `keep_ffn_channels`.
        self.num_local_experts, self.first_local_expert = num_experts, 0
        self.local_ffn_hidden_size, self.first_local_channel = ffn_hidden_size, 0
        self.mlp_type = mlp_type
        self.activation_name = activation
        self.activation = gelu_tanh if activation == "gelu" else F.silu
        self.memory_optimized = memory_optimized
        self.grouped_gemm = grouped_gemm
        self.fp8: Optional[Fp8Recipe] = None
        # With `fp8` under tensor parallelism: the group the ffn channels are split over, whose
        # ranks quantize with common scales (moe.kernels.fp8_grouped_gemm).
        self.fp8_group: Optional[dist.ProcessGroup] = None
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        if mlp_type == "glu":
            self.v1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        else:
            self.register_parameter("v1", None)
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.init_own_weights(init_std, output_init_std)
        # Set by `weights_cast_once`: (w1, v1, w2) in the compute dtype, shared by every call.
        self._cast_weights: Optional[Tuple[torch.Tensor, ...]] = None
        # Set by `refresh_compute_weights`: copies in the compute dtype, kept between refreshes.
        self._compute_weights: Optional[Tuple[Optional[torch.Tensor], ...]] = None
        # With `fp8`, those copies quantized for the FP8 products, refreshed with them.
        self._fp8_weights: Optional[Tuple[Optional[QuantizedExpertWeight], ...]] = None
        self._accumulates_in_place = False
        self._accumulators: Tuple[GradientAccumulator, ...] = ()

    def forward(self, compute: Callable[..., T], *inputs: object) -> T:
        """`compute(*inputs)`, which runs these experts (any of the methods below): the MoE
        layer's one call into them, so that what wraps a module's forward covers every path.
        Under --use-torch-fsdp2 with expert parallelism the experts are a unit of their own
        (megatron.parallelize.fully_shard), whose weights are gathered around this call and
        whose gradients are reduced after its backward."""
        return compute(*inputs)

    def keep_ffn_channels(self, size: int, rank: int) -> None:
        """Keep channels [rank * f/size, (rank + 1) * f/size) of every expert's ffn (a copy of
        them, or meta ones on the meta device) and mark the weights as tensor-parallel shards."""
        if self.ffn_hidden_size % size != 0:
            raise ValueError(
                f"the experts' FFN size {self.ffn_hidden_size} (--moe-ffn-hidden-size, or "
                f"--ffn-hidden-size without it) is not divisible by --tensor-model-parallel-size "
                f"{size}: each tensor-parallel rank holds an equal share of every expert's ffn "
                "channels; choose a multiple of it"
            )
        self.local_ffn_hidden_size = self.ffn_hidden_size // size
        self.first_local_channel = rank * self.local_ffn_hidden_size
        for shard in self._keep_slices(
            lambda weight: _ffn_dim(weight, self),
            self.first_local_channel,
            self.local_ffn_hidden_size,
        ):
            set_tensor_model_parallel_attributes(shard, partition_dim=_ffn_dim(shard, self))

    def place_experts(self, size: int, rank: int) -> None:
        """Keep the experts of expert-parallel rank `rank` of `size`, [rank * E/size,
        (rank + 1) * E/size) (a copy of them, or meta ones), marked as expert-parallel."""
        if self.num_experts % size != 0:
            raise ValueError(
                f"{self.num_experts} experts do not split evenly over an expert parallel size "
                f"of {size}; use a number of experts that is a multiple of it"
            )
        if size == 1:
            return
        self.num_local_experts = self.num_experts // size
        self.first_local_expert = rank * self.num_local_experts
        for block in self._keep_slices(
            lambda weight: 0, self.first_local_expert, self.num_local_experts
        ):
            mark_expert_parallel(block)

    def _keep_slices(
        self, dim_of: Callable[[torch.Tensor], int], start: int, length: int
    ) -> List[nn.Parameter]:
        """Replace each weight by its slice [start, start + length) along `dim_of(weight)`: a
        copy, or a meta slice on the meta device. Returns the new parameters."""
        kept = []
        for name in ("w1", "v1", "w2"):
            weight = getattr(self, name)
            if weight is not None:
                piece = weight.detach().narrow(dim_of(weight), start, length).clone()
                kept.append(replace_parameter(self, name, piece))
        return kept

    @torch.no_grad()
    def init_own_weights(self, std: float, output_std: float) -> None:
        """Megatron's init: normal(0, std) input projections, normal(0, output_std) for w2
        (the scaled init of layers that add to the residual stream).

        A shard draws all E experts with all f channels and keeps its own, so that every
        expert and tensor parallel size consumes the generator alike and gets the
        single-process weights.
        """
        for weight, weight_std in ((self.w1, std), (self.v1, std), (self.w2, output_std)):
            if weight is None:
                continue
            ffn_dim = _ffn_dim(weight, self)
            full_shape = list(weight.shape)
            full_shape[0], full_shape[ffn_dim] = self.num_experts, self.ffn_hidden_size
            if list(weight.shape) == full_shape:
                nn.init.normal_(weight, mean=0.0, std=weight_std)
                continue
            full = weight.new_empty(full_shape)
            nn.init.normal_(full, mean=0.0, std=weight_std)
            full = full.narrow(0, self.first_local_expert, self.num_local_experts)
            weight.copy_(full.narrow(ffn_dim, self.first_local_channel, self.local_ffn_hidden_size))

    def autocast_cast_parameters(self) -> Tuple[str, ...]:
        """Every weight: the projections read them in the activations' compute dtype only
        (megatron.parallelize.data_parallel may hold them in it, and then no copies are made:
        `refresh_compute_weights`)."""
        return ("w1", "v1", "w2")

    @torch.no_grad()
    def refresh_compute_weights(self, dtype: torch.dtype, accumulate_in_place: bool) -> None:
        """Keep a `dtype` copy of each weight for the forwards until the next refresh.

        Under autocast every micro-batch would otherwise cast the fp32 expert weights again
        (for a dMoE 125M, 3.6 billion weights: 22 GB of memory traffic per micro-batch); the
        trainer refreshes once per optimizer step and before evaluation instead
        (`refresh_compute_weights` below).

        How the gradient reaches the fp32 weight (moe.weight_copies):
        - `accumulate_in_place`: the copy is a leaf of the autograd graph, and its hook
          (`GradientAccumulator`) adds its gradients into the fp32 weight's `.grad`, two
          micro-batches per fused pass (Megatron's gradient-accumulation fusion). The fp32 weight
          then never gets a gradient through autograd, so this is only for weights no autograd
          hook waits for (torch DDP's do); `flush_gradients` must follow the last backward.
        - otherwise: the copy stands in for the cast in the autograd graph (`CachedCast`), and
          the gradient reaches the fp32 weight as the cast's would.
        """
        self.flush_gradients()  # a backward nobody flushed: its gradients go where they belong
        weights = (self.w1, self.v1, self.w2)
        if self.w1.dtype == dtype:  # the weights themselves are in the compute dtype
            self._compute_weights = None
            self._accumulators = ()
            self._refresh_fp8_weights()
            return
        copies = self._compute_weights
        reusable = (
            copies is not None
            and self._accumulates_in_place == accumulate_in_place
            and all(
                copy is None or (copy.dtype == dtype and copy.device == weight.device)
                for copy, weight in zip(copies, weights)
            )
        )
        if reusable:
            for copy, weight in zip(copies, weights):
                if copy is not None:
                    copy.copy_(weight)  # in place: a compiled graph holds these very tensors
                    copy.grad = None
            self._refresh_fp8_weights()
            return
        self._accumulates_in_place = accumulate_in_place
        copies, accumulators = [], []
        for weight in weights:
            copy = None if weight is None else weight.detach().to(dtype)
            if copy is not None and accumulate_in_place:
                accumulator = GradientAccumulator(weight)
                copy.requires_grad_(True)
                copy.register_post_accumulate_grad_hook(accumulator)
                accumulators.append(accumulator)
            copies.append(copy)
        self._compute_weights = tuple(copies)
        self._accumulators = tuple(accumulators)
        self._fp8_weights = None
        self._refresh_fp8_weights()

    @torch.no_grad()
    def _refresh_fp8_weights(self) -> None:
        """With `fp8`, quantize the weights the forwards use (the compute copies, or the
        weights themselves when they are in the compute dtype) for the FP8 products once per
        refresh (once per optimizer step), not in every micro-batch's forward and backward; in
        place after the first time, as the copies themselves."""
        if self.fp8 is None:
            self._fp8_weights = None
            return
        used = self._compute_weights or (self.w1, self.v1, self.w2)
        fresh = [
            None if weight is None else quantize_expert_weight(weight, self.fp8, shard)
            for weight, shard in zip(used, self._fp8_shards())
        ]
        if self._fp8_weights is None:
            self._fp8_weights = tuple(fresh)
            return
        for held, new in zip(self._fp8_weights, fresh):
            for held_tensor, new_tensor in zip(held or (), new or ()):
                held_tensor.copy_(new_tensor)

    def _fp8_shards(self) -> Tuple[Optional[TensorShard], ...]:
        """How (w1, v1, w2) are split for the FP8 products: w1 and v1 by their output columns,
        w2 by its input rows, over `fp8_group`; nothing without tensor parallelism."""
        if self.fp8_group is None:
            return (None, None, None)
        by_output, by_input = TensorShard(0, self.fp8_group), TensorShard(1, self.fp8_group)
        return (by_output, by_output, by_input)

    def flush_gradients(self) -> None:
        """Add any held micro-batch gradients into the fp32 weights (`GradientAccumulator`)."""
        for accumulator in self._accumulators:
            accumulator.flush()

    def _in_dtype(self, dtype: torch.dtype) -> Tuple[Optional[torch.Tensor], ...]:
        """(w1, v1, w2) in `dtype`: the refreshed copies when there are some, else casts."""
        weights = (self.w1, self.v1, self.w2)
        copies = self._compute_weights
        if copies is None or copies[0].dtype != dtype or self.w1.dtype == dtype:
            return tuple(None if weight is None else weight.to(dtype) for weight in weights)
        if self._accumulates_in_place:
            return copies
        return tuple(
            None if weight is None else CachedCast.apply(weight, copy)
            for weight, copy in zip(weights, copies)
        )

    @contextlib.contextmanager
    def weights_cast_once(self, dtype: torch.dtype) -> Iterator[None]:
        """Within it, every projection uses one cast of each weight to `dtype`.

        A layer that runs its experts on several row blocks in one forward (the overlapped
        expert-parallel exchange runs three) would otherwise cast the fp32 master weights once
        per block, and accumulate one fp32 gradient per block in the backward.
        """
        self._cast_weights = self._in_dtype(dtype)
        try:
            yield
        finally:
            self._cast_weights = None

    def projection_weights(
        self, dtype: Optional[torch.dtype] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(w1, v1, w2) for inputs of `dtype`: inside `weights_cast_once` its casts; else the
        refreshed copies when they are in `dtype`; else the parameters (the projections cast)."""
        if self._cast_weights is not None:
            return self._cast_weights
        copies = self._compute_weights
        if dtype is not None and copies is not None and copies[0].dtype == dtype:
            return self._in_dtype(dtype)
        return self.w1, self.v1, self.w2

    def _mlp(
        self,
        x: torch.Tensor,
        project: Projection,
        row_scale: Optional[torch.Tensor] = None,
        weights: Optional[Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = None,
        valid_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The expert MLP on x with `project(input, weight)` as the matmul of each projection;
        `row_scale` [rows] multiplies each row's activations before the second projection.
        `weights`: (w1, v1, w2) as `projection_weights(x.dtype)` gave them, or None to ask.
        `valid_rows`: int32 [1], the rows the products compute (the others are padding, which
        the scaled activation leaves alone too)."""
        w1, v1, w2 = weights or self.projection_weights(x.dtype)
        hidden = project(x, w1)
        gate_input = project(x, v1) if v1 is not None else None

        def activation_and_output(hidden, gate_input, w2, row_scale):
            if row_scale is not None and gate_input is None and hidden.dim() == 2:
                # One op, forward and backward, for the activation, the scaling and the
                # scaling's gradient (moe.kernels.scaled_activation: the same rounding).
                scaled = scaled_activation(hidden, row_scale, self.activation_name, valid_rows)
                return project(scaled, w2)
            intermediate = self.activation(hidden)
            if gate_input is not None:
                intermediate = intermediate * gate_input
            if row_scale is not None:
                # In fp32: the router's weights (fp32 under autocast) are not rounded to bf16
                # before they scale the row.
                scaled = intermediate.float() * row_scale.float().unsqueeze(-1)
                intermediate = scaled.to(intermediate.dtype)
            return project(intermediate, w2)

        if self.memory_optimized and torch.is_grad_enabled():
            return checkpoint(
                activation_and_output, hidden, gate_input, w2, row_scale, use_reentrant=False
            )
        return activation_and_output(hidden, gate_input, w2, row_scale)

    def forward_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `expert` alone on its tokens x [n, h] (the per-expert loop's building
        block)."""

        def project(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return inputs @ weight[expert]

        return self._mlp(x, project)

    def forward_batched(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert on its capacity-padded slot block: x [E, C, h] -> [E, C, h] (bmm)."""
        return self._mlp(x, torch.bmm)

    def forward_grouped(
        self,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        offsets: torch.Tensor,
        row_scale: torch.Tensor,
    ) -> torch.Tensor:
        """The dMoE's experts: rows sorted by expert, x [N, h], local expert e owning the next
        tokens_per_expert[e] rows (`offsets`: their int32 inclusive cumulative sums), each row's
        output scaled by `row_scale` [N] (the router's weight of the row).

        The scaling is applied to the activations before the second projection: the same as
        scaling the output rows (the projection is linear), without a pass over them, and the
        combine's backward is then a plain gather. For the plain MLP one op does the activation,
        the scaling and their gradients (moe.kernels.scaled_activation); for GLU Inductor fuses
        the scaling into the activation's kernels. The products are the run's grouped GEMM
        (moe.kernels.grouped_gemm.grouped_product, chosen once into `grouped_gemm`).
        """

        weights = self.projection_weights(x.dtype)
        quantized = self._fp8_weights or (None, None, None)
        shards = self._fp8_shards()

        def project(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if self.fp8 is not None and inputs.shape[0] > 0:
                index = next(i for i, w in enumerate(weights) if w is weight)
                # Quantized from the compute-dtype weight, as the bf16 product multiplies it:
                # every path to here (casts, refreshed copies, fp32 master) scales the same.
                weight = weight.to(inputs.dtype)
                return fp8_grouped_mm(
                    inputs, weight, offsets, self.fp8, quantized[index], shards[index]
                )
            return grouped_product(inputs, weight, tokens_per_expert, offsets, self.grouped_gemm)

        # Rows past the groups (expert-parallel padding, moe.exchange.fixed_blocks) are in no
        # product; the activation skips them too.
        return self._mlp(x, project, row_scale, weights, valid_rows=offsets[-1:])


def _ffn_dim(weight: torch.Tensor, experts: Experts) -> int:
    """The ffn dimension of an expert weight: 2 of w1 / v1 [E, h, f], 1 of w2 [E, f, h]."""
    return 1 if weight is experts.w2 else 2


def flush_expert_gradients(model: nn.Module) -> None:
    """Add the expert gradients still held by the copies' accumulators into the fp32 weights'
    `.grad`. The trainer calls it after the last backward of each step, before the gradients
    are reduced, clipped or stepped."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.flush_gradients()


def expert_modules(model: nn.Module) -> List[Experts]:
    """The Experts modules of `model`, in its order."""
    return [module for module in model.modules() if isinstance(module, Experts)]


def refresh_compute_weights(model: nn.Module, dtype: torch.dtype, accumulate_in_place: bool) -> int:
    """`Experts.refresh_compute_weights` on every Experts module of `model`; returns how many
    there are. Call it after every change of the weights (the trainer: at the start of each
    training step and of each evaluation), since forwards use the copies until then."""
    experts = expert_modules(model)
    for module in experts:
        module.refresh_compute_weights(dtype, accumulate_in_place)
    return len(experts)
