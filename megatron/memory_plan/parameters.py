"""Exact parameter counts per rank, from the model built on the meta device.

The whole model is built as one process builds it (`GPTModel(config.model, mlp_spec)` on the
meta device: no memory), then counted by part: embedding, each layer, final norm, output layer.
Sharding follows megatron.parallelize.steps without process groups:
- tensor parallelism by the module names its step splits (column-parallel `linear_qkv`,
  `linear_fc1` and the output layer: weight and bias; row-parallel `linear_proj`, `linear_fc2`:
  the weight, the bias stays whole; the word embedding by vocabulary rows); modules of an
  extension by the tensor-parallel styles of its MLP spec, applied to the meta model as rank 0
  of `size` (megatron.parallelize.tensor_parallelism.apply_styles; their shards then carry
  `tensor_model_parallel`);
- expert parallelism by the extension's own `place_experts(size, 0)`, whose parameters are then
  marked (megatron.parallel.expert_parameters);
- pipeline parallelism by megatron.pipeline.stages' layer split, the embedding on the first
  stage and the final norm and output layer on the last (with tied embeddings a last stage
  without the table holds a copy of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Tuple

import torch
from torch import nn

from megatron.model import GPTModel, MlpSpec
from megatron.parallel.expert_parameters import is_expert_parameter
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from megatron.parallelize.fp8_projections import PROJECTION_NAMES
from megatron.parallelize.tensor_parallelism import TensorParallelLayout, apply_styles
from megatron.pipeline.stages import stage_layer_numbers

if TYPE_CHECKING:
    from megatron.config import Config

# Names of the linear layers megatron.parallelize.steps splits, and how.
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "output_layer")
ROW_PARALLEL = ("linear_proj", "linear_fc2")


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter elements one rank holds, by kind.

    `dense` and `expert` split them by replica group (data-parallel vs expert-data-parallel);
    `matmul_weights` are the non-expert ones autocast casts to the compute dtype in every
    forward (linear layers and the output layer's weight, unless the run holds them in the
    compute dtype already). `compute_dense` and `compute_expert` are those the distributed
    optimizer holds in the compute dtype in a bf16 or fp16 run
    (megatron.parallelize.data_parallel.autocast_cast_parameters).
    """

    dense: int = 0
    expert: int = 0
    matmul_weights: int = 0
    compute_dense: int = 0
    compute_expert: int = 0

    @property
    def total(self) -> int:
        """Every element on the rank."""
        return self.dense + self.expert

    @property
    def compute(self) -> int:
        """Elements held in the compute dtype."""
        return self.compute_dense + self.compute_expert

    def __add__(self, other: ParameterCounts) -> ParameterCounts:
        return ParameterCounts(
            self.dense + other.dense,
            self.expert + other.expert,
            self.matmul_weights + other.matmul_weights,
            self.compute_dense + other.compute_dense,
            self.compute_expert + other.compute_expert,
        )


@dataclass(frozen=True)
class ModelParameterCounts:
    """One rank's share of each part of the whole model (layers by global number)."""

    embedding: ParameterCounts
    layers: Tuple[ParameterCounts, ...]
    final_norm: ParameterCounts
    output_layer: ParameterCounts  # the untied output layer, or the tied table's copy
    tied: bool

    def stage(self, config: Config, pipeline_rank: int) -> ParameterCounts:
        """What pipeline stage `pipeline_rank` holds (all its virtual chunks)."""
        parallel = config.parallel
        size = parallel.pipeline_model_parallel_size
        virtual = parallel.virtual_pipeline_model_parallel_size
        numbers: List[int] = []
        for chunk in range(virtual or 1):
            numbers += stage_layer_numbers(
                len(self.layers), size, pipeline_rank, virtual, chunk if virtual else None
            )
        counts = sum((self.layers[n] for n in numbers), ParameterCounts())
        first, last = pipeline_rank == 0, pipeline_rank == size - 1
        if first:
            counts = counts + self.embedding
        if last:
            counts = counts + self.final_norm
            if self.tied and first:
                # The logits multiply by the word table itself: only its autocast cast is new.
                counts = counts + ParameterCounts(matmul_weights=self.output_layer.dense)
            else:
                counts = counts + self.output_layer
        return counts


