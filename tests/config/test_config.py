"""Megatron-compatible flags: defaults, derived values, aliases, the frozen config built from
them, extension flag groups and the printed arguments block."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron.config import (
    Config,
    ConfigError,
    build_parser,
    format_arguments_block,
    parse_arguments,
    parse_config,
    resolve_arguments,
)
from tests.config.command_lines import MEGABLOCKS_125M, argv, config

# --- a real launch line -------------------------------------------------------------------


def test_megablocks_125m_command_line_on_8_ranks():
    cfg = parse_config(MEGABLOCKS_125M, world_size=8)
    model = cfg.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (12, 768, 12)
    assert (model.seq_length, model.max_position_embeddings) == (1024, 1024)
    assert model.ffn_hidden_size == 3072 and model.kv_channels == 64
    assert model.init_method_std == 0.01 and model.padded_vocab_size == 0
    assert cfg.parallel.world_size == 8 and cfg.parallel.data_parallel_size == 8
    assert not hasattr(cfg.parallel, "ddp_impl")  # --DDP-impl has no effect (a note says so)
    assert cfg.parallel.accumulate_allreduce_grads_in_fp32  # implied by --bf16
    assert cfg.training.micro_batch_size == 8 and cfg.training.global_batch_size == 512
    assert cfg.training.num_micro_batches == 512 // (8 * 8)
    assert cfg.training.bf16 and not cfg.training.fp16 and cfg.training.use_flash_attn
    assert cfg.numerics.compute_dtype == torch.bfloat16 and cfg.numerics.autocast
    assert cfg.training.train_iters == 2000 and cfg.training.train_samples is None
    optimizer = cfg.optimizer
    assert (optimizer.lr, optimizer.min_lr, optimizer.clip_grad) == (0.0006, 0.00006, 1.0)
    assert optimizer.lr_decay_style == "cosine" and optimizer.lr_decay_iters == 2000
    assert optimizer.lr_warmup_fraction == 0.01 and optimizer.lr_warmup_iters == 0
    assert cfg.data.data_path == ("1.0", "pile/01_text_document", "1.0", "pile/02_text_document")
    assert cfg.data.split == "969,30,1" and cfg.data.make_vocab_size_divisible_by == 1024
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    assert cfg.checkpoint.save == "./ckpt" and cfg.checkpoint.save_interval == 2000
    assert cfg.logging.log_interval == 100
    assert (cfg.training.eval_iters, cfg.training.eval_interval) == (100, 1000)


# --- defaults -------------------------------------------------------------------------------


def test_megatron_defaults():
    cfg = config()
    model, optimizer, training = cfg.model, cfg.optimizer, cfg.training
    assert model.ffn_hidden_size == 4 * 64
    assert (model.hidden_dropout, model.attention_dropout, model.init_method_std) == (
        0.1,
        0.1,
        0.02,
    )
    assert model.position_embedding_type == "learned_absolute"
    assert (model.normalization, model.layernorm_epsilon) == ("LayerNorm", 1e-5)
    assert (model.rotary_percent, model.rotary_base) == (1.0, 10000)
    assert model.add_bias_linear and not model.swiglu
    assert not model.untie_embeddings_and_output_weights
    assert model.num_query_groups == 0
    assert model.recompute_granularity is None and model.recompute_method is None
    assert model.recompute_num_layers is None
    assert (optimizer.optimizer, optimizer.weight_decay, optimizer.clip_grad) == ("adam", 0.01, 1.0)
    assert (optimizer.adam_beta1, optimizer.adam_beta2, optimizer.adam_eps) == (0.9, 0.999, 1e-8)
    assert optimizer.sgd_momentum == 0.9 and optimizer.min_lr == 0.0
    assert optimizer.lr_decay_style == "linear"
    assert optimizer.lr_decay_iters == 10  # defaults to --train-iters
    assert optimizer.lr_warmup_fraction is None and optimizer.lr_warmup_iters == 0
    assert optimizer.loss_scale is None and optimizer.initial_loss_scale == 2**32
    assert (optimizer.min_loss_scale, optimizer.loss_scale_window, optimizer.hysteresis) == (
        1.0,
        1000,
        2,
    )
    assert training.seed == 1234 and not cfg.numerics.autocast
    assert (training.eval_iters, training.eval_interval) == (100, 1000)
    assert training.exit_interval is None and not training.exit_signal_handler
    assert cfg.data.split == "969, 30, 1" and cfg.data.num_workers == 2
    assert cfg.data.make_vocab_size_divisible_by == 128 and cfg.data.data_impl == "infer"
    assert cfg.parallel.distributed_backend == "nccl"
    assert not cfg.parallel.accumulate_allreduce_grads_in_fp32
    assert cfg.logging.log_interval == 100 and cfg.logging.tensorboard_log_interval == 1
    assert cfg.logging.timing_log_level == 0
    assert not cfg.checkpoint.no_save_optim and not cfg.checkpoint.no_load_rng


def test_global_batch_size_defaults_to_micro_times_data_parallel():
    cfg = config(world_size=4)
    assert cfg.training.global_batch_size == 2 * 4 and cfg.training.num_micro_batches == 1
    assert "setting global batch size to 8" in cfg.notes


def test_tensor_parallel_layout_and_sequence_parallel():
    cfg = config("--tensor-model-parallel-size", "2", "--sequence-parallel", world_size=8)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.data_parallel_size == 4
    assert cfg.model.tensor_model_parallel_size == 2 and cfg.model.sequence_parallel
    assert cfg.training.global_batch_size == 2 * 4
    alone = config("--sequence-parallel", world_size=2)
    assert not alone.model.sequence_parallel
    assert any("--sequence-parallel has no effect" in note for note in alone.notes)


@pytest.mark.parametrize(
    "hidden, heads, expected",
    [(768, 12, 2048), (4096, 32, 10880), (1024, 16, 2688)],
)
def test_swiglu_ffn_default_is_two_thirds_of_4h_rounded_down_to_64(hidden, heads, expected):
    cfg = config("--swiglu", hidden_size=str(hidden), num_attention_heads=str(heads))
    assert cfg.model.swiglu and cfg.model.ffn_hidden_size == expected


def test_explicit_ffn_hidden_size_wins():
    assert config("--swiglu", ffn_hidden_size="100").model.ffn_hidden_size == 100


def test_rope_defaults_max_position_embeddings_to_seq_length():
    cfg = config("--position-embedding-type", "rope", drop=("--max-position-embeddings",))
    assert cfg.model.position_embedding_type == "rope"
    assert cfg.model.max_position_embeddings == 32


def test_rope_does_not_bound_seq_length_by_max_position_embeddings():
    cfg = config("--position-embedding-type", "rope", max_position_embeddings="16")
    assert cfg.model.seq_length == 32


def test_model_flags():
    cfg = config(
        *"--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear "
        "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
        "--rotary-base 500000".split()
    )
    model = cfg.model
    assert (model.normalization, model.layernorm_epsilon) == ("RMSNorm", 1e-6)
    assert not model.add_bias_linear and model.untie_embeddings_and_output_weights
    assert model.num_query_groups == 2 and model.kv_channels == 16
    assert model.rotary_base == 500000


def test_num_query_groups_ignored_without_group_query_attention():
    assert config("--num-query-groups", "2").model.num_query_groups == 0


def test_sample_based_training_defaults_decay_samples():
    cfg = config("--train-samples", "1000", "--lr-warmup-samples", "10", drop=("--train-iters",))
    assert cfg.training.train_samples == 1000 and cfg.training.train_iters is None
    assert cfg.optimizer.lr_decay_samples == 1000 and cfg.optimizer.lr_decay_iters is None
    assert cfg.optimizer.lr_warmup_samples == 10


def test_every_section_of_the_config_is_frozen():
    cfg = Config.from_args(parse_arguments(argv()), world_size=1, padded_vocab_size=128)
    assert cfg.model.padded_vocab_size == 128 and cfg.model.kv_channels == 16
    sections = [getattr(cfg, field.name) for field in dataclasses.fields(cfg)]
    for section in [cfg] + [s for s in sections if dataclasses.is_dataclass(s)]:
        name = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, getattr(section, name))
    with pytest.raises(TypeError):
        cfg.arguments["num_layers"] = 3


@dataclasses.dataclass(frozen=True)
class _ExtensionConfig:
    layers: int


def test_extensions_are_built_once_with_the_rest():
    seen = []

    def build(args, base):
        seen.append(args.num_layers)
        return _ExtensionConfig(base.model.num_layers) if args.num_layers > 1 else None

    cfg = Config.from_args(parse_arguments(argv()), 1, extensions=[build])
    assert cfg.extension(_ExtensionConfig) == _ExtensionConfig(cfg.model.num_layers)
    assert seen == [cfg.model.num_layers]
    small = Config.from_args(parse_arguments(argv("--num-layers", "1")), 1, extensions=[build])
    assert small.extension(_ExtensionConfig) is None and small.extensions == ()


def test_saved_arguments_are_a_fresh_copy_with_the_padded_vocabulary():
    cfg = Config.from_args(parse_arguments(argv()), world_size=1, padded_vocab_size=50304)
    saved = cfg.saved_arguments()
    assert saved.padded_vocab_size == 50304 and saved.num_layers == cfg.model.num_layers
    assert "padded_vocab_size" not in cfg.arguments  # Megatron's arguments block has none
    saved.consumed_train_samples = 7
    saved.num_layers = 99
    assert cfg.saved_arguments().num_layers == cfg.model.num_layers
    assert not hasattr(cfg.saved_arguments(), "consumed_train_samples")


def test_from_args_leaves_the_namespace_untouched():
    namespace = parse_arguments(argv("--checkpoint-activations"))
    before = dict(vars(namespace))
    Config.from_args(namespace, world_size=2)
    assert vars(namespace) == before


# --- aliases --------------------------------------------------------------------------------


def test_checkpoint_activations_is_full_uniform_recompute():
    cfg = config("--checkpoint-activations")
    assert cfg.model.recompute_granularity == "full"
    assert cfg.model.recompute_method == "uniform" and cfg.model.recompute_num_layers == 1
    assert any("--checkpoint-activations is deprecated" in note for note in cfg.notes)
    resolved = resolve_arguments(parse_arguments(argv("--checkpoint-activations")), 1)
    assert not hasattr(resolved, "checkpoint_activations")  # dropped once applied, as Megatron does


def test_checkpoint_activations_keeps_an_explicit_method():
    cfg = config("--checkpoint-activations", "--recompute-method", "block")
    assert cfg.model.recompute_method == "block"


@pytest.mark.parametrize("flag", ["--data-impl", "--dataset-impl"])
def test_data_impl_aliases(flag):
    assert config(flag, "mmap").data.data_impl == "mmap"


def test_layernorm_epsilon_aliases():
    assert config("--layernorm-epsilon", "1e-6").model.layernorm_epsilon == 1e-6
    assert config("--norm-epsilon", "1e-6").model.layernorm_epsilon == 1e-6


def test_no_effect_fusion_flags_are_accepted():
    config(
        "--no-bias-gelu-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-async-tensor-model-parallel-allreduce",
        "--log-num-zeros-in-grad",
        "--log-params-norm",
        "--timing-log-level",
        "2",
    )


def test_recompute_selective_and_block():
    assert config("--recompute-granularity", "selective").model.recompute_num_layers is None
    cfg = config(
        *"--recompute-granularity full --recompute-method block --recompute-num-layers 2".split()
    )
    assert (cfg.model.recompute_method, cfg.model.recompute_num_layers) == ("block", 2)


# --- extension groups -----------------------------------------------------------------------


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="moe")
    group.add_argument("--moe-num-experts", type=int, default=None)


def test_extra_argument_groups_are_accepted():
    extended = argv("--moe-num-experts=8")
    namespace = parse_arguments(extended, extra_groups=[_add_moe_args])
    assert namespace.moe_num_experts == 8
    assert parse_config(extended, 1, extra_groups=[_add_moe_args]).model.num_layers == 2
    with pytest.raises(ConfigError, match="unrecognized arguments: --moe-num-experts=8"):
        parse_config(extended, 1)
    assert "--moe-num-experts" in build_parser([_add_moe_args]).format_help()


# --- the printed block ----------------------------------------------------------------------


def test_arguments_block_format():
    block = format_arguments_block(argparse.Namespace(b_value=2, DDP_impl="local", a=None))
    assert block.splitlines() == [
        "------------------------ arguments ------------------------",
        "  a " + "." * 47 + " None",
        "  b_value " + "." * 41 + " 2",
        "  DDP_impl " + "." * 40 + " local",
        "-------------------- end of arguments ---------------------",
    ]


def test_arguments_block_of_resolved_arguments():
    resolved = resolve_arguments(parse_arguments(MEGABLOCKS_125M), world_size=8)
    lines = format_arguments_block(resolved).splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower)
    assert "  accumulate_allreduce_grads_in_fp32 .............. True" in body
    assert "  data_parallel_size .............................. 8" in body
    assert "  global_batch_size ............................... 512" in body
    assert "  lr_decay_iters .................................. 2000" in body
    assert "  world_size ...................................... 8" in body
    # Empty values (Megatron's unset --wandb-* strings) print as nothing after the dots.
    assert "  wandb_project " + "." * 35 + " " in body
    for line in body:
        name, dots, *_ = line.strip().split(" ", 2)
        assert dots == "." * (48 - len(name))


def test_the_kernel_mode_is_read_from_the_environment_once_into_the_config(monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    cfg = config()
    monkeypatch.setenv("MEGATRON_KERNELS", "triton")
    assert cfg.training.kernels == "reference" and cfg.arguments["kernels"] == "reference"
    monkeypatch.delenv("MEGATRON_KERNELS")
    assert config().training.kernels == "auto"


def test_the_kernel_variables_earlier_name_still_chooses(monkeypatch):
    monkeypatch.delenv("MEGATRON_KERNELS", raising=False)
    monkeypatch.setenv("MOE_KERNELS", "reference")
    assert config().training.kernels == "reference"
    monkeypatch.setenv("MEGATRON_KERNELS", "triton")
    assert config().training.kernels == "triton"  # the current name wins
