"""Impossible or unsupported command lines: one ConfigError naming the flags, before any work."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.config import Config, ConfigError, parse_arguments
from tests.config.command_lines import config, error_message


@pytest.mark.parametrize(
    "extra, kwargs, world_size, expected",
    [
        ((), {"num_attention_heads": "5"}, 1, ["--num-attention-heads 5", "--hidden-size 64"]),
        (
            ("--group-query-attention", "--num-query-groups", "3"),
            {},
            1,
            ["--num-query-groups 3", "--num-attention-heads 4"],
        ),
        ((), {"global_batch_size": "12"}, 4, ["--global-batch-size 12", "--micro-batch-size 2"]),
        (
            ("--tensor-model-parallel-size", "3"),
            {},
            8,
            ["world size 8", "--tensor-model-parallel-size 3"],
        ),
        (("--train-samples", "100"), {}, 1, ["--train-iters", "--train-samples", "both"]),
        ((), {"drop": ("--train-iters",)}, 1, ["--train-iters", "--train-samples", "neither"]),
        (("--bf16", "--fp16"), {}, 1, ["--fp16", "--bf16"]),
        (("--async-save",), {}, 1, ["--async-save was given without --save", "add --save DIR"]),
        (("--ddp-bucket-size", "0"), {}, 1, ["--ddp-bucket-size must be > 0, got 0"]),
        (
            ("--use-distributed-optimizer", "--overlap-param-gather"),
            {},
            2,
            ["--overlap-param-gather needs", "--overlap-grad-reduce"],
        ),
        *(
            (("--use-torch-fsdp2", *flags), {}, world_size, ["--use-torch-fsdp2", *named])
            for flags, world_size, named in (
                (("--use-distributed-optimizer",), 2, ["--use-distributed-optimizer"]),
                (("--pipeline-model-parallel-size", "2"), 2, ["--pipeline-model-parallel-size"]),
                (("--fp8-format", "hybrid", "--bf16"), 2, ["--fp8-format"]),
                (("--use-precision-aware-optimizer",), 2, ["--use-precision-aware-optimizer"]),
                (("--optimizer-cpu-offload",), 2, ["--optimizer-cpu-offload"]),
                (("--ckpt-format", "torch"), 2, ["--ckpt-format torch", "torch_dist"]),
                (("--grad-reduce-in-bf16",), 2, ["--grad-reduce-in-bf16 without --bf16"]),
                (
                    "--data-parallel-replicate-degree 2 --expert-model-parallel-size 2".split(),
                    4,
                    ["--data-parallel-replicate-degree > 1", "--expert-model-parallel-size"],
                ),
            )
        ),
        (
            ("--use-torch-fsdp2", "--data-parallel-replicate-degree", "3"),
            {},
            4,
            ["--data-parallel-replicate-degree 3", "4 data-parallel ranks"],
        ),
        (
            ("--data-parallel-replicate-degree", "2"),
            {},
            2,
            ["--data-parallel-replicate-degree needs --use-torch-fsdp2"],
        ),
        ((), {"seq_length": "64"}, 1, ["--seq-length 64", "--max-position-embeddings 32"]),
        (
            ("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"),
            {},
            1,
            ["--lr-warmup-fraction 0.1", "--lr-warmup-iters 2"],
        ),
        ((), {"min_lr": "0.01"}, 1, ["--min-lr 0.01", "--lr 0.001"]),
        ((), {"drop": ("--data-path",)}, 1, ["--data-path", "--train-data-path"]),
        ((), {"data_path": "1.0 a 2.0"}, 1, ["--data-path", "3 entries", "pairs"]),
        ((), {"data_path": "x a 2.0 b"}, 1, ["--data-path", "'x'"]),
        (
            ("--train-data-path", "t"),
            {},
            1,
            ["--data-path", "--train-data-path", "one data source"],
        ),
        ((), {"split": "90,x,5"}, 1, ["--split", "'x'"]),
        (("--recompute-method", "uniform"), {}, 1, ["--recompute-method uniform", "full"]),
        (
            ("--recompute-granularity", "selective", "--recompute-method", "block"),
            {},
            1,
            ["--recompute-method block", "--recompute-granularity full"],
        ),
        (("--recompute-granularity", "full"), {}, 1, ["--recompute-method"]),
        (
            ("--checkpoint-activations", "--recompute-granularity", "selective"),
            {},
            1,
            ["--checkpoint-activations", "--recompute-granularity selective"],
        ),
        (
            "--recompute-granularity full --recompute-method block --recompute-num-layers 3".split(),
            {},
            1,
            ["--recompute-num-layers 3", "--num-layers 2"],
        ),
        ((), {"drop": ("--vocab-file",)}, 1, ["GPT2BPETokenizer", "--vocab-file"]),
        ((), {"drop": ("--merge-file",)}, 1, ["GPT2BPETokenizer", "--merge-file"]),
        (
            ("--tokenizer-type", "SentencePieceTokenizer"),
            {},
            1,
            ["SentencePieceTokenizer", "--tokenizer-model"],
        ),
        (
            ("--tokenizer-type", "NullTokenizer"),
            {},
            1,
            ["--tokenizer-type NullTokenizer needs --vocab-size N"],
        ),
        (
            "--tokenizer-type TikTokenizer --tokenizer-model v.json --vocab-size 1000".split(),
            {},
            1,
            ["--tiktoken-num-special-tokens 1000 leaves no id", "--vocab-size 1000"],
        ),
        (
            ("--tokenizer-special-tokens", "<unk>"),
            {},
            1,
            ["--tokenizer-special-tokens is read only with --tokenizer-type TikTokenizer"],
        ),
        (("--save-interval", "5"), {}, 1, ["--save-interval 5", "--save"]),
        (("--save", "ckpt"), {}, 1, ["--save ckpt", "--save-interval"]),
        (("--rampup-batch-size", "16", "8", "1000"), {}, 1, ["--rampup-batch-size", "supported"]),
        (
            ("--tensor-model-parallel-size", "8"),
            {},
            8,
            ["--num-attention-heads 4", "--tensor-model-parallel-size 8"],
        ),
        (
            ("--tensor-model-parallel-size", "2", "--ffn-hidden-size", "63"),
            {},
            2,
            ["--ffn-hidden-size 63", "--tensor-model-parallel-size 2"],
        ),
        (
            "--tensor-model-parallel-size 4 --group-query-attention --num-query-groups 2".split(),
            {},
            4,
            ["--num-query-groups 2", "--tensor-model-parallel-size 4"],
        ),
        (
            ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
            {"seq_length": "31"},
            2,
            ["--seq-length 31", "--tensor-model-parallel-size 2"],
        ),
        ((), {"drop": ("--lr", "--num-layers")}, 1, ["--num-layers", "--lr"]),
        ((), {"drop": ("--max-position-embeddings",)}, 1, ["--max-position-embeddings"]),
        (("--data-impl", "lazy"), {}, 1, ["--data-impl lazy", "mmap"]),
        ((), {"hidden_dropout": "1.5"}, 1, ["--hidden-dropout", "1.5"]),
        ((), {"micro_batch_size": "0"}, 1, ["--micro-batch-size", "> 0"]),
        (
            ("--lr-decay-samples", "100"),
            {},
            1,
            ["--train-iters", "--lr-decay-samples", "--lr-decay-iters"],
        ),
        (("--lr-warmup-iters", "10"), {}, 1, ["--lr-warmup-iters 10", "--lr-decay-iters 10"]),
        (
            ("--position-embedding-type", "rope", "--rotary-percent", "0.1"),
            {},
            1,
            ["--rotary-percent 0.1", "even"],
        ),
        (
            ("--DDP-impl", "torch", "--accumulate-allreduce-grads-in-fp32"),
            {},
            1,
            ["--accumulate-allreduce-grads-in-fp32", "--DDP-impl local"],
        ),
    ],
)
def test_validation_errors_name_the_flags(extra, kwargs, world_size, expected):
    message = error_message(*extra, world_size=world_size, **kwargs)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} missing from {message!r}"


def test_fully_shard_names_the_torch_it_needs(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    message = error_message("--use-torch-fsdp2", world_size=2)
    assert "--use-torch-fsdp2 needs torch 2.6 or newer" in message
    assert "this is torch 2.5.1" in message


@pytest.mark.parametrize(
    "flag, advice",
    [
        ("--main-grads-dtype", "drop --main-grads-dtype; to reduce the gradients in bf16, use "
         "--grad-reduce-in-bf16"),
        ("--exp-avg-dtype", "drop --exp-avg-dtype"),
    ],
)  # fmt: skip
def test_fully_shard_refuses_the_optimizer_dtypes_without_sending_to_a_flag_it_refuses(
    flag, advice
):
    """Not "add --use-precision-aware-optimizer", which --use-torch-fsdp2 refuses in turn."""
    message = error_message("--use-torch-fsdp2", "--bf16", flag, "bf16", world_size=2)
    assert message.startswith(f"{flag} bf16 lowers the distributed optimizer's state")
    assert message.endswith(advice) and "add --use-precision-aware-optimizer" not in message


@pytest.mark.parametrize(
    "flags, name, default",
    [
        (("--overlap-grad-reduce",), "overlap_grad_reduce", False),
        (("--overlap-param-gather",), "overlap_param_gather", False),
    ],
)
def test_fully_shard_notes_the_other_modes_flags_it_does_without(flags, name, default):
    """Each in one note saying so (and to drop it), reset so that nothing reads it; before, the
    first two passed without a word and --overlap-param-gather was refused with "add
    --use-distributed-optimizer", which FSDP2 refuses."""
    cfg = config("--use-torch-fsdp2", *flags, world_size=2)
    noted = [note for note in cfg.notes if note.startswith(f"{flags[0]} ")]
    assert len(noted) == 1, cfg.notes
    assert "has no effect under --use-torch-fsdp2" in noted[0] and noted[0].endswith(
        "drop the flag"
    )
    assert getattr(cfg.parallel, name) == default
    assert not any("no effect" in note for note in config("--use-torch-fsdp2", world_size=2).notes)