def count_parameters(config: Config, mlp_spec: MlpSpec) -> ModelParameterCounts:
    """This rank's share of the model `config` and `mlp_spec` build, counted on the meta device
    (see the module docstring for the sharding rules)."""
    model_config = config.model
    tensor = model_config.tensor_model_parallel_size
    expert = config.parallel.expert_model_parallel_size
    with torch.device("meta"):
        model = GPTModel(model_config, mlp_spec)
    for module in list(model.modules()):
        if expert > 1 and callable(getattr(module, "place_experts", None)):
            module.place_experts(expert, 0)
    if tensor > 1:
        layout = TensorParallelLayout(tensor, 0, model_config.sequence_parallel)
        apply_styles(model, mlp_spec.tensor_parallel_styles(), layout)
    data_parallel = data_parallel_mode(config)
    fp8 = config.numerics.fp8_format is not None
    holds = config.numerics.weights_in_compute_dtype
    rules = layer_rules = _Rules(tensor, fp8, holds)
    if data_parallel.shards_parameters:
        # FSDP2 gathers every parameter of a layer in the compute dtype, and the rest
        # (embeddings, final norm, output layer) in fp32, which autocast casts as in a
        # replicated run (megatron.parallelize.fully_shard).
        rules = _Rules(tensor, fp8, holds_compute_dtype=False)
        layer_rules = _Rules(tensor, fp8, holds, all_in_compute_dtype=holds)
    if model.output_layer is not None:
        output_layer = _count(model.output_layer, rules, name="output_layer")
    else:  # tied: a last stage without the table holds a copy (megatron.pipeline.stages)
        table = model.embedding.word_embeddings.weight.numel() // tensor
        output_layer = ParameterCounts(
            dense=table,
            matmul_weights=0 if rules.holds_compute_dtype else table,
            compute_dense=table,
        )
    return ModelParameterCounts(
        embedding=_count(model.embedding, rules),
        layers=tuple(_count(layer, layer_rules) for layer in model.decoder.layers),
        final_norm=_count(model.decoder.final_layernorm, rules),
        output_layer=output_layer,
        tied=model.output_layer is None,
    )


@dataclass(frozen=True)
class _Rules:
    """What decides how a parameter is counted: the tensor-parallel size, FP8 projections,
    whether the run holds weights in the compute dtype, and whether every weight, whatever
    autocast would do with it, arrives in it (FSDP2's gathers of a layer): then none is cast."""

    tensor: int
    fp8: bool
    holds_compute_dtype: bool
    all_in_compute_dtype: bool = False


def _count(module: nn.Module, rules: _Rules, name: str = "") -> ParameterCounts:
    """Elements of `module`'s parameters on tensor-parallel rank 0, by kind."""
    dense = expert = matmul = compute_dense = compute_expert = 0
    for module_name, owner in module.named_modules(prefix=name):
        last = module_name.rsplit(".", 1)[-1]
        for parameter_name, parameter in owner.named_parameters(recurse=False):
            elements = _local_elements(owner, last, parameter_name, parameter, rules.tensor)
            held = _held_in_compute_dtype(owner, last, parameter_name, rules.tensor, rules.fp8)
            if is_expert_parameter(parameter):
                expert += elements
                compute_expert += elements if held else 0
            else:
                dense += elements
                compute_dense += elements if held else 0
                cast = not (rules.all_in_compute_dtype or (held and rules.holds_compute_dtype))
                if isinstance(owner, nn.Linear) and cast:
                    matmul += elements
    return ParameterCounts(dense, expert, matmul, compute_dense, compute_expert)


def _held_in_compute_dtype(
    owner: nn.Module, name: str, parameter_name: str, tensor: int, fp8: bool
) -> bool:
    """megatron.parallelize.data_parallel.autocast_cast_parameters on the parallel model, from
    the plain one: a linear layer's parameters, but a row-parallel layer's bias (added after
    the reduction) and the FP8 projections' (megatron.parallelize.fp8_projections); a module's
    own `autocast_cast_parameters()`."""
    if isinstance(owner, nn.Linear):
        if fp8 and name in PROJECTION_NAMES:
            return False
        return not (tensor > 1 and name in ROW_PARALLEL and parameter_name == "bias")
    names = getattr(owner, "autocast_cast_parameters", None)
    return callable(names) and parameter_name in names()


def _local_elements(
    owner: nn.Module, name: str, parameter_name: str, parameter: nn.Parameter, tensor: int
) -> int:
    numel = parameter.numel()
    if tensor == 1 or getattr(parameter, "tensor_model_parallel", False):
        return numel  # whole, or already this rank's shard (an extension split it)
    if isinstance(owner, nn.Linear) and name in COLUMN_PARALLEL:
        return numel // tensor
    if isinstance(owner, nn.Linear) and name in ROW_PARALLEL and parameter_name == "weight":
        return numel // tensor
    if isinstance(owner, nn.Embedding) and name == "word_embeddings":
        return numel // tensor
    return numel
