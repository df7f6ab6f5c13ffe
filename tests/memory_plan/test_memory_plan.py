"""The memory planner (megatron.memory_plan): exact parameter counts, the bytes per parameter
of each option, the activation formulas against what autograd really saves, the suggestions,
and tools/estimate_memory.py."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

from gpt_pretraining import GPT_RUN
from megatron.config import Config
from megatron.memory_plan import GIB, count_parameters, estimate_memory, format_estimate_line
from megatron.memory_plan.activations import layer_bytes_per_token, norm_bytes_per_token
from megatron.memory_plan.command_line import build_config
from megatron.memory_plan.suggestions import format_warning, suggest_fits
from megatron.model import GPTModel
from megatron.parallelize.data_parallel import autocast_cast_parameters
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from tests import processes
from tests.tiny_gpt import sharded_gpt_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--train-iters 2 --bf16 --make-vocab-size-divisible-by 128"
).split()
GQA_SWIGLU = "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights".split()
DMOE = "--moe-num-experts 4 --moe-top-k 2".split()
# Experts of their own size (twice the dense MLP's, so that their terms stand out) in the
# second layer only.
FINE_GRAINED = [*DMOE, "--moe-ffn-hidden-size", "512", "--moe-layer-freq", "[0,1]"]
DMOE_125M = (
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 64 --global-batch-size 512 --lr 6e-4 "
    "--train-iters 10 --bf16 --make-vocab-size-divisible-by 1024 --moe-num-experts 64 "
    "--moe-top-k 1 --moe-impl grouped"
).split()
# A tolerance for formulas that count every saved tensor: only a few scalars are left out.
TOLERANCE = 0.02


def config_of(*flags: str, world_size: int = 1) -> Config:
    config, _ = build_config(GPT_RUN, [*TINY, *flags], world_size)
    return config


def real_model(config: Config) -> GPTModel:
    return sharded_gpt_model(config.model, GPT_RUN.mlp_spec(config))


@pytest.mark.parametrize(
    "flags",
    [(), GQA_SWIGLU, DMOE, FINE_GRAINED],
    ids=["dense", "gqa-swiglu", "dmoe", "dmoe-fine-grained"],
)
def test_parameter_count_is_exact(flags):
    config = config_of(*flags)
    counts = count_parameters(config, GPT_RUN.mlp_spec(config)).stage(config, 0)
    model = real_model(config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    assert estimate.weights == sum(p.numel() * p.element_size() for p in model.parameters())


def test_tensor_parallel_shards_the_split_layers_only():
    config = config_of("--tensor-model-parallel-size", "2", world_size=2)
    # The same model (vocabulary padded for TP 2) on one rank.
    single = dataclasses.replace(
        config, model=dataclasses.replace(config.model, tensor_model_parallel_size=1)
    )
    whole = count_parameters(single, GPT_RUN.mlp_spec(single)).stage(single, 0)
    shard = count_parameters(config, GPT_RUN.mlp_spec(config)).stage(config, 0)
    split = sum(
        p.numel()
        for name, p in real_model(single).named_parameters()
        if any(key in name for key in ("linear_qkv", "linear_fc1", "word_embeddings"))
        or (("linear_proj" in name or "linear_fc2" in name) and name.endswith("weight"))
    )
    assert whole.total == sum(p.numel() for p in real_model(single).parameters())
    assert shard.total == whole.total - split // 2


def test_expert_parallel_and_distributed_optimizer_shard_experts_and_state():
    single = config_of(*DMOE, world_size=2)
    expert = config_of(*DMOE, "--expert-model-parallel-size", "2", world_size=2)
    single_counts = count_parameters(single, GPT_RUN.mlp_spec(single)).stage(single, 0)
    expert_counts = count_parameters(expert, GPT_RUN.mlp_spec(expert)).stage(expert, 0)
    experts = sum(p.numel() for n, p in real_model(single).named_parameters() if ".experts." in n)
    assert expert_counts.expert == experts // 2
    assert expert_counts.total == single_counts.total - experts // 2
    plain = estimate_memory(single, GPT_RUN.mlp_spec(single))
    sharded_config = config_of(*DMOE, "--use-distributed-optimizer", world_size=2)
    sharded = estimate_memory(sharded_config, GPT_RUN.mlp_spec(sharded_config))
    assert sharded.optimizer == pytest.approx(plain.optimizer / 2, abs=16)
    # The full grad buffer stays; an fp32 shard of it is added.
    assert sharded.gradients == pytest.approx(plain.gradients * 1.5, abs=16)
    # At EP2 on two ranks each expert has one replica: its gradient is reduced in place, and
    # only the dense weights' half-size shard is added.
    ep_config = config_of(*DMOE, "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                          world_size=2)  # fmt: skip
    ep_sharded = estimate_memory(ep_config, GPT_RUN.mlp_spec(ep_config))
    ep_plain = estimate_memory(expert, GPT_RUN.mlp_spec(expert))
    dense = expert_counts.total - expert_counts.expert
    assert ep_sharded.gradients == pytest.approx(ep_plain.gradients + 4 * dense / 2, abs=16)


@pytest.mark.parametrize("flags", [(), DMOE], ids=["dense", "dmoe"])
def test_compute_dtype_weights_count_two_bytes_and_a_master_shard(flags):
    """bf16 with the distributed optimizer over 2 ranks: the weights the run holds in bf16
    (megatron.parallelize.data_parallel.autocast_cast_parameters on the real model) count 2
    bytes, their fp32 masters 4 per element of a rank's half, the rest 4; the dMoE keeps no
    expert copies and holds no gradient, and only the tied table is cast per micro-batch."""
    config = config_of(*flags, "--use-distributed-optimizer", world_size=2)
    model = real_model(config)
    held = {id(p) for p in autocast_cast_parameters(model)}
    low = sum(p.numel() for p in model.parameters() if id(p) in held)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in held)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    assert estimate.weights == 2 * low + 4 * rest
    assert estimate.master_weights == pytest.approx(4 * low / 2, abs=16)
    assert estimate.expert_weight_copies == estimate.held_gradients == 0
    table = config.model.padded_vocab_size * config.model.hidden_size
    micro_batches = config.training.num_micro_batches
    assert estimate.weight_casts == 2 * table * micro_batches
    replicated_config = config_of(*flags, world_size=2)
    replicated = estimate_memory(replicated_config, GPT_RUN.mlp_spec(replicated_config))
    assert replicated.master_weights == 0 and replicated.weights == 4 * (low + rest)


def state_bytes(*flags: str, world_size: int) -> int:
    """Weights, their masters, gradients and optimizer state of one rank, in bytes."""
    config = config_of("--global-batch-size", "16", *flags, world_size=world_size)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    return estimate.weights + estimate.master_weights + estimate.gradients + estimate.optimizer


@pytest.mark.parametrize("flags", [(), DMOE], ids=["dense", "dmoe"])
def test_fully_shard_keeps_a_shard_of_everything(flags):
    """FSDP2 on 8 ranks keeps 1/8 of DDP's fp32 weights, gradients and Adam state (16 bytes
    per parameter), with no bf16 weights or fp32 masters beside them as the distributed
    optimizer has; hybrid sharding in 2 groups of 4 keeps 1/4 (the experts too, which are in
    their layers' units)."""
    hybrid_flags = ("--use-torch-fsdp2", "--data-parallel-replicate-degree", "2")
    replicated = state_bytes(*flags, world_size=8)
    fully_shard = state_bytes(*flags, "--use-torch-fsdp2", world_size=8)
    hybrid = state_bytes(*flags, *hybrid_flags, world_size=8)
    distributed_optimizer = state_bytes(*flags, "--use-distributed-optimizer", world_size=8)
    assert fully_shard == pytest.approx(replicated / 8, abs=16 * 8)
    assert hybrid == pytest.approx(replicated / 4, abs=16 * 8)
    assert distributed_optimizer > 2 * fully_shard
    config = config_of("--global-batch-size", "16", *flags, "--use-torch-fsdp2", world_size=8)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    parameters = sum(p.numel() for p in real_model(config).parameters())
    assert estimate.master_weights == 0
    assert estimate.weights == estimate.gradients == pytest.approx(4 * parameters / 8, abs=32)
    # Without expert parallelism the experts are in their layers' units, sharded as those.
    hybrid_config = config_of("--global-batch-size", "16", *flags, *hybrid_flags, world_size=8)
    assert data_parallel_mode(hybrid_config).optimizer_shards() == (4, 4)


def test_fully_shard_shards_expert_parallel_experts_over_their_replicas():
    """Under FSDP2 with expert parallelism 2 on 4 ranks each rank holds 2 of the 4 experts,
    sharded over the 2 ranks that hold them: 1/4 of every expert's state, as the dense
    weights', where the distributed optimizer keeps its 2 experts' fp32 weights whole."""
    config = config_of("--global-batch-size", "8", *DMOE, world_size=4)
    parameters = sum(p.numel() for p in real_model(config).parameters())
    expert_parallel = ("--expert-model-parallel-size", "2")
    fully_shard = state_bytes(*DMOE, "--use-torch-fsdp2", *expert_parallel, world_size=4)
    assert fully_shard == pytest.approx(16 * parameters / 4, abs=16 * 8)
    zero_one = state_bytes(*DMOE, "--use-distributed-optimizer", *expert_parallel, world_size=4)
    experts = sum(p.numel() for n, p in real_model(config).named_parameters() if ".experts." in n)
    assert zero_one - fully_shard > 4 * experts / 2


def layer_and_root_parameters(config: Config):
    """(elements of the largest transformer layer, elements outside the layers)."""
    model = real_model(config)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.decoder.layers]
    return max(layers), sum(p.numel() for p in model.parameters()) - sum(layers)


