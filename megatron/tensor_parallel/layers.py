"""Tensor-parallel layers: linear layers split by output (column) or input (row) features, and
an embedding split by vocabulary rows.

Two linear layers compose into a tensor-parallel MLP with one all-reduce forward and one
backward: ``ColumnParallelLinear(gather_output=False)`` -> activation ->
``RowParallelLinear(input_is_parallel=True)``.

Initialization is Megatron's "master weight, then split": every rank draws the full weight
with ``init_method`` from the default CPU generator and keeps its shard. The full weight is
therefore exactly what one process would draw with the same seed, so any tensor-parallel size
reproduces TP=1 numerics, and all TP ranks consume the generator identically (replicated
parameters initialized afterwards stay identical across ranks). The cost is a full-size fp32
CPU tensor per layer during initialization. `from_linear` / `from_embedding` turn a built plain
layer into this rank's parallel one (megatron.parallelize.steps): they copy its shard, or on the meta
device leave one for `reset_parameters` to draw.

Sequence parallelism (``sequence_parallel=True``) expects activations outside the tensor-
parallel region to be split along the sequence dimension of ``[batch, seq, hidden]`` (dim 1):
the column layer all-gathers its input, the row layer reduce-scatters its output. Parameters that
then see only a sequence shard (norms) are marked with `set_sequence_parallel_attribute`, and
`all_reduce_sequence_parallel_grads` sums their gradients over the tensor-parallel group.

A *strided* split (``stride`` s > 1, Megatron's ``partition_stride``) cuts the partition
dimension into s x tp equal blocks and gives rank r the blocks r, r + tp, ...: a fused SwiGLU
``fc1`` whose full rows are ``[gate; up]`` then leaves each rank ``[its gate rows; its up rows]``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.main_grads import gradient
from megatron.parallel import parallel_state
from megatron.parallel.dtensors import local_part
from megatron.parallel.parameter_swaps import replace_parameter
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

InitMethod = Callable[[torch.Tensor], object]

SEQUENCE_DIM = 1  # activations are [batch, seq, hidden]


def default_init_method(weight: torch.Tensor) -> None:
    """normal(0, 0.02), the GPT init Megatron's ``--init-method-std`` defaults to."""
    nn.init.normal_(weight, mean=0.0, std=0.02)


def normal_init_method(std: float) -> InitMethod:
    """normal(0, `std`): Megatron's init for every weight of a GPT model."""

    def init(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=std)

    return init


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, partition_dim: int, stride: int = 1
) -> None:
    """Mark ``param`` as a shard split along ``partition_dim`` (Megatron's attribute names), so
    checkpointing and grad-norm code can tell shards from replicated parameters."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def set_sequence_parallel_attribute(param: torch.Tensor) -> None:
    """Mark a replicated ``param`` that acts on sequence shards (a norm under sequence
    parallelism): each rank's gradient is a partial sum until `all_reduce_sequence_parallel_grads`."""
    param.sequence_parallel = True


def all_reduce_sequence_parallel_grads(params: Iterable[torch.Tensor]) -> None:
    """Sum the gradients of parameters marked `set_sequence_parallel_attribute` over the
    tensor-parallel group, in one flat all-reduce (Megatron does this once per step, after the
    data-parallel reduction). Every TP rank must call it."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [
        local_part(gradient(param))  # under FSDP2 each data-parallel rank's shard: summed alike
        for param in params
        if getattr(param, "sequence_parallel", False) and gradient(param) is not None
    ]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(reduced.view_as(grad))


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} {numerator} is not divisible by the tensor model parallel size "
            f"{denominator}; pad it to a multiple of {denominator}"
        )
    return numerator // denominator


def shard_tensor_model_parallel_weight(
    full: torch.Tensor,
    partition_dim: int,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    stride: int = 1,
) -> torch.Tensor:
    """The piece of ``full`` along ``partition_dim`` that TP rank ``rank`` of ``world_size``
    holds (default: this process's): its chunk, or with ``stride`` its strided blocks (see the
    module docstring). Communication-free, so offline checkpoint converters can cut every
    rank's shard in one process."""
    if world_size is None:
        world_size = parallel_state.get_tensor_model_parallel_world_size()
    if rank is None:
        rank = parallel_state.get_tensor_model_parallel_rank()
    if full.shape[partition_dim] % (world_size * stride) != 0:
        raise ValueError(
            f"dimension {partition_dim} of size {full.shape[partition_dim]} does not split into "
            f"{world_size} tensor-parallel shards of {stride} equal block(s) each; it must be a "
            f"multiple of {world_size * stride}"
        )
    blocks = full.detach().chunk(world_size * stride, partition_dim)
    return torch.cat(blocks[rank::world_size], dim=partition_dim)


