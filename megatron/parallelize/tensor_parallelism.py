"""Tensor and sequence parallelism: step 1 of megatron.parallelize.steps, one mechanism for
the framework's modules and an extension's alike.

A *style* turns one plain module into its tensor-parallel form in place: it swaps the module's
torch layers and parameterless parts for their parallel forms (megatron.tensor_parallel) and
cuts what the module itself holds to this rank's share. `apply_tensor_parallel` walks a model
once and gives each module the style registered for its type (or the nearest base type): the
framework's `STYLES` below, plus those of the model's MLP spec
(`MlpSpec.tensor_parallel_styles`), through which an extension's modules (moe) take part. The
plain model holds no switch that parallelism sets; what it calls is what it holds.

Megatron's layout: column-parallel (output split) for attention's fused QKV, the MLP's fc1
(strided under SwiGLU, so each rank holds its gate and its up rows) and the untied output
layer; row-parallel (input split, partial outputs summed or reduce-scattered) for attention's
output projection and fc2; vocabulary-parallel for the word embedding and the output head.
Under sequence parallelism the residual stream between them is this rank's sequence shard: the
embedding's dropout keeps the shard, every norm sees one shard (its parameters are marked for
the gradient all-reduce over the TP group), and the layers draw their dropout from the rank's
stream, as Megatron's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional

from torch import nn

from megatron.model import GPTModel
from megatron.model.attention import DotProductAttention, SelfAttention
from megatron.model.embeddings import LanguageModelEmbedding
from megatron.model.mlp import MLP, MlpSpec
from megatron.model.norms import RMSNorm
from megatron.model.transformer import TransformerBlock
from megatron.parallel import parallel_state
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    PerRankRandom,
    PerRankRandomScope,
    RowParallelLinear,
    SequenceShard,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
    set_sequence_parallel_attribute,
)

if TYPE_CHECKING:
    from megatron.config import ModelConfig


@dataclass(frozen=True)
class TensorParallelLayout:
    """What a style needs to know: the tensor-parallel size, this rank in it, and whether the
    residual stream is split by sequence between the parallel layers."""

    size: int
    rank: int
    sequence_parallel: bool


TensorParallelStyle = Callable[[nn.Module, TensorParallelLayout], None]


def _gpt_model(model: GPTModel, layout: TensorParallelLayout) -> None:
    """The output layer (untied) keeps its vocabulary rows; the head computes the logits of
    those rows and the vocabulary-parallel loss."""
    if model.output_layer is not None:
        shared = getattr(model.output_layer.weight, "shared_embedding", False)
        model.output_layer = ColumnParallelLinear.from_linear(model.output_layer)
        if shared:
            model.output_layer.weight.shared_embedding = True
    if model.output_head is not None:
        model.output_head = VocabParallelOutputHead(layout.sequence_parallel)


def _embedding(embedding: LanguageModelEmbedding, layout: TensorParallelLayout) -> None:
    """The word table keeps its vocabulary rows; under sequence parallelism each rank keeps its
    sequence shard, and the shards differ, so their dropout masks must too."""
    embedding.word_embeddings = VocabParallelEmbedding.from_embedding(embedding.word_embeddings)
    if layout.sequence_parallel:
        dropout = embedding.embedding_dropout
        embedding.embedding_dropout = nn.Sequential(SequenceShard(), _per_rank(dropout))


def _transformer_block(block: TransformerBlock, layout: TensorParallelLayout) -> None:
    """Under sequence parallelism every dropout in the block acts on a sequence shard: the
    layers draw from the rank's stream (when anything in them drops out)."""
    draws = any(getattr(m, "p", 0.0) > 0.0 for m in block.modules() if isinstance(m, nn.Dropout))
    draws = draws or any(
        m.dropout > 0.0 for m in block.modules() if isinstance(m, DotProductAttention)
    )
    if layout.sequence_parallel and draws:
        block.random_source = PerRankRandomScope()