def test_fully_shard_gathers_the_root_and_two_layers():
    """The transient part of FSDP2: the root unit's weights in fp32 (gathered for the whole
    backward) and two layer units' in bf16; the root's fp32 and one layer's bf16 gradients and
    the reduce-scatter input of the larger unit (fp32, or bf16 with --grad-reduce-in-bf16).
    Autocast casts only the root's matmul weight (here the tied table), as under the
    distributed optimizer; the other modes gather nothing."""
    config = config_of("--global-batch-size", "16", "--use-torch-fsdp2", world_size=8)
    layer, root = layer_and_root_parameters(config)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    assert estimate.gathered_weights == 4 * root + 2 * 2 * layer
    assert estimate.gathered_gradients == 4 * root + 2 * layer + 4 * max(root, layer)
    low = config_of(
        "--global-batch-size", "16", "--use-torch-fsdp2", "--grad-reduce-in-bf16", world_size=8
    )
    low_estimate = estimate_memory(low, GPT_RUN.mlp_spec(low))
    assert estimate.gathered_gradients - low_estimate.gathered_gradients == 2 * max(root, layer)
    assert low_estimate.gradients == estimate.gradients  # the shards stay fp32
    estimates = {}
    for name, flags in (("ddp", ()), ("zero-1", ("--use-distributed-optimizer",))):
        other = config_of("--global-batch-size", "16", *flags, world_size=8)
        estimates[name] = estimate_memory(other, GPT_RUN.mlp_spec(other))
        assert estimates[name].gathered == 0
    assert 0 < estimate.weight_casts == estimates["zero-1"].weight_casts
    assert estimate.weight_casts < estimates["ddp"].weight_casts
    # The start-up line counts the gathered bytes with the weights and the gradients.
    line = format_estimate_line(estimate)
    weights = estimate.weights + estimate.gathered_weights
    gradients = estimate.gradients + estimate.gathered_gradients
    assert f"weights {weights / GIB:.1f}, gradients {gradients / GIB:.1f}," in line


