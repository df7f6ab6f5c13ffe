"""Megatron-Core's MoE flags (moe.megatron_core_flags): its Mixtral example builds the model our
spelling of it builds; each name converts to our settings by its meaning (loss coefficients,
sigmoid normalization, capacity), the settings left unset take the defaults of the name that
declared the experts, both spellings of a setting must agree, and what is missing is refused in
one line."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from gpt_pretraining import GPT_RUN
from megatron.checkpointing.model_arguments import model_argument_differences
from megatron.config import ConfigError, build_parser
from moe.arguments import add_moe_args
from moe.config import MoEConfig
from moe.layers import MoE
from moe.router import Router, load_balancing_loss, sequence_load_balancing_loss
from tests.sample_data import MERGES, VOCAB
from tests.tiny_gpt import moe_layer_model_config, tiny_gpt_args

MIXTRAL = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core" / "mixtral_8x7b.args"
# The Mixtral example's flags that are Megatron-Core's alone, with the values each takes.
MIXTRAL_MEGATRON_CORE_ONLY = {
    "--use-mcore-models": 0,
    "--no-position-embedding": 0,
    "--num-experts": 1,
    "--moe-router-topk": 1,
    "--moe-aux-loss-coeff": 1,
    "--moe-grouped-gemm": 0,
    "--moe-token-dispatcher-type": 1,
}
# The same MoE in MegaBlocks' names: 0.01 for each of the 32 MoE layers is 0.32 on their mean.
MIXTRAL_MEGABLOCKS = [
    "--moe-num-experts", "8", "--moe-top-k", "2", "--moe-loss-weight", "0.32",
    "--no-moe-router-pre-softmax",
]  # fmt: skip

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--lr", "1e-3", "--train-iters", "10", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]  # fmt: skip


def build(*flags: str, world_size: int = 1):
    """(Config, MoEConfig) of BASE and `flags`."""
    config, _ = GPT_RUN.config_from_argv([*BASE, *flags], world_size)
    return config, config.extension(MoEConfig)


def refusal(*flags: str) -> str:
    """The one-line ConfigError of BASE and `flags`."""
    with pytest.raises(ConfigError) as error:
        build(*flags)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def _without(flags, dropped):
    kept, index = [], 0
    while index < len(flags):
        if flags[index] in dropped:
            index += 1 + dropped[flags[index]]
            continue
        kept.append(flags[index])
        index += 1
    return kept


def test_the_mixtral_example_builds_the_model_of_our_spelling(tmp_path):
    paths = [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(VOCAB),
        "--merge-file", str(MERGES), "--data-path", str(tmp_path / "corpus"),
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
        "--tensorboard-dir", str(tmp_path / "tb"),
    ]  # fmt: skip
    megatron_core, _ = GPT_RUN.config_from_argv([f"@{MIXTRAL}", *paths], 32)
    example = shlex.split(MIXTRAL.read_text(), comments=True)
    ours_flags = _without(example, MIXTRAL_MEGATRON_CORE_ONLY) + MIXTRAL_MEGABLOCKS + paths
    ours, _ = GPT_RUN.config_from_argv(ours_flags, 32)
    assert megatron_core.model == ours.model and megatron_core.parallel == ours.parallel
    assert megatron_core.training == ours.training
    moe = megatron_core.extension(MoEConfig)
    assert moe == ours.extension(MoEConfig)
    assert (moe.num_experts, moe.top_k, moe.router_pre_softmax) == (8, 2, False)
    assert moe.num_moe_layers(32) == 32 and moe.loss_weight == pytest.approx(0.32)
    notes = "\n".join(megatron_core.notes)
    for switch in ("--use-mcore-models", "--no-position-embedding", "--moe-grouped-gemm"):
        assert f"{switch}: " in notes


@pytest.mark.usefixtures("reference_kernels")
def test_megatron_core_spellings_train_exactly_as_megablocks(data_prefix, tmp_path, capsys):
    """2 MoE layers: a coefficient of 0.05 per layer is a weight of 0.1 on their mean; the
    defaults of --num-experts are top-2 and the softmax over the chosen logits. A checkpoint
    saved with one spelling loads with the other as the same model."""
    common = (
        "--seq-length", "32", "--max-position-embeddings", "32", "--disable-bias-linear",
        "--lr-warmup-iters", "0", "--lr-decay-iters", "3",
    )  # fmt: skip
    megatron_core = (
        "--num-experts", "4", "--moe-aux-loss-coeff", "0.05", "--moe-z-loss-coeff", "0.001",
    )  # fmt: skip
    megablocks = (
        "--moe-num-experts", "4", "--moe-top-k", "2", "--no-moe-router-pre-softmax",
        "--moe-loss-weight", "0.1", "--moe-zloss-weight", "0.002",
    )  # fmt: skip

    def run(*flags, iterations):
        argv = tiny_gpt_args(
            data_prefix, *common, *flags, micro_batch=2, global_batch=2, train_iters=iterations
        )
        return pretrain_gpt.main(argv)

    first = run(*megatron_core, "--save", str(tmp_path), "--save-interval", "2", iterations=2)
    second = run(*megablocks, iterations=2)
    assert first.losses == second.losses
    assert all({"lm loss", "load balancing loss", "router z loss"} <= set(s) for s in first.losses)
    capsys.readouterr()
    resumed = run(*megablocks, "--load", str(tmp_path), iterations=3)
    output = capsys.readouterr().out
    assert "computes differently" not in output and resumed.iteration == 3
    assert len(resumed.losses) == 1


def test_the_saved_arguments_of_one_spelling_compare_equal_to_the_other():
    megatron_core, _ = build("--num-experts", "4", "--disable-bias-linear",
                             "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function",
                             "sigmoid", "--moe-router-enable-expert-bias")  # fmt: skip
    ours, _ = build("--moe-num-experts", "4", "--disable-bias-linear", "--moe-top-k", "2",
                    "--moe-loss-weight", "0.04", "--moe-router-score", "sigmoid",
                    "--moe-normalize-expert-weights", "1",
                    "--moe-router-bias-update-rate", "0.001")  # fmt: skip
    assert megatron_core.extension(MoEConfig) == ours.extension(MoEConfig)
    names = GPT_RUN.model_arguments
    saved, current = megatron_core.saved_arguments(), ours.saved_arguments()
    assert model_argument_differences(saved, current, names) == []
    assert model_argument_differences(current, saved, names) == []
    # Resolving a checkpoint's saved arguments again decides the same.
    again = GPT_RUN.config_from_saved(saved)
    assert again.extension(MoEConfig) == megatron_core.extension(MoEConfig)
    assert all(again.arguments[name] == value for name, value in megatron_core.arguments.items())


def test_the_name_declaring_the_experts_chooses_the_defaults():
    _, megablocks = build("--moe-num-experts", "4")
    assert (megablocks.top_k, megablocks.loss_weight, megablocks.router_pre_softmax) == (
        1,
        0.1,
        True,
    )
    _, megatron_core = build("--num-experts", "4", "--disable-bias-linear")
    assert (megatron_core.top_k, megatron_core.loss_weight, megatron_core.zloss_weight) == (
        2,
        0.0,
        0.0,
    )
    assert not megatron_core.router_pre_softmax and megatron_core.router_bias_update_rate == 0
    # Given, a setting keeps its value whichever name declared the experts.
    _, given = build("--num-experts", "4", "--disable-bias-linear", "--moe-top-k", "1",
                     "--moe-router-pre-softmax", "--moe-loss-weight", "0.1")  # fmt: skip
    assert (given.top_k, given.router_pre_softmax, given.loss_weight) == (1, True, 0.1)
    # The resolved values are what the arguments block prints and checkpoints save.
    config, _ = build("--num-experts", "4", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.5")
    arguments = config.arguments
    assert (arguments["moe_top_k"], arguments["moe_loss_weight"]) == (2, 2.0)
    assert arguments["moe_router_pre_softmax"] is False and arguments["moe_dropless"] is True


def test_loss_coefficients_weigh_each_moe_layer():
    _, every_other = build("--num-experts", "4", "--disable-bias-linear",
                           "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01",
                           "--moe-z-loss-coeff", "0.001")  # fmt: skip
    assert every_other.loss_weight == pytest.approx(0.02)
    assert every_other.zloss_weight == pytest.approx(0.002)
    _, pattern = build("--moe-num-experts", "4", "--moe-layer-freq", "[0,1,1,1]",
                       "--moe-aux-loss-coeff", "0.01", "--moe-loss-weight", "0.03")  # fmt: skip
    assert pattern.loss_weight == 0.03


def test_bias_rate_means_what_the_declaring_name_says():
    _, megablocks = build("--moe-num-experts", "4", "--moe-router-bias-update-rate", "0.01")
    assert megablocks.router_bias_update_rate == 0.01
    config, megatron_core = build(
        "--num-experts", "4", "--disable-bias-linear", "--moe-router-bias-update-rate", "0.01"
    )
    assert megatron_core.router_bias_update_rate == 0.0
    assert any("without --moe-router-enable-expert-bias" in note for note in config.notes)
    for experts in (("--moe-num-experts", "4"), ("--num-experts", "4", "--disable-bias-linear")):
        _, switched = build(*experts, "--moe-router-enable-expert-bias")
        assert switched.router_bias_update_rate == 1e-3
        _, rated = build(*experts, "--moe-router-enable-expert-bias",
                         "--moe-router-bias-update-rate", "0.02")  # fmt: skip
        assert rated.router_bias_update_rate == 0.02


def test_sigmoid_weights_are_megatron_cores_normalized_top_k():
    """Megatron-Core's sigmoid router: the top-k sigmoid scores divided by their sum when
    top-k > 1, then the scaling factor; at top-1 the score itself."""
    flags = ("--num-experts", "8", "--disable-bias-linear", "--moe-router-score-function",
             "sigmoid", "--moe-router-topk-scaling-factor", "2.5")  # fmt: skip
    _, top2 = build(*flags)
    _, top1 = build(*flags, "--moe-router-topk", "1")
    assert top2.normalize_expert_weights == 1.0 and top1.normalize_expert_weights is None
    _, ours = build("--moe-num-experts", "8", "--moe-top-k", "2", "--moe-router-score", "sigmoid")
    assert ours.normalize_expert_weights is None
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    for moe in (top2, top1):
        routing = Router(16, moe).route(logits)
        scores, indices = logits.sigmoid().topk(moe.top_k, dim=-1)
        expected = scores / scores.sum(-1, keepdim=True) if moe.top_k > 1 else scores
        assert torch.equal(routing.expert_indices, indices)
        torch.testing.assert_close(routing.expert_weights, 2.5 * expected)


def test_capacity_factor_is_the_capacity_moe_rounding_up_and_dropping_by_weight():
    _, moe = build("--moe-num-experts", "8", "--moe-top-k", "2",
                   "--moe-expert-capacity-factor", "1.1", "--moe-pad-expert-input-to-capacity")  # fmt: skip
    assert (moe.dropless, moe.capacity_factor, moe.capacity_rounds_up) == (False, 1.1, True)
    assert moe.drop_by_weight
    model = moe_layer_model_config(16, 32, 16)
    # 1.1 x 2 x 16 / 8 = 4.4 assignments: Megatron-Core's 5, MegaBlocks' 4.
    assert MoE(model, moe).expert_capacity(16) == 5
    _, ours = build("--moe-num-experts", "8", "--moe-top-k", "2", "--no-moe-dropless",
                    "--moe-capacity-factor", "1.1")  # fmt: skip
    assert MoE(model, ours).expert_capacity(16) == 4 and not ours.drop_by_weight
    _, position = build("--moe-num-experts", "8", "--moe-expert-capacity-factor", "1.1",
                        "--moe-token-drop-policy", "position")  # fmt: skip
    assert not position.drop_by_weight
    _, dropless = build("--moe-num-experts", "8", "--moe-expert-capacity-factor", "-1")
    assert dropless.dropless and not dropless.capacity_rounds_up


def test_the_shared_expert_and_the_accepted_switches():
    config, moe = build("--moe-num-experts", "4", "--moe-shared-expert-intermediate-size", "24",
                        "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather",
                        "--moe-shared-expert-overlap", "--moe-permute-fusion",
                        "--moe-router-fusion", "--moe-use-legacy-grouped-gemm",
                        "--moe-input-jitter-eps", "0.01")  # fmt: skip
    assert (moe.shared_expert, moe.shared_expert_ffn_hidden_size, moe.jitter_eps) == (
        True,
        24,
        0.01,
    )
    notes = [note for note in config.notes if note.endswith("no effect")]
    assert len(notes) == 6, config.notes
    assert (
        "mixture of experts: Megatron-Core's names:" in build_parser([add_moe_args]).format_help()
    )


def test_the_balancing_losses_are_megatron_cores():
    """Megatron-Core's load-balancing loss, E * sum_i f_i * P_i (f_i: expert i's share of the
    T * k assignments, P_i: its mean probability), per micro-batch and per sequence (the mean of
    each sequence's); ours is the same number."""
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.rand(12, 4, generator=generator).softmax(-1)
    indices = probabilities.topk(2, dim=-1).indices
    counts = torch.bincount(indices.reshape(-1), minlength=4).float()
    expected = 4 * ((counts / (12 * 2)) * probabilities.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss(counts, probabilities, 2), expected)
    per_sequence = []
    for sequence in range(3):
        rows = slice(4 * sequence, 4 * sequence + 4)
        own = torch.bincount(indices[rows].reshape(-1), minlength=4).float()
        per_sequence.append(4 * ((own / (4 * 2)) * probabilities[rows].mean(0)).sum())
    torch.testing.assert_close(
        sequence_load_balancing_loss(indices, probabilities, 3), torch.stack(per_sequence).mean()
    )


@pytest.mark.parametrize(
    "flags, line",
    [
        (("--num-experts", "4", "--moe-num-experts", "2", "--disable-bias-linear"),
         "--num-experts 4 and --moe-num-experts 2 set one setting differently"),
        (("--moe-num-experts", "4", "--moe-router-topk", "2", "--moe-top-k", "1"),
         "--moe-router-topk 2 and --moe-top-k 1 set one setting differently"),
        (("--moe-num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-loss-weight", "0.02"),
         "--moe-aux-loss-coeff 0.01 (each of the 4 MoE layers' loss: --moe-loss-weight 0.04, "
         "the weight of their mean) and --moe-loss-weight 0.02 set one setting differently"),
        (("--moe-num-experts", "4", "--moe-z-loss-coeff", "0.001", "--moe-zloss-weight", "0.001"),
         "--moe-z-loss-coeff 0.001 (each of the 4 MoE layers' loss"),
        (("--moe-num-experts", "4", "--moe-router-score-function", "sigmoid",
          "--moe-router-score", "softmax"),
         "--moe-router-score-function sigmoid and --moe-router-score softmax"),
        (("--moe-num-experts", "4", "--moe-top-k", "2", "--moe-router-score-function", "sigmoid",
          "--moe-normalize-expert-weights", "2"),
         "--moe-router-score-function sigmoid at top-k 2 (the chosen scores divided by their "
         "sum: --moe-normalize-expert-weights 1) and --moe-normalize-expert-weights 2.0"),
        (("--moe-num-experts", "4", "--moe-input-jitter-eps", "0.1", "--moe-jitter-eps", "0.2"),
         "--moe-input-jitter-eps 0.1 and --moe-jitter-eps 0.2"),
        (("--moe-num-experts", "4", "--moe-shared-expert-intermediate-size", "16",
          "--moe-shared-expert", "--moe-shared-expert-ffn-hidden-size", "32"),
         "--moe-shared-expert-intermediate-size 16 and --moe-shared-expert-ffn-hidden-size 32"),
        (("--moe-num-experts", "4", "--moe-expert-capacity-factor", "1.5", "--moe-dropless",
          "--moe-token-drop-policy", "position"),
         "--moe-expert-capacity-factor 1.5 and --moe-dropless set one setting differently"),
        (("--moe-num-experts", "4", "--moe-expert-capacity-factor", "1.5",
          "--moe-capacity-factor", "2", "--moe-token-drop-policy", "position"),
         "--moe-expert-capacity-factor 1.5 and --moe-capacity-factor 2.0"),
        (("--moe-num-experts", "4", "--moe-expert-capacity-factor", "-1", "--no-moe-dropless"),
         "--moe-expert-capacity-factor -1.0 and --no-moe-dropless"),
    ],
)  # fmt: skip
def test_both_spellings_must_agree(flags, line):
    assert line in refusal(*flags)


def test_both_spellings_that_agree_are_accepted():
    _, moe = build("--num-experts", "4", "--moe-num-experts", "4", "--disable-bias-linear",
                   "--moe-router-topk", "2", "--moe-top-k", "2", "--moe-aux-loss-coeff", "0.01",
                   "--moe-loss-weight", "0.04", "--moe-router-score-function", "sigmoid",
                   "--moe-normalize-expert-weights", "1")  # fmt: skip
    assert (moe.num_experts, moe.top_k, moe.loss_weight) == (4, 2, 0.04)


@pytest.mark.parametrize(
    "flags, line",
    [
        (("--num-experts", "4"),
         "--num-experts declares Megatron-Core's MoE layers, whose experts each have linear "
         "biases unless --disable-bias-linear"),
        (("--moe-num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"),
         "--moe-router-load-balancing-type 'sinkhorn' is not one of ('aux_loss', "
         "'seq_aux_loss', 'global_aux_loss', 'none') (sinkhorn is not implemented here"),
        (("--moe-num-experts", "4", "--moe-router-load-balancing-type", "quantile_balancing"),
         "(quantile_balancing is not implemented here"),
        (("--moe-num-experts", "4", "--moe-token-dispatcher-type", "flex"),
         "--moe-token-dispatcher-type flex (DeepEP's or HybridEP's dispatch) is not implemented "
         "here; use alltoall"),
        (("--moe-num-experts", "4", "--expert-tensor-parallel-size", "2"),
         "--expert-tensor-parallel-size 2: the experts here are split over the "
         "--tensor-model-parallel-size 1 ranks as the dense MLP is (Megatron-Core's default); "
         "another split of the experts is not implemented: drop the flag or give 1"),
        (("--moe-num-experts", "4", "--moe-enable-deepep"),
         "--moe-enable-deepep: DeepEP is not implemented here; drop it"),
        (("--moe-num-experts", "4", "--moe-router-score-function", "sqrtsoftplus"),
         "--moe-router-score-function sqrtsoftplus is not implemented here; use softmax or "
         "sigmoid"),
        (("--moe-num-experts", "4", "--moe-expert-capacity-factor", "0"),
         "--moe-expert-capacity-factor 0 gives every expert a capacity of 0"),
        (("--moe-num-experts", "4", "--moe-pad-expert-input-to-capacity"),
         "--moe-pad-expert-input-to-capacity pads to the capacity --moe-expert-capacity-factor "
         "sets; add it or drop the flag"),
        (("--moe-num-experts", "4", "--moe-grouped-gemm", "--moe-impl", "reference"),
         "--moe-grouped-gemm asks for grouped GEMMs and --moe-impl reference"),
        (("--moe-num-experts", "4", "--moe-aux-loss-coeff", "-0.1"),
         "--moe-aux-loss-coeff must be >= 0, got -0.1"),
        (("--moe-num-experts", "4", "--moe-aux-loss-coeff", "0.1", "--moe-layer-freq", "[1,0]"),
         "--moe-aux-loss-coeff weights each MoE layer's loss, and --moe-layer-freq [1,0] does "
         "not mark layers of --num-layers 4"),
    ],
)  # fmt: skip
def test_what_is_missing_is_refused_in_one_line(flags, line):
    assert line in refusal(*flags)


def test_the_expert_split_of_the_tensor_parallel_size_is_accepted():
    config, moe = build("--moe-num-experts", "4", "--expert-tensor-parallel-size", "1")
    plain_config, plain_moe = build("--moe-num-experts", "4")
    assert moe == plain_moe and config.parallel == plain_config.parallel