def _self_attention(attention: SelfAttention, layout: TensorParallelLayout) -> None:
    """This rank's query groups (and their heads): QKV split by whole groups, the output
    projection by its input channels; the heads differ per rank, so their dropout masks too."""
    if attention.num_query_groups % layout.size != 0:
        raise ValueError(
            f"{attention.num_query_groups} query groups do not split over a tensor-parallel "
            f"size of {layout.size}; choose --num-query-groups (or --num-attention-heads) "
            "divisible by it"
        )
    sequence_parallel = layout.sequence_parallel
    attention.linear_qkv = ColumnParallelLinear.from_linear(attention.linear_qkv, sequence_parallel)
    attention.linear_proj = RowParallelLinear.from_linear(attention.linear_proj, sequence_parallel)
    attention.num_heads //= layout.size
    attention.num_query_groups //= layout.size
    # Under sequence parallelism the block's scope covers it already (a nested fork would
    # replay the stream it forked from).
    if attention.core_attention.dropout > 0.0 and not sequence_parallel:
        attention.core_attention = PerRankRandom(attention.core_attention)


def _mlp(mlp: MLP, layout: TensorParallelLayout) -> None:
    """fc1 by output rows (in strided gate/up blocks under SwiGLU), fc2 by input columns."""
    stride = 2 if mlp.swiglu else 1
    sequence_parallel = layout.sequence_parallel
    mlp.linear_fc1 = ColumnParallelLinear.from_linear(mlp.linear_fc1, sequence_parallel, stride)
    mlp.linear_fc2 = RowParallelLinear.from_linear(mlp.linear_fc2, sequence_parallel)


def _norm(norm: nn.Module, layout: TensorParallelLayout) -> None:
    """Under sequence parallelism a norm sees one sequence shard per rank: its parameters'
    gradients are summed over the TP group (megatron.parallelize.gradient_sync)."""
    if layout.sequence_parallel:
        for param in norm.parameters():
            set_sequence_parallel_attribute(param)


def _per_rank(dropout: nn.Module) -> nn.Module:
    """`dropout` drawing from the rank's stream, or as it is when it draws nothing."""
    return PerRankRandom(dropout) if getattr(dropout, "p", 0.0) > 0.0 else dropout


STYLES: Dict[type, TensorParallelStyle] = {
    GPTModel: _gpt_model,
    LanguageModelEmbedding: _embedding,
    TransformerBlock: _transformer_block,
    SelfAttention: _self_attention,
    MLP: _mlp,
    nn.LayerNorm: _norm,
    RMSNorm: _norm,
}


def apply_tensor_parallel(
    model: nn.Module, model_config: ModelConfig, mlp_spec: Optional[MlpSpec] = None
) -> nn.Module:
    """Megatron's tensor (and with `model_config.sequence_parallel`, sequence) parallelism over
    the tensor-parallel group, applied in place to `model` (a GPT model, a stage chunk, or one
    module built by `mlp_spec`, which defaults to the model's own); returns it. Nothing changes
    at tensor-parallel size 1."""
    size = model_config.tensor_model_parallel_size
    if size == 1:
        return model
    _check_tensor_parallel_groups(size)
    if mlp_spec is None:
        mlp_spec = getattr(model, "mlp_spec", None) or MlpSpec()
    layout = TensorParallelLayout(
        size, parallel_state.get_tensor_model_parallel_rank(), model_config.sequence_parallel
    )
    return apply_styles(model, {**STYLES, **mlp_spec.tensor_parallel_styles()}, layout)


def apply_styles(
    model: nn.Module, styles: Mapping[type, TensorParallelStyle], layout: TensorParallelLayout
) -> nn.Module:
    """Give every module of `model` the style of its type, or of its nearest base type that has
    one, in `styles`; returns `model`. The modules are listed first: the parts swapped in are
    not visited again."""
    for module in list(model.modules()):
        style = next((styles[cls] for cls in type(module).__mro__ if cls in styles), None)
        if style is not None:
            style(module, layout)
    return model


def _check_tensor_parallel_groups(size: int) -> None:
    """The process groups must exist for the TP size the config asks for."""
    groups_size = parallel_state.get_tensor_model_parallel_world_size()
    if groups_size != size:
        raise ValueError(
            f"the model config asks for tensor_model_parallel_size={size} but the "
            f"tensor-parallel group has {groups_size} rank(s); call megatron.parallel."
            f"parallel_state.initialize_model_parallel(tensor_model_parallel_size={size}) first"
        )