@pytest.mark.parametrize(
    "flags, gib",
    [
        (("--use-torch-fsdp2", "--micro-batch-size", "1"), 9),
        (("--use-torch-fsdp2", "--data-parallel-replicate-degree", "2"), 24),
    ],
    ids=["fsdp2", "hybrid"],
)
def test_suggestions_under_fully_shard_are_flags_it_accepts(flags, gib):
    """FSDP2 shards the optimizer state itself (the distributed optimizer is refused beside
    it, and so are the precision-aware optimizer and the offload, which its DTensor shards do
    not take) and hybrid sharding refuses expert parallelism: none is suggested (at 9 GiB
    expert parallelism fits FSDP2 at micro-batch 1; at 24 GiB a smaller
    micro-batch or recomputation fit the hybrid run at 16), and every suggestion builds and
    gives its estimate again."""
    argv = [*DMOE_125M, "--micro-batch-size", "16", *flags]
    config, _ = build_config(GPT_RUN, argv, 8)
    device = gib * GIB
    assert estimate_memory(config, GPT_RUN.mlp_spec(config), device).fits is False
    suggestions = suggest_fits(config, GPT_RUN.mlp_spec, device)
    assert suggestions
    for suggestion in suggestions:
        for refused in (
            "--use-distributed-optimizer",
            "--use-precision-aware-optimizer",
            "offload",
        ):
            assert refused not in suggestion.flags
        changed, _ = build_config(GPT_RUN, [*argv, *suggestion.flags.split()], 8)
        again = estimate_memory(changed, GPT_RUN.mlp_spec(changed), device)
        assert again.total == suggestion.estimate.total, suggestion.flags