def gather_tensor_model_parallel_weight(
    shard: torch.Tensor, partition_dim: Optional[int] = None, stride: Optional[int] = None
) -> torch.Tensor:
    """The full tensor, reassembled from every TP rank's ``shard`` along ``partition_dim``
    (default: the parameter's ``partition_dim`` attribute; a replicated parameter is copied),
    undoing a strided split when ``stride`` (default: the ``partition_stride`` attribute) > 1.
    A collective over the tensor-parallel group."""
    if partition_dim is None:
        if not getattr(shard, "tensor_model_parallel", False):
            return shard.detach().clone()
        partition_dim = shard.partition_dim
    if stride is None:
        stride = getattr(shard, "partition_stride", 1)
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    shard = shard.detach().contiguous()
    if world_size == 1:
        return shard.clone()
    parts = [torch.empty_like(shard) for _ in range(world_size)]
    dist.all_gather(parts, shard, group=parallel_state.get_tensor_model_parallel_group())
    # Rank r's shard holds blocks r, r + tp, ...: put block s of every rank back in order.
    blocks = [part.chunk(stride, partition_dim) for part in parts]
    return torch.cat(
        [blocks[rank][index] for index in range(stride) for rank in range(world_size)],
        dim=partition_dim,
    )


def _initialize_shard(
    shard: nn.Parameter,
    full_shape: tuple[int, ...],
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
) -> None:
    # Drawn in fp32 on CPU whatever the parameter's dtype and device: the numbers then match a
    # single-process CPU init with the same seed.
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        shard.copy_(shard_tensor_model_parallel_weight(master, partition_dim, stride=stride))


def _take_shards(
    parallel: nn.Module, plain: nn.Module, partition_dims: dict, stride: int = 1
) -> nn.Module:
    """Give `parallel` (built on the meta device) this rank's shard of each of `plain`'s
    parameters: {name: partition dim, or None for a replicated one}; returns `parallel`. A
    `plain` layer on the meta device leaves meta shards, whose weights are drawn later."""
    for name, partition_dim in partition_dims.items():
        full = getattr(plain, name)
        if full is None:
            continue
        if partition_dim is None:
            shard = full.detach().clone()
        else:
            shard = shard_tensor_model_parallel_weight(full, partition_dim, stride=stride)
        replace_parameter(parallel, name, shard)
    return parallel