@pytest.mark.parametrize("value", ["local", "torch"])
@pytest.mark.parametrize("mode", [(), ("--use-distributed-optimizer",)])
def test_ddp_impl_is_accepted_with_one_note_saying_it_has_no_effect(value, mode):
    """Megatron-LM's scripts pass --DDP-impl; nothing here reads it (the data-parallel mode
    reduces the gradients), which the run says in one note instead of nothing."""
    noted = [n for n in config("--DDP-impl", value, *mode, world_size=2).notes if "DDP" in n]
    assert noted == [
        f"--DDP-impl {value}: the gradients are reduced by the data-parallel mode here (torch "
        "DDP, or --use-distributed-optimizer's or --use-torch-fsdp2's reduce-scatter); no effect"
    ]
    assert not any("DDP" in note for note in config(*mode, world_size=2).notes)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_bad_world_size():
    with pytest.raises(ConfigError, match="world size"):
        config(world_size=0)


def test_unknown_flag_is_reported():
    with pytest.raises(ConfigError, match="unrecognized arguments: --foo"):
        config("--foo", "3")


def test_flags_are_not_abbreviated():
    with pytest.raises(ConfigError, match="unrecognized arguments: --num-lay"):
        parse_arguments(["--num-lay", "2"])


def test_bad_choice_and_bad_type_raise_config_error():
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        config("--lr-decay-style", "exponential")
    with pytest.raises(ConfigError, match="--num-layers"):
        config(num_layers="two")