def test_fixed_size_expert_parallel_blocks_plan_their_padding():
    """Under expert parallelism the dMoE's worst case is every rank's rows at one rank (P x k
    rows per token); fixed-size blocks hold factor x k rows per token, whatever the routing."""
    exact = config_of(*DMOE, "--expert-model-parallel-size", "2", world_size=2)
    blocks = config_of(
        *DMOE, "--expert-model-parallel-size", "2", "--moe-expert-parallel-buffer-factor", "1.5",
        world_size=2,
    )  # fmt: skip
    spec, blocked_spec = GPT_RUN.mlp_spec(exact), GPT_RUN.mlp_spec(blocks)
    bytes_exact = spec.activation_bytes_per_token(exact.model, 0, 2)
    bytes_blocks = blocked_spec.activation_bytes_per_token(blocks.model, 0, 2)
    assert bytes_exact[0] < bytes_blocks[0] == bytes_blocks[1] < bytes_exact[1]


def test_pipeline_stages_add_up_to_the_model_and_the_tied_copy():
    config = config_of("--pipeline-model-parallel-size", "2", world_size=2)
    counts = count_parameters(config, GPT_RUN.mlp_spec(config))
    whole = config_of()
    total = count_parameters(whole, GPT_RUN.mlp_spec(whole)).stage(whole, 0).total
    table = whole.model.padded_vocab_size * whole.model.hidden_size
    assert counts.stage(config, 0).total + counts.stage(config, 1).total == total + table


def test_optimizer_dtype_and_offload_options_change_their_parts():
    base = estimate_memory(config_of(), GPT_RUN.mlp_spec(config_of()))
    parameters = base.weights // 4
    assert base.gradients == 4 * parameters and base.optimizer == 8 * parameters
    low = config_of(
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "bf16",
        "--exp-avg-dtype",
        "bf16",
        "--exp-avg-sq-dtype",
        "bf16",
    )
    low_estimate = estimate_memory(low, GPT_RUN.mlp_spec(low), step_chunk_elements=1000)
    assert low_estimate.optimizer == 4 * parameters
    # bf16 main gradients, and one parameter's fp32 .grad at a time (the word embeddings').
    embeddings = low.model.padded_vocab_size * low.model.hidden_size
    assert low_estimate.gradients == 2 * parameters + 4 * embeddings
    assert low_estimate.optimizer_step_buffers == 16 * 1000
    offload = config_of("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5")
    assert estimate_memory(offload, GPT_RUN.mlp_spec(offload)).optimizer == 4 * parameters
    assert estimate_memory(offload, GPT_RUN.mlp_spec(offload)).weights == base.weights


