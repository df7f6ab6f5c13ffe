"""Expert parallelism's flags and the layers it cannot split: one ConfigError line each, and
the layout degree it resolves to (megatron.config, moe.config)."""

from __future__ import annotations

import pytest

from megatron.config import Config, ConfigError, parse_arguments
from megatron.config.validation import resolve_arguments_with_notes
from moe.arguments import add_moe_args
from moe.config import MoEConfig, moe_config
from moe.layers import build_moe_layer
from tests.config.command_lines import argv
from tests.moe.test_expert_parallel import model_config


def test_experts_not_divisible_by_expert_parallel_size():
    config = MoEConfig(num_experts=6)
    with pytest.raises(ConfigError, match=r"--moe-num-experts 6 .* expert parallel size 4"):
        config.check_expert_parallelism(4)
    layer = build_moe_layer(model_config(), config)
    with pytest.raises(ConfigError, match=r"--moe-num-experts 6 .* expert parallel size 4"):
        layer.place_experts(4, 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mlp_impl="reference"), "--moe-impl reference"),
    ],
)
def test_unsupported_expert_parallel_layers_say_so(overrides, message):
    layer = build_moe_layer(model_config(), MoEConfig(num_experts=4, **overrides))
    with pytest.raises(ConfigError, match=message):
        layer.place_experts(2, 0)


def run_config(*flags: str, world_size: int) -> Config:
    """pretrain_gpt.py's config of a small dMoE with 6 experts and `flags` on `world_size`."""
    namespace = parse_arguments(argv("--moe-num-experts", "6", *flags), [add_moe_args])
    resolved, notes = resolve_arguments_with_notes(namespace, world_size)
    return Config.from_resolved(resolved, notes, 64, extensions=[moe_config])


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (["--expert-model-parallel-size", "4"], 4, "--moe-num-experts 6 is not divisible"),
        (["--moe-expert-model-parallelism"], 4, "--moe-num-experts 6 is not divisible"),
        (["--expert-model-parallel-size", "3"], 2, "does not divide the data-parallel size 2"),
        (["--expert-model-parallel-size", "0"], 2, "must be >= 1"),
        (
            ["--moe-expert-model-parallelism", "--expert-model-parallel-size", "2"],
            2,
            "pass one of them",
        ),
    ],
)
def test_expert_parallel_flags(flags, world_size, message):
    with pytest.raises(ConfigError, match=message):
        run_config(*flags, world_size=world_size)


def test_expert_parallelism_is_a_layout_degree():
    """One owner: ParallelConfig; MegaBlocks' switch is its alias for the data-parallel size."""
    assert run_config(world_size=2).parallel.expert_model_parallel_size == 1
    explicit = run_config("--expert-model-parallel-size", "2", world_size=4)
    assert explicit.parallel.expert_model_parallel_size == 2
    assert explicit.parallel.data_parallel_size == 4
    switch = run_config("--moe-expert-model-parallelism", world_size=3)
    assert switch.parallel.expert_model_parallel_size == 3
    assert not hasattr(switch.extension(MoEConfig), "expert_model_parallel_size")
    tensor = run_config(
        "--moe-expert-model-parallelism", "--tensor-model-parallel-size", "2", world_size=4
    )
    assert tensor.parallel.expert_model_parallel_size == 2  # the data-parallel size


def test_expert_parallel_flags_without_experts():
    namespace = parse_arguments(argv("--expert-model-parallel-size", "2"), [add_moe_args])
    resolved, notes = resolve_arguments_with_notes(namespace, 2)
    with pytest.raises(ConfigError, match="the model has none"):
        Config.from_resolved(resolved, notes, 64, extensions=[moe_config])