class LinearProduct(nn.Module):
    """A parallel linear layer's local product, F.linear: a parameterless part that FP8 swaps for
    its own (megatron.kernels.fp8_linear.Fp8Product)."""

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by output features (rows of A) over TP ranks.

    Input: replicated ``[..., input_size]``, or ``[batch, seq / tp, input_size]`` with
    ``sequence_parallel``. Output: ``[..., output_size / tp]``, or all of ``output_size`` with
    ``gather_output``. The bias is split like the output features and zero-initialized.
    ``stride`` > 1 splits the rows in strided blocks (module docstring).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init_method,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        stride: int = 1,
    ) -> None:
        super().__init__()
        if gather_output and stride > 1:
            raise ValueError(
                "ColumnParallelLinear(gather_output=True) concatenates whole shards, which does "
                f"not restore a strided split (stride {stride}); use gather_output=False"
            )
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, world_size, "output size")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.stride = stride
        self.product: nn.Module = LinearProduct()
        self.weight = nn.Parameter(
            torch.empty(
                self.output_size_per_partition, input_size, dtype=params_dtype, device=device
            )
        )
        set_tensor_model_parallel_attributes(self.weight, partition_dim=0, stride=stride)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.bias, partition_dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(init_method)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, sequence_parallel: bool = False, stride: int = 1
    ) -> ColumnParallelLinear:
        """This rank's rows of `linear` (strided blocks with `stride`) as a column-parallel
        layer whose output stays split (``gather_output=False``)."""
        with torch.device("meta"):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                gather_output=False,
                sequence_parallel=sequence_parallel,
                params_dtype=linear.weight.dtype,
                stride=stride,
            )
        return _take_shards(layer, linear, {"weight": 0, "bias": 0}, stride)

    def reset_parameters(self, init_method: InitMethod = default_init_method) -> None:
        """Draw the full weight with ``init_method``, keep this rank's rows; zero the bias."""
        _initialize_shard(
            self.weight, (self.output_size, self.input_size), 0, init_method, self.stride
        )
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def init_own_weights(self, std: float, output_std: float) -> None:
        """Megatron's init for a model's weight (megatron.model.gpt_model.GPTModel.init_weights):
        normal(0, `std`) drawn whole, this rank's rows kept; a zero bias."""
        self.reset_parameters(normal_init_method(std))

    def autocast_cast_parameters(self) -> Tuple[str, ...]:
        """The parameters that only the product reads, which autocast casts to the compute
        dtype (megatron.parallelize.data_parallel may hold them in it): the weight and bias of
        F.linear; none when the product is another (FP8's)."""
        return ("weight", "bias") if type(self.product) is LinearProduct else ()

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, SEQUENCE_DIM)
        else:
            input_ = copy_to_tensor_model_parallel_region(input_)
        output = self.product(input_, self.weight, self.bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.output_size_per_partition}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by input features (columns of A) over TP ranks.

    Input: ``[..., input_size / tp]`` with ``input_is_parallel`` (a column layer's output), else
    replicated ``[..., input_size]`` that is split here. Output: replicated ``[..., output_size]``,
    or ``[batch, seq / tp, output_size]`` with ``sequence_parallel``. The bias is replicated,
    zero-initialized, and added once after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init_method,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True: its "
                "input must come split by features from a ColumnParallelLinear"
            )
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, world_size, "input size")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.product: nn.Module = LinearProduct()
        self.weight = nn.Parameter(
            torch.empty(
                output_size, self.input_size_per_partition, dtype=params_dtype, device=device
            )
        )
        set_tensor_model_parallel_attributes(self.weight, partition_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(init_method)

    @classmethod
    def from_linear(cls, linear: nn.Linear, sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's columns of `linear` (and its whole bias) as a row-parallel layer taking
        a column-parallel layer's split output (``input_is_parallel=True``)."""
        with torch.device("meta"):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                input_is_parallel=True,
                sequence_parallel=sequence_parallel,
                params_dtype=linear.weight.dtype,
            )
        return _take_shards(layer, linear, {"weight": 1, "bias": None})

    def reset_parameters(self, init_method: InitMethod = default_init_method) -> None:
        """Draw the full weight with ``init_method``, keep this rank's columns; zero the bias."""
        _initialize_shard(self.weight, (self.output_size, self.input_size), 1, init_method)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def init_own_weights(self, std: float, output_std: float) -> None:
        """Megatron's init for a model's weight (megatron.model.gpt_model.GPTModel.init_weights):
        normal(0, `std`) drawn whole, this rank's columns kept; a zero bias."""
        self.reset_parameters(normal_init_method(std))

    def autocast_cast_parameters(self) -> Tuple[str, ...]:
        """The weight, which only F.linear reads (megatron.parallelize.data_parallel); the bias
        is added to the reduced product in fp32."""
        return ("weight",) if type(self.product) is LinearProduct else ()

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_)
        partial = self.product(input_, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, SEQUENCE_DIM)
        else:
            output = reduce_from_tensor_model_parallel_region(partial)
        if self.bias is None:
            return output
        bias = self.bias
        if self.sequence_parallel:
            # Each rank adds the bias to its own sequence chunk only, so its gradient is a
            # partial sum; the copy's backward all-reduces it into the full, replicated gradient.
            bias = copy_to_tensor_model_parallel_region(bias)
        return output + bias

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.input_size_per_partition}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows over TP ranks.

    Each rank looks up the ids in its row range ``[rank * V / tp, (rank + 1) * V / tp)`` and
    contributes zeros for the others; an all-reduce assembles the full, replicated output.
    ``num_embeddings`` must be divisible by the TP size (Megatron pads the vocabulary).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: InitMethod = default_init_method,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = _divide(num_embeddings, world_size, "vocabulary size")
        self.vocab_start_index = (
            parallel_state.get_tensor_model_parallel_rank() * self.num_embeddings_per_partition
        )
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype, device=device
            )
        )
        set_tensor_model_parallel_attributes(self.weight, partition_dim=0)
        self.reset_parameters(init_method)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> VocabParallelEmbedding:
        """This rank's rows of `embedding` as a vocabulary-parallel table."""
        with torch.device("meta"):
            layer = cls(
                embedding.num_embeddings,
                embedding.embedding_dim,
                params_dtype=embedding.weight.dtype,
            )
        return _take_shards(layer, embedding, {"weight": 0})

    def reset_parameters(self, init_method: InitMethod = default_init_method) -> None:
        """Draw the full table with ``init_method`` and keep this rank's rows."""
        _initialize_shard(self.weight, (self.num_embeddings, self.embedding_dim), 0, init_method)

    def init_own_weights(self, std: float, output_std: float) -> None:
        """Megatron's init for a model's weight (megatron.model.gpt_model.GPTModel.init_weights):
        normal(0, `std`) drawn whole, this rank's rows kept."""
        self.reset_parameters(normal_init_method(std))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        # Ids of other ranks look up local row 0; the result is zeroed (and so is its gradient).
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"per_partition={self.num_embeddings_per_partition}"
        )