def test_load_dir_missing_is_only_a_note(tmp_path):
    missing = tmp_path / "nothing"
    cfg = config("--load", str(missing))
    assert cfg.checkpoint.load == str(missing)
    assert any("does not exist" in note and str(missing) in note for note in cfg.notes)
    assert not any("--load" in note for note in config("--load", str(tmp_path)).notes)


def test_vocab_size_beside_a_tokenizer_that_does_not_read_it_is_a_note():
    (note,) = [note for note in config("--vocab-size", "50000").notes if "--vocab-size" in note]
    assert note == (
        "--vocab-size 50000 is not read by GPT2BPETokenizer: its vocabulary is its files' (only "
        "TikTokenizer and NullTokenizer read --vocab-size)"
    )
    assert not any("--vocab-size" in note for note in config().notes)


def test_per_split_data_paths():
    cfg = config(*"--train-data-path 1 a 1 b --valid-data-path v".split(), drop=("--data-path",))
    assert cfg.data.data_path is None
    assert cfg.data.train_data_path == ("1", "a", "1", "b")
    assert cfg.data.valid_data_path == ("v",) and cfg.data.test_data_path is None


def test_an_unknown_kernel_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "fast")
    message = error_message()
    assert "MEGATRON_KERNELS='fast'" in message and "auto, triton, reference" in message


