"""Expert parallelism's flags and the layers it cannot split: one ConfigError line each, and
the layout degree it resolves to (megatron.config, moe.config)."""

from __future__ import annotations

import pytest

from gpt_pretraining import GPT_RUN
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


CHUNKED = ("--expert-model-parallel-size", "2", "--moe-expert-parallel-buffer-factor", "1.5")


def test_the_chunked_overlap_has_a_name_of_its_own():
    """--moe-expert-parallel-chunked-overlap cuts one micro-batch's blocks into the chunks of
    --moe-expert-parallel-comm-chunks; without it the exchange is one chunk."""
    overlapped = run_config(*CHUNKED, "--moe-expert-parallel-chunked-overlap", world_size=2)
    assert overlapped.extension(MoEConfig).expert_parallel_chunks == 2
    assert run_config(*CHUNKED, world_size=2).extension(MoEConfig).expert_parallel_chunks == 1


def test_megatron_cores_overlap_flag_is_refused_naming_ours():
    with pytest.raises(ConfigError) as error:
        run_config(*CHUNKED, "--overlap-moe-expert-parallel-comm", world_size=2)
    assert str(error.value) == (
        "--overlap-moe-expert-parallel-comm is Megatron-Core's overlap of one micro-batch's "
        "expert-parallel all-to-all with another micro-batch's compute in its 1F1B schedule, "
        "which this project does not have; drop it, or hide the exchange under the same "
        "micro-batch's experts with --moe-expert-parallel-chunked-overlap"
    )


def test_a_checkpoint_saved_under_the_old_spelling_keeps_its_chunked_overlap():
    """Saved arguments from before the rename hold the overlap as overlap_moe_expert_parallel_comm
    (the attribute of Megatron-Core's spelling then): they build the same config as the new
    name and are not refused as Megatron-Core's overlap."""
    config = run_config(*CHUNKED, "--moe-expert-parallel-chunked-overlap", world_size=2)
    older = config.saved_arguments()
    del older.moe_expert_parallel_chunked_overlap
    del older.megatron_core_overlap_moe_expert_parallel_comm
    older.overlap_moe_expert_parallel_comm = True
    assert GPT_RUN.config_from_saved(older).extensions == config.extensions
