"""The one place parallelism is applied to a built model, in named steps, in this order.

The entry point builds the whole model (`GPTModel(config.model, mlp_spec)`) and hands it to
`parallelize`, which returns what the trainer runs. Steps:

1. Tensor and sequence parallelism: layer choice at build time. `GPTModel` builds its linear
   layers and embedding as megatron.model.parallel_layers picks them from config.model
   (ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding, each drawing the full
   weight and keeping its shard, so any TP size starts from the TP=1 weights).
2. Expert placement: at build time too. An MoE layer keeps its expert-parallel block of experts
   (moe.experts, from its MoEConfig) and marks them (megatron.expert_parameters).
3. Pipeline split (`split_pipeline`): this rank's stage chunks, holding the whole model's weights.
4. Activation recomputation (`apply_activation_recomputation`): full (whole layers, by
   TransformerBlock) or selective (the core attention, by SelfAttention), per config.model.
5. Device placement.
6. Data parallelism (`data_parallel`): torch DDP around the model; or nothing, when the
   distributed optimizer reduce-scatters the gradients in its step or, under a pipeline, the
   trainer all-reduces them after the schedule.
7. Compile (`compile_model`): torch.compile of the whole model on GPUs, unless an extension's
   training hooks veto it (megatron.training_hooks).
Steps 1 and 2 still happen inside the model's constructors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from megatron import parallel_state
from megatron.distributed import wrap_data_parallel
from megatron.initialize import DistributedContext, print_rank_0
from megatron.model import GPTModel
from megatron.model.attention import SelfAttention
from megatron.model.transformer import TransformerBlock
from megatron.pipeline.stages import build_stage_model_chunks, full_to_stage_state_dict

if TYPE_CHECKING:
    from megatron.config import Config, ModelConfig


@dataclass
class ParallelModel:
    """A model with parallelism applied.

    `unwrapped` owns the parameters (the optimizer steps them, checkpoints save them): the
    model, or under a pipeline this rank's stage chunks as an nn.ModuleList. `module` is what
    forwards run: `unwrapped`, maybe in DDP, maybe compiled.
    """

    unwrapped: nn.Module
    module: nn.Module
    pipeline: bool
    wrapped_in_ddp: bool


def parallelize(
    model: GPTModel,
    config: Config,
    context: DistributedContext,
    compile_veto: Callable[[torch.device], Optional[str]] = lambda device: None,
) -> ParallelModel:
    """Apply steps 3 to 7 of the module docstring to the whole `model`, in order."""
    pipeline = parallel_state.get_pipeline_model_parallel_world_size() > 1
    unwrapped: nn.Module = split_pipeline(model) if pipeline else model
    apply_activation_recomputation(unwrapped, config.model)
    unwrapped = unwrapped.to(context.device)
    module, wrapped_in_ddp = data_parallel(unwrapped, config, context, pipeline)
    if config.training.torch_compile and context.device.type == "cuda" and not pipeline:
        module = compile_model(module, compile_veto(context.device))
    return ParallelModel(unwrapped, module, pipeline, wrapped_in_ddp)


def split_pipeline(whole: GPTModel) -> nn.ModuleList:
    """This rank's stage chunks (one without interleaving), holding `whole`'s weights.

    The whole model is drawn first, exactly as one process draws it, and each chunk takes its
    layers from it, so a pipeline run starts from the single-process weights (Megatron draws
    per stage instead, which gives other weights). That costs one whole model of CPU memory
    during set-up. The chunks are built under a forked RNG, so the generator state afterwards
    is the single-process one too (dropout masks then match).
    """
    whole_state = whole.state_dict()
    with torch.random.fork_rng(devices=[]):
        chunks = build_stage_model_chunks(whole.config, whole.mlp_spec)
    for chunk in chunks:
        chunk.load_state_dict(full_to_stage_state_dict(whole_state, chunk), strict=True)
    return nn.ModuleList(chunks)


def apply_activation_recomputation(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """Switch on config.recompute_granularity's recomputation in every block (or attention) of
    `model` (a model or its stage chunks); returns `model`. Raises ValueError when "full" lacks
    a method or a layer count."""
    granularity = model_config.recompute_granularity
    for module in model.modules():
        if granularity == "full" and isinstance(module, TransformerBlock):
            module.set_full_recompute(
                model_config.recompute_method, model_config.recompute_num_layers
            )
        elif granularity == "selective" and isinstance(module, SelfAttention):
            module.recompute_core_attention = True
    return model


def data_parallel(
    model: nn.Module, config: Config, context: DistributedContext, pipeline: bool
) -> tuple[nn.Module, bool]:
    """(`model` in torch DDP when DDP is what reduces its gradients, whether it is)."""
    wrap = (
        parallel_state.get_data_parallel_world_size() > 1
        and not config.parallel.use_distributed_optimizer
        and not pipeline
    )
    if not wrap:
        return model, False
    group = parallel_state.get_data_parallel_group() if context.world_size > 1 else None
    return wrap_data_parallel(model, context.device, group), True


def compile_model(model: nn.Module, veto: Optional[str]) -> nn.Module:
    """torch.compile(`model`), which fuses the elementwise work (norms, GELU, dropout, the
    loss) around the matmuls; with a `veto` the model stays eager and the reason is printed
    (a graph broken around Triton-launched kernels can run slower than eager)."""
    if veto is not None:
        print_rank_0(f"note: {veto}")
        return model
    return torch.compile(model)