@pytest.mark.parametrize("flags", [DMOE, FINE_GRAINED], ids=["dmoe", "dmoe-fine-grained"])
def test_expert_copies_and_the_held_gradient(flags):
    config = config_of(*flags)
    experts = sum(p.numel() for n, p in real_model(config).named_parameters() if ".experts." in n)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    assert estimate.expert_weight_copies == 2 * experts
    assert estimate.held_gradients == 2 * experts
    # bf16 main gradients hold one micro-batch's expert gradients too (moe.weight_copies).
    low = config_of(*flags, "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16")
    assert estimate_memory(low, GPT_RUN.mlp_spec(low)).held_gradients == 2 * experts
    unfused = config_of(*flags, "--no-gradient-accumulation-fusion")
    unfused_estimate = estimate_memory(unfused, GPT_RUN.mlp_spec(unfused))
    assert unfused_estimate.expert_weight_copies == 0
    assert unfused_estimate.weight_casts - estimate.weight_casts == 2 * experts


def test_fp8_experts_keep_their_copies_quantized_in_two_layouts():
    """2 bytes per expert weight beyond the bf16 copies (measured on the Mixtral-shaped dMoE:
    docs/benchmark-log.md, "FP8"); the dense FP8 projections quantize in each product and keep
    nothing."""
    config = config_of(*DMOE, "--fp8-format", "hybrid")
    bf16 = config_of(*DMOE)
    experts = sum(p.numel() for n, p in real_model(config).named_parameters() if ".experts." in n)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config))
    assert estimate.expert_weight_copies == 4 * experts
    assert estimate.total - estimate_memory(bf16, GPT_RUN.mlp_spec(bf16)).total > 2 * experts
    dense = config_of("--fp8-format", "hybrid")
    dense_bf16 = config_of()
    assert estimate_memory(dense, GPT_RUN.mlp_spec(dense)) == estimate_memory(
        dense_bf16, GPT_RUN.mlp_spec(dense_bf16)
    )


def test_recomputed_chunks_return_their_expert_gradients_one_chunk_at_a_time():
    # Without recomputation a compiled backward returns every expert gradient at once; full
    # recomputation runs each checkpointed chunk's backward alone (measured: BENCHMARKS.md,
    # "Memory planner", the recompute rows).
    def returned(*flags: str) -> int:
        config, _ = build_config(GPT_RUN, [*DMOE_125M, *flags], 1)
        return estimate_memory(config, GPT_RUN.mlp_spec(config)).returned_gradients

    everything = returned()
    recompute = ("--recompute-granularity", "full", "--recompute-method")
    assert returned(*recompute, "uniform") == everything // 12
    assert returned(*recompute, "uniform", "--recompute-num-layers", "3") == everything // 4
    # The block method leaves the layers after the first N outside any checkpoint.
    assert returned(*recompute, "block", "--recompute-num-layers", "4") == everything * 8 // 12