@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--exp-avg-dtype", "bf16"), ["--exp-avg-dtype bf16", "--use-precision-aware-optimizer"]),
        (("--main-grads-dtype", "bf16"), ["--main-grads-dtype bf16", "--use-precision-aware"]),
        (
            ("--use-precision-aware-optimizer", "--main-params-dtype", "fp16"),
            ["--main-params-dtype fp16", "fp32 master weights"],
        ),
        (
            ("--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp16"),
            ["--exp-avg-sq-dtype fp16", "underflows", "bf16"],
        ),
        (
            ("--use-precision-aware-optimizer", "--optimizer", "sgd"),
            ["--use-precision-aware-optimizer", "--optimizer adam", "sgd"],
        ),
        (("--optimizer-cpu-offload", "--optimizer", "sgd"), ["--optimizer-cpu-offload", "sgd"]),
        (("--optimizer-offload-fraction", "1.5"), ["--optimizer-offload-fraction", "[0, 1]"]),
        (
            (
                "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
                "--accumulate-allreduce-grads-in-fp32",
            ),
            ["--main-grads-dtype bf16", "--accumulate-allreduce-grads-in-fp32"],
        ),
    ],
)  # fmt: skip
def test_optimizer_state_flags_that_cannot_work_are_refused(extra, expected):
    message = error_message(*extra)
    assert "\n" not in message
    for part in expected:
        assert part in message, message


def test_precision_aware_flags_reach_the_config():
    built = config(
        "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
        "--exp-avg-dtype", "bf16", "--optimizer-cpu-offload",
        "--optimizer-offload-fraction", "0.25", "--bf16",
    )  # fmt: skip
    optimizer = built.optimizer
    assert optimizer.use_precision_aware_optimizer and optimizer.main_grads_dtype == "bf16"
    assert optimizer.exp_avg_dtype == "bf16" and optimizer.exp_avg_sq_dtype == "fp32"
    assert optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction == 0.25
    # bf16 main gradients replace Megatron's fp32 accumulation note.
    assert not built.arguments["accumulate_allreduce_grads_in_fp32"]


def test_a_two_weight_split_is_a_note_saying_how_it_is_read():
    notes = config("--split", "1,2").notes
    assert any(
        "--split 1,2 has 2 weights" in note and "train 33.3%, validation 66.7%, test 0.0%" in note
        for note in notes
    ), notes
    assert not any("--split" in note for note in config("--split", "949,50,1").notes)
    assert not any("--split" in note for note in config("--split", "1").notes)


def test_saved_arguments_from_before_a_flag_existed_build_with_its_default():
    """Tools build the Config of a checkpoint from its saved arguments (e.g.
    gpt_pretraining.GPT_RUN.config_from_saved); a checkpoint saved before a
    flag existed lacks its attribute, which then takes the field's default."""
    saved = argparse.Namespace(**dict(config().arguments))
    del saved.check_for_nan_in_loss_and_grad
    rebuilt = Config.from_resolved(saved, [], 50304)
    assert rebuilt.training.check_for_nan_in_loss_and_grad is True


def test_megatron_cores_distributed_optimizer_instances_are_refused_naming_hybrid_fsdp2():
    for flags in (("--use-distributed-optimizer",), ("--use-torch-fsdp2",)):
        message = error_message(*flags, "--num-distributed-optimizer-instances", "2", world_size=4)
        assert message == (
            "--num-distributed-optimizer-instances 2 is Megatron-Core's partial distributed "
            "optimizer (instances each sharding the optimizer state over a subset of the "
            "data-parallel ranks), which this project does not have; drop it, or shard within "
            "replicas with --use-torch-fsdp2 --data-parallel-replicate-degree 2"
        )
    # One instance is Megatron-Core's plain distributed optimizer: accepted.
    one = config("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "1")
    assert one.parallel.use_distributed_optimizer


def test_hybrid_fsdp2_replicas_and_the_checkpoints_saved_under_the_old_name():
    """--data-parallel-replicate-degree R: R replicas of data-parallel size / R shards each.
    Checkpoints saved when it was spelled --num-distributed-optimizer-instances hold it under
    that attribute and build the same layout."""
    hybrid = config("--use-torch-fsdp2", "--data-parallel-replicate-degree", "2", world_size=4)
    assert hybrid.parallel.data_parallel_replicate_degree == 2
    older = argparse.Namespace(**dict(hybrid.arguments))
    older.data_parallel_replicate_degree = 1  # the default a reader fills in for a missing flag
    older.num_distributed_optimizer_instances = 2
    again = Config.from_resolved(older, [], hybrid.model.padded_vocab_size)
    assert again.parallel == hybrid.parallel
