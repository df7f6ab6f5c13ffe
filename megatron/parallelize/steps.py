"""The one place parallelism is applied to a model, in named steps, in this order.

The entry point builds the whole model as plain PyTorch at world size 1, on the meta device so
that it holds no memory (`GPTModel(config.model, mlp_spec)` under ``torch.device("meta")``),
and hands it to `parallelize`, which returns what the trainer runs. Steps:

1. Tensor and sequence parallelism (megatron.parallelize.tensor_parallelism): each module gets
   the style of its type, the framework's or the model's MLP spec's: linear layers and the word
   embedding become Megatron's parallel layers holding this rank's shard, attention keeps its
   share of the heads, the output head, dropouts and core attention their parallel parts.
2. Expert placement (`place_experts`): expert layers keep their expert-parallel block of
   experts and mark them (megatron.parallel.expert_parameters).
3. Weights (`materialize_weights`): a model built on the meta device gets storage and draws
   its weights; every parallel layer draws its full weight and keeps its shard, so any layout
   starts from the single-process weights.
   Then, with --fp8-format, the projections' products in FP8, and the MLP spec's FP8 styles
   (the dMoE's grouped expert GEMMs; megatron.parallelize.fp8_projections).
4. Pipeline split (`split_pipeline`): this rank's stage chunks, taking their modules from the
   whole model.
5. Activation recomputation (`apply_activation_recomputation`): full (whole layers, by
   TransformerBlock) or selective (the core attention, by SelfAttention), per config.model.
6. Device placement.
7. Data parallelism: the run's mode (megatron.parallelize.data_parallel.DataParallel, which
   the trainer then asks for the optimizer and the step's reductions and gathers) wraps the
   model: in torch DDP; in torch's fully_shard units (FSDP2, megatron.parallelize.fully_shard);
   or not, when the distributed optimizer reduce-scatters the gradients in its step or, under a
   pipeline, the trainer all-reduces them after the schedule.
8. Compile (`compile_model`): torch.compile of the whole model on GPUs, or of each layer where
   the gradients must leave the backward layer by layer or hooks around the layers must stay
   eager (`DataParallel.compiles_by_layer`), as an extension's training hooks choose
   (`CompileChoice`, megatron.training.hooks): eager when they veto it, and with Inductor's
   passes that keep collectives under the computation when their layers overlap the two.

Steps 1 and 2 also work on a model built with real weights (its shards are copied, so a
world-size-1 model and its parallel form hold the same numbers). Modules of an extension
(megatron.model.mlp.MlpSpec) take part through the styles their spec names (step 1) and
`place_experts(size, rank)`, which step 2 calls on any module defining it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
from torch import nn

from megatron.initialize import DistributedContext, print_rank_0
from megatron.kernels.fp8_linear import recipe_for
from megatron.model import GPTModel, MlpSpec
from megatron.model.attention import DotProductAttention
from megatron.model.transformer import TransformerBlock, TransformerLayer
from megatron.parallel import parallel_state
from megatron.parallel.expert_parameters import expert_parameters
from megatron.parallel.parameter_swaps import materialize
from megatron.parallelize.data_parallel import DataParallel
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from megatron.parallelize.fp8_projections import apply_fp8, check_fp8_device
from megatron.parallelize.tensor_parallelism import apply_tensor_parallel
from megatron.pipeline.stages import stage_layer_numbers

if TYPE_CHECKING:
    from megatron.config import Config, ModelConfig, ParallelConfig


@dataclass(frozen=True)
class CompileChoice:
    """How a run's model is compiled, as the extension's training hooks choose
    (megatron.training.hooks.TrainingHooks.compile_choice). `veto`: why it stays eager (printed
    as a note), None when it compiles. `overlap_collectives`: its layers issue collectives meant
    to run under their computation (the expert-parallel chunks'), which Inductor's
    communication passes keep there (`COLLECTIVES_UNDER_COMPUTE`)."""

    veto: Optional[str] = None
    overlap_collectives: bool = False


# Inductor, left alone, emits each collective just before its wait, where its result is first
# used, so collectives meant to overlap run one after the other, exposed. Its communication
# passes move each collective up to where its input is ready (raise_comms) and each wait down
# to where its result is needed (sink_waits), forward and backward. Given as torch.compile's
# options, they hold for that model's graphs only, not for the process.
COLLECTIVES_UNDER_COMPUTE: Dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"],
}


@dataclass
class ParallelModel:
    """A model with parallelism applied.

    `unwrapped` owns the parameters (the optimizer steps them, checkpoints save them): the
    model, or under a pipeline this rank's stage chunks as an nn.ModuleList. `module` is what
    forwards run: `unwrapped`, maybe in DDP, maybe compiled. `layout`: the tensor-, pipeline-,
    expert- and data-parallel sizes it was parallelized for; `data_parallel`: how its replicas
    keep and reduce its parameters and gradients, decided from that layout.
    """

    unwrapped: nn.Module
    module: nn.Module
    data_parallel: DataParallel
    layout: ParallelConfig

    @property
    def pipeline(self) -> bool:
        """Whether `unwrapped` holds this rank's pipeline stage chunks."""
        return self.layout.pipeline_model_parallel_size > 1


def parallelize(
    model: GPTModel,
    config: Config,
    context: DistributedContext,
    compile_choice: Callable[[torch.device], CompileChoice] = lambda device: CompileChoice(),
) -> ParallelModel:
    """Apply the steps of the module docstring to the whole `model`, in order; prints
    Megatron's parameter-count line for this rank's share of the whole model."""
    shard_model(model, config.model)
    for line in parameter_count_lines(model):
        print_rank_0(line)
    numerics = config.numerics
    if numerics.fp8_format is not None:
        check_fp8_device(numerics.fp8_format, context.device)
        recipe = recipe_for(context.device, numerics.fp8_recipe, numerics.fp8_format)
        mlp_spec = getattr(model, "mlp_spec", None) or MlpSpec()
        apply_fp8(model, recipe, mlp_spec.fp8_styles())
    data_parallel = data_parallel_mode(config)
    pipeline = data_parallel.pipeline
    unwrapped: nn.Module = split_pipeline(model) if pipeline else model
    apply_activation_recomputation(unwrapped, config.model)
    unwrapped = unwrapped.to(context.device)
    module = data_parallel.apply(unwrapped, context)
    if config.training.torch_compile and context.device.type == "cuda" and not pipeline:
        choice = compile_choice(context.device)
        module = compile_model(module, choice, data_parallel.compiles_by_layer)
    return ParallelModel(unwrapped, module, data_parallel, config.parallel)


def shard_model(model: GPTModel, model_config: ModelConfig) -> GPTModel:
    """Steps 1 to 3: this rank's tensor- and expert-parallel shards of `model`, with weights."""
    apply_tensor_parallel(model, model_config)
    place_experts(model)
    materialize_weights(model)
    return model


def place_experts(model: nn.Module) -> nn.Module:
    """Every module of `model` defining `place_experts(size, rank)` keeps its share of the
    experts of this rank's expert-parallel group (it checks its own config against the group's
    size, so a layer built for another size fails here); returns `model`."""
    size = parallel_state.get_expert_model_parallel_world_size()
    rank = parallel_state.get_expert_model_parallel_rank()
    for module in list(model.modules()):
        if callable(getattr(module, "place_experts", None)):
            module.place_experts(size, rank)
    return model


def materialize_weights(model: GPTModel) -> GPTModel:
    """Give a model built on the meta device CPU storage and draw its weights
    (`GPTModel.init_weights`, from the default generator); a model with weights is left as it
    is. Returns `model`."""
    if materialize(model, "cpu"):
        model.init_weights()
    return model


def parameter_count_lines(model: nn.Module) -> List[str]:
    """Megatron's parameter-count line for this rank's shard of the whole model, counting
    expert-parallel shards expert-parallel-size times, so that every expert-parallel layout
    prints the number of a single-process run; a second line then says what this rank holds."""
    local_count = sum(parameter.numel() for parameter in model.parameters())
    expert_count = sum(parameter.numel() for parameter in expert_parameters(model))
    expert_parallel_size = parallel_state.get_expert_model_parallel_world_size()
    total = local_count + (expert_parallel_size - 1) * expert_count
    lines = [f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {total}"]
    if expert_parallel_size > 1:
        lines.append(
            f" > {expert_count * expert_parallel_size} of them in experts, sharded over "
            f"{expert_parallel_size} expert-parallel ranks: each rank holds {local_count} "
            "parameters"
        )
    return lines


def split_pipeline(whole: GPTModel) -> nn.ModuleList:
    """This rank's stage chunks (one without interleaving), which take their embedding, layers,
    final norm and output layer from `whole` (moved, not copied: what this rank does not hold is
    freed with `whole`).

    The whole model's weights are drawn first, exactly as one process draws them, so a pipeline
    run starts from the single-process weights (Megatron draws per stage instead, which gives
    other weights); that costs this rank's tensor- and expert-parallel share of the whole model
    in CPU memory while it starts. With tied embeddings a last stage without the embedding gets
    its own copy of the word embedding table as its output layer (megatron.pipeline.stages).
    """
    config = whole.config
    pipeline_size = parallel_state.get_pipeline_model_parallel_world_size()
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    virtual_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for virtual_rank in range(virtual_size or 1):
        if virtual_size is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(virtual_rank)
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()
        with torch.device("meta"):
            chunk = GPTModel(
                config, whole.mlp_spec, pre_process=first, post_process=last, layer_numbers=()
            )
        apply_tensor_parallel(chunk, config)
        numbers = stage_layer_numbers(
            config.num_layers, pipeline_size, pipeline_rank, virtual_size, virtual_rank
        )
        chunk.decoder.layers = nn.ModuleList(whole.decoder.layers[number] for number in numbers)
        if first:
            chunk.embedding = whole.embedding
        if last:
            chunk.decoder.final_layernorm = whole.decoder.final_layernorm
            if whole.output_layer is not None:
                chunk.output_layer = whole.output_layer
            elif chunk.output_layer is not None:  # the tied copy on a stage without the table
                materialize(chunk.output_layer, "cpu")
                with torch.no_grad():
                    chunk.output_layer.weight.copy_(whole.embedding.word_embeddings.weight)
        chunks.append(chunk)
    if virtual_size is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
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
        elif granularity == "selective" and isinstance(module, DotProductAttention):
            module.recompute = True
    return model


def compile_model(
    model: nn.Module, choice: CompileChoice, layer_by_layer: bool = False, **options
) -> nn.Module:
    """torch.compile(`model`) (with torch.compile's `options`), which fuses the elementwise
    work (norms, GELU, dropout, the loss) around the matmuls, saying so in one line, as
    `choice` says: with a veto the model stays eager and the reason is printed (a graph broken
    around Triton-launched kernels can run slower than eager); with overlapped collectives
    Inductor compiles it with `COLLECTIVES_UNDER_COMPUTE` (another backend has no such passes).
    `layer_by_layer`: each TransformerLayer's forward compiles on its own, in place (the rest,
    and the layers' forward hooks, stay eager: the distributed optimizer's waits for a layer's
    parameters and FSDP2's gathers run there), and the model is returned."""
    if choice.veto is not None:
        print_rank_0(f"note: {choice.veto}")
        return model
    if choice.overlap_collectives and options.get("backend", "inductor") == "inductor":
        options["options"] = {**options.get("options", {}), **COLLECTIVES_UNDER_COMPUTE}
    # Static shapes: a run's shapes are fixed, and a number that changes between steps (the
    # expert-parallel block size, grown after an overflow) recompiles as a new constant
    # instead of becoming a symbol; a buffer size derived from a symbolic float cannot be
    # traced at all.
    if layer_by_layer:
        print_rank_0("> torch.compile: each transformer layer's forward")
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                module.forward = torch.compile(module.forward, dynamic=False, **options)
        return model
    print_rank_0("> torch.compile: the whole model")
    return torch.compile(model, dynamic=False, **options)
