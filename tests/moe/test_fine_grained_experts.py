"""Fine-grained experts beside dense layers, Megatron-Core's way: --moe-ffn-hidden-size sizes
the experts while the dense MLPs keep --ffn-hidden-size, and --moe-layer-freq's pattern form
says which layers are MoE layers. The model, its FLOP count and the memory planner all follow
both; bad values are one ConfigError line."""

from __future__ import annotations

import pytest
import torch

from gpt_pretraining import GPT_RUN
from megatron.config import Config, ConfigError
from megatron.model import num_floating_point_operations
from megatron.model.mlp import MLP
from moe.config import MoEConfig
from moe.layers import DroplessMoE
from moe.memory_plan import expert_parameters
from tests.config.command_lines import argv

HIDDEN, FFN, EXPERT_FFN, EXPERTS = 64, 256, 32, 8
# Four layers: a dense first layer (--ffn-hidden-size 256), then three of 8 SwiGLU experts of
# 32 channels each, top-2, beside a shared expert of the dense size.
FINE_GRAINED = (
    "--num-layers", "4", "--ffn-hidden-size", str(FFN), "--swiglu",
    "--moe-num-experts", str(EXPERTS), "--moe-top-k", "2",
    "--moe-ffn-hidden-size", str(EXPERT_FFN), "--moe-layer-freq", "([0]*1+[1]*3)",
    "--moe-shared-expert",
)  # fmt: skip


def run_config(*flags: str, world_size: int = 1) -> Config:
    """The Config pretrain_gpt.py builds from the small base command line and `flags`."""
    args, notes = GPT_RUN.resolve(argv(*flags), world_size)
    return GPT_RUN.config(args, notes, 128)


def test_experts_and_dense_mlps_take_their_own_sizes():
    config = run_config(*FINE_GRAINED)
    moe = config.extension(MoEConfig)
    assert moe.layer_freq == (False, True, True, True)
    with torch.device("meta"):
        model = GPT_RUN.model(config)
    layers = [layer.mlp for layer in model.decoder.layers]
    assert isinstance(layers[0], MLP) and all(isinstance(m, DroplessMoE) for m in layers[1:])
    assert layers[0].linear_fc1.weight.shape == (2 * FFN, HIDDEN)  # SwiGLU: [gate; up]
    assert layers[0].linear_fc2.weight.shape == (HIDDEN, FFN)
    for layer in layers[1:]:
        assert layer.experts.w1.shape == layer.experts.v1.shape == (EXPERTS, HIDDEN, EXPERT_FFN)
        assert layer.experts.w2.shape == (EXPERTS, EXPERT_FFN, HIDDEN)
        # The shared expert is a dense MLP: --ffn-hidden-size unless given its own size.
        assert layer.shared_expert.linear_fc2.weight.shape == (HIDDEN, FFN)


def test_flops_per_token_count_the_experts_size_in_moe_layers_only():
    config = run_config(*FINE_GRAINED)
    spec = GPT_RUN.mlp_spec(config)
    # Forward FLOPs per token. The dense layer 0, SwiGLU: 2 h 2f + 2 f h = 6 x 64 x 256 =
    # 98,304. Each MoE layer: two GLU experts 2 x 6 x 64 x 32 = 24,576, the router
    # 2 x 64 x 8 = 1,024 and the shared expert (dense-sized) 98,304: 123,904.
    per_layer = [spec.forward_flops_per_token(config.model, n) for n in range(4)]
    assert per_layer == [98_304, 123_904, 123_904, 123_904]
    dense = num_floating_point_operations(config.model, 2, 32)
    # Forward and backward (x3) of 2 x 32 tokens, three layers' MLPs replaced.
    assert num_floating_point_operations(config.model, 2, 32, spec) - dense == (
        3 * 2 * 32 * 3 * (123_904 - 98_304)
    )


def test_the_planners_expert_parameters_are_the_built_experts():
    config = run_config(*FINE_GRAINED)
    moe = config.extension(MoEConfig)
    with torch.device("meta"):
        model = GPT_RUN.model(config)
    built = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert built == 3 * 3 * EXPERTS * HIDDEN * EXPERT_FFN  # 3 layers of w1, v1, w2
    assert expert_parameters(config.model, moe, range(4), 1) == built
    assert expert_parameters(config.model, moe, [0], 1) == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--moe-layer-freq", "[0,1,1]"),
            "--moe-layer-freq has 3 entries, but --num-layers is 4; give one 0 or 1 per layer",
        ),
        (("--moe-layer-freq", "[0,1,2,1]"), "--moe-layer-freq '[0,1,2,1]' has entries [2]"),
        (("--moe-layer-freq", "[1]*4 or exit()"), "--moe-layer-freq '[1]*4 or exit()' is not"),
        (("--moe-layer-freq", "[0]*4"), "--moe-layer-freq marks no layer as an MoE layer"),
        (("--moe-layer-freq", "5"), "--moe-layer-freq 5 must be between 1 and --num-layers 4"),
        (("--moe-ffn-hidden-size", "0"), "--moe-ffn-hidden-size must be >= 1, got 0"),
        (
            ("--moe-impl", "sparse", "--moe-ffn-hidden-size", "24"),
            "needs --moe-ffn-hidden-size divisible by 16",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_flag(flags, message):
    base = ("--num-layers", "4", "--moe-num-experts", "4")
    with pytest.raises(ConfigError) as raised:
        run_config(*base, *flags)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_the_experts_size_splits_evenly_over_tensor_parallel_ranks():
    with pytest.raises(ConfigError) as raised:
        run_config(
            "--moe-num-experts", "4", "--moe-ffn-hidden-size", "33",
            "--tensor-model-parallel-size", "2", world_size=2,
        )  # fmt: skip
    assert str(raised.value).startswith(
        "--moe-ffn-hidden-size 33 is not divisible by --tensor-model-parallel-size 2"
    )
    config = run_config(
        "--moe-num-experts", "4", "--moe-ffn-hidden-size", "34",
        "--tensor-model-parallel-size", "2", world_size=2,
    )  # fmt: skip
    assert config.extension(MoEConfig).expert_ffn_hidden_size(config.model) == 34