def saved_bytes(run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run` runs."""
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def measure_decoder(config: Config, batches: Sequence[int]) -> list:
    """Saved bytes of the decoder's training forward under bf16 autocast at each batch size."""
    from megatron.parallelize.steps import apply_activation_recomputation
    from moe.experts import refresh_compute_weights

    torch.manual_seed(0)
    model = real_model(config)
    apply_activation_recomputation(model, config.model)
    model.train()
    refresh_compute_weights(model, torch.bfloat16, True)  # the trainer's expert copies
    hidden = config.model.hidden_size
    measured = []
    for batch in batches:
        inputs = torch.randn(batch, config.model.seq_length, hidden, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            measured.append(saved_bytes(lambda inputs=inputs: model.decoder(inputs)))
    return measured


# Attention dropout off: with it, CPU SDPA falls back to the math kernel, which keeps the s x s
# scores that the GPU's flash kernel does not. CPU dropout masks are bf16 (2 bytes).
MEASURED = {
    "dense": ("--hidden-dropout", "0.1", "--attention-dropout", "0.0"),
    "gqa-swiglu-rope": (*GQA_SWIGLU, "--hidden-dropout", "0.0", "--attention-dropout", "0.0"),
    "dmoe": (*DMOE, "--hidden-dropout", "0.0", "--attention-dropout", "0.0"),
    "dmoe-glu": (*DMOE, "--mlp-type", "glu", "--attention-dropout", "0.0"),
    "dmoe-fine-grained": (*FINE_GRAINED, "--hidden-dropout", "0.0", "--attention-dropout", "0.0"),
    "selective": ("--recompute-granularity", "selective", "--attention-dropout", "0.0"),
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_activation_formula_matches_saved_tensors(name):
    config = config_of(*MEASURED[name])
    model, spec = config.model, GPT_RUN.mlp_spec(config)
    small, large = measure_decoder(config, (2, 6))
    tokens = 4 * model.seq_length
    measured_per_token = (large - small) / tokens
    formula = sum(
        layer_bytes_per_token(model, spec, n, 2, mask_bytes=2).expected
        for n in range(model.num_layers)
    ) + norm_bytes_per_token(model)
    assert formula == pytest.approx(measured_per_token, rel=TOLERANCE)


def test_full_recompute_keeps_only_layer_inputs():
    flags = ("--recompute-granularity", "full", "--recompute-method", "uniform")
    config = config_of(*flags, "--attention-dropout", "0.0")
    small, large = measure_decoder(config, (2, 6))
    per_token = (large - small) / (4 * config.model.seq_length)
    model = config.model
    checkpoints = model.num_layers * 4 * model.hidden_size
    assert checkpoints + norm_bytes_per_token(model) == pytest.approx(per_token, rel=TOLERANCE)
    plain = estimate_memory(config_of(), GPT_RUN.mlp_spec(config_of()))
    recomputed = estimate_memory(config, GPT_RUN.mlp_spec(config))
    assert recomputed.activations < plain.activations


def test_weight_casts_are_the_intercept():
    config = config_of("--attention-dropout", "0.0", "--hidden-dropout", "0.0")
    small, _ = measure_decoder(config, (2, 6))
    model = config.model
    layers = sum(
        layer_bytes_per_token(model, GPT_RUN.mlp_spec(config), n, 2, 2).expected
        for n in range(model.num_layers)
    )
    per_token = layers + norm_bytes_per_token(model)
    counts = count_parameters(config, GPT_RUN.mlp_spec(config))
    casts = 2 * sum(layer.matmul_weights for layer in counts.layers)
    assert small - per_token * 2 * model.seq_length == pytest.approx(casts, rel=TOLERANCE)


def test_the_line_and_the_suggestions_fit():
    config, _ = build_config(GPT_RUN, DMOE_125M, 1)
    device = 80 * GIB
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config), device)
    line = format_estimate_line(estimate)
    number = r"\d+\.\d"
    assert re.fullmatch(
        rf"> estimated peak memory per GPU: {number} GiB of 80\.0 GiB \(weights {number}, "
        rf"gradients {number}, optimizer {number}, activations {number}, logits {number}\)",
        line,
    )
    assert estimate.fits is False
    suggestions = suggest_fits(config, GPT_RUN.mlp_spec, device)
    assert suggestions and all(s.estimate.total <= device for s in suggestions)
    # The flags say what was estimated: the same run with them gives the same number.
    for suggestion in suggestions:
        changed, _ = build_config(GPT_RUN, [*DMOE_125M, *suggestion.flags.split()], 1)
        again = estimate_memory(changed, GPT_RUN.mlp_spec(changed), device)
        assert again.total == suggestion.estimate.total, suggestion.flags
    assert format_warning(estimate, suggestions).startswith("WARNING: ")


def test_unknown_device_memory_prints_unknown():
    estimate = estimate_memory(config_of(), GPT_RUN.mlp_spec(config_of()))
    assert estimate.fits is None
    assert " GiB of unknown (" in format_estimate_line(estimate)
    assert dataclasses.replace(estimate, device_memory=GIB).fits is not None


def test_tool_prints_the_line_and_refuses_bad_flags():
    tool = str(REPO_ROOT / "tools" / "estimate_memory.py")
    run = processes.run(DMOE_125M, script=tool)
    assert run.returncode == 0, run.stderr
    assert "> estimated peak memory per GPU: " in run.stdout
    assert "WARNING: " in run.stdout and "total, worst routing" in run.stdout
    bad = processes.run(["--num-layerz", "2"], script=tool)
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_the_planner_imports_nothing_from_moe():
    for path in (REPO_ROOT / "megatron" / "memory_plan").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(name == "moe" or name.startswith("moe.") for name in names), path
