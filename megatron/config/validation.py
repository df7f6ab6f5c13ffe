"""Parse Megatron flags, check every combination up front, and fill Megatron's derived defaults.

Nothing here starts work: a bad command line stops with one `ConfigError` that names the
flags and values involved and says what to change.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.arguments import ArgumentGroupAdder, build_parser
from megatron.config.errors import ConfigError, flag_name
from megatron.config.layout_validation import (
    check_gradient_sync,
    check_pipeline_parallel,
    check_tensor_parallel,
    resolve_parallelism,
)
from megatron.config.lr_schedule_validation import resolve_lr_schedule
from megatron.config.megatron_core_switches import check_megatron_core_switches
from megatron.config.optimizer_memory import check_optimizer_memory
from megatron.data.dataset_splits import parse_data_path, split_note
from megatron.kernels.dispatch import kernel_mode_from_environment
from megatron.tokenizer.flags import TokenizerFlags

__all__ = ["ConfigError", "parse_arguments", "resolve_arguments", "resolve_arguments_with_notes"]


def parse_arguments(
    argv: Optional[Sequence[str]] = None, extra_groups: Sequence[ArgumentGroupAdder] = ()
) -> argparse.Namespace:
    """Parse `argv` (default: sys.argv[1:]) with Megatron's flags plus `extra_groups`.

    Unknown flags and malformed values raise `ConfigError` instead of exiting.
    """
    parser = build_parser(extra_groups, exit_on_error=False)
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        if error.argument_name is None:  # an argument file's error, which says what to do
            raise ConfigError(str(error)) from None
        raise ConfigError(f"{error}; run with --help for the accepted flags") from None
    if unknown:
        raise ConfigError(
            f"unrecognized arguments: {' '.join(unknown)}; check the spelling "
            "(flags are never abbreviated) or run with --help"
        )
    return namespace


def resolve_arguments(namespace: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A validated copy of `namespace` with Megatron's derived values filled in.

    Adds `world_size` and `data_parallel_size` and fills `global_batch_size`,
    `ffn_hidden_size`, `lr_decay_iters`/`lr_decay_samples` and the recompute settings as
    Megatron's validate_args does; this is what `format_arguments_block` should print.
    """
    return resolve_arguments_with_notes(namespace, world_size)[0]


def resolve_arguments_with_notes(
    namespace: argparse.Namespace, world_size: int
) -> Tuple[argparse.Namespace, List[str]]:
    """`resolve_arguments`, plus the informational notes Megatron would print on rank 0."""
    args = argparse.Namespace(**vars(namespace))
    notes: List[str] = []
    _check_required_and_ranges(args, world_size)
    resolve_parallelism(args, world_size)
    _resolve_batch_size(args, notes)
    _resolve_precision(args, notes)
    check_optimizer_memory(args)
    _resolve_kernels(args)
    resolve_lr_schedule(args)
    _resolve_model_shape(args, notes)
    check_megatron_core_switches(args, notes)
    check_tensor_parallel(args, notes)
    check_pipeline_parallel(args)
    check_gradient_sync(args, notes)
    _resolve_recompute(args, notes)
    _check_data(args, notes)
    _check_checkpointing(args, notes)
    _check_profiling(args)
    _resolve_memory_history(args)
    _check_wandb(args)
    return args, notes


_flag = flag_name


def _check_required_and_ranges(args: argparse.Namespace, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    required = ["num_layers", "hidden_size", "num_attention_heads", "seq_length"]
    required += ["micro_batch_size", "lr"]
    missing = [_flag(name) for name in required if getattr(args, name) is None]
    if missing:
        raise ConfigError(f"missing required flags: {', '.join(missing)}")

    positive = ["num_layers", "hidden_size", "num_attention_heads", "seq_length"]
    positive += ["micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size"]
    positive += ["make_vocab_size_divisible_by", "log_interval", "eval_interval", "hysteresis"]
    positive += ["tensorboard_log_interval", "loss_scale_window", "initial_loss_scale"]
    positive += ["min_loss_scale", "adam_eps", "layernorm_epsilon"]
    optional_positive = ["ffn_hidden_size", "max_position_embeddings", "global_batch_size"]
    optional_positive += ["train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples"]
    optional_positive += ["save_interval", "exit_interval", "exit_duration_in_mins", "loss_scale"]
    optional_positive += ["keep_latest_checkpoints", "ddp_bucket_size"]
    if args.group_query_attention:
        positive.append("num_query_groups")
    for name in positive + [n for n in optional_positive if getattr(args, n) is not None]:
        if getattr(args, name) <= 0:
            raise ConfigError(f"{_flag(name)} must be > 0, got {getattr(args, name)}")

    non_negative = ["lr", "min_lr", "weight_decay", "clip_grad", "init_method_std"]
    non_negative += ["num_workers", "eval_iters", "lr_warmup_iters", "lr_warmup_samples"]
    for name in non_negative:
        if getattr(args, name) < 0:
            raise ConfigError(f"{_flag(name)} must be >= 0, got {getattr(args, name)}")

    for name in ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction < 1.0:
        raise ConfigError(
            f"--lr-warmup-fraction must be in [0, 1) (a fraction of the decay steps), "
            f"got {args.lr_warmup_fraction}"
        )
    if args.rampup_batch_size is not None:
        raise ConfigError(
            f"--rampup-batch-size {' '.join(args.rampup_batch_size)} is not supported; "
            "train with a constant --global-batch-size"
        )


def _resolve_batch_size(args: argparse.Namespace, notes: List[str]) -> None:
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
        notes.append(f"setting global batch size to {per_step}")
    if args.global_batch_size % per_step != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size} (= {per_step}); change one of them"
        )


def _resolve_precision(args: argparse.Namespace, notes: List[str]) -> None:
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 were both given; choose one")
    if getattr(args, "fp8_format", None) is not None and not args.bf16:
        raise ConfigError(
            f"--fp8-format {args.fp8_format} multiplies the projections in FP8 inside bf16 "
            "training: add --bf16"
        )
    if args.DDP_impl is not None:
        # Read by nothing else: the data-parallel mode decides (megatron.parallelize).
        notes.append(
            f"--DDP-impl {args.DDP_impl}: the gradients are reduced by the data-parallel mode here "
            "(torch DDP, or --use-distributed-optimizer's or --use-torch-fsdp2's "
            "reduce-scatter); no effect"
        )
    if args.DDP_impl == "torch" and args.accumulate_allreduce_grads_in_fp32:
        raise ConfigError(
            "--accumulate-allreduce-grads-in-fp32 needs --DDP-impl local (torch DDP reduces "
            "gradients in the parameter dtype); drop one of them"
        )
    if args.main_grads_dtype != "fp32" and args.accumulate_allreduce_grads_in_fp32:
        raise ConfigError(
            f"--main-grads-dtype {args.main_grads_dtype} and --accumulate-allreduce-grads-in-fp32 "
            "contradict each other; drop one of them"
        )
    if args.main_grads_dtype != "fp32":
        return
    if args.bf16 and args.DDP_impl != "torch" and not args.accumulate_allreduce_grads_in_fp32:
        # bf16 gradients lose too much precision when summed over micro-batches and ranks.
        args.accumulate_allreduce_grads_in_fp32 = True
        notes.append("accumulate and all-reduce gradients in fp32 for bfloat16 data type.")


def _resolve_kernels(args: argparse.Namespace) -> None:
    """The kernel mode (megatron.kernels.dispatch) from MEGATRON_KERNELS, read here once."""
    try:
        args.kernels = kernel_mode_from_environment()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _resolve_model_shape(args: argparse.Namespace, notes: List[str]) -> None:
    hidden, heads = args.hidden_size, args.num_attention_heads
    if hidden % heads != 0:
        raise ConfigError(
            f"--num-attention-heads {heads} does not divide --hidden-size {hidden}; "
            "each head needs hidden-size / heads channels"
        )
    if args.group_query_attention and heads % args.num_query_groups != 0:
        raise ConfigError(
            f"--num-query-groups {args.num_query_groups} does not divide "
            f"--num-attention-heads {heads}; every group must hold the same number of heads"
        )
    if args.ffn_hidden_size is None:
        # SwiGLU has two input projections; 2/3 of 4h keeps the MLP's parameter count.
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden
        if ffn <= 0:
            raise ConfigError(
                f"--swiglu with --hidden-size {hidden} gives an empty default --ffn-hidden-size "
                "(2/3 of 4*hidden rounded down to a multiple of 64); set --ffn-hidden-size"
            )
        args.ffn_hidden_size = ffn
    if args.position_embedding_type == "learned_absolute":
        if args.max_position_embeddings is None:
            raise ConfigError(
                "--max-position-embeddings is required with --position-embedding-type "
                "learned_absolute (it sizes the position table); e.g. "
                f"--max-position-embeddings {args.seq_length}"
            )
        if args.seq_length > args.max_position_embeddings:
            raise ConfigError(
                f"--seq-length {args.seq_length} is larger than --max-position-embeddings "
                f"{args.max_position_embeddings}; learned positions cannot index past the table"
            )
    else:
        if args.max_position_embeddings is None:
            args.max_position_embeddings = args.seq_length
            notes.append(f"setting max position embeddings to --seq-length {args.seq_length}")
        rotary_dim = int(hidden // heads * args.rotary_percent)
        if rotary_dim == 0 or rotary_dim % 2 != 0:
            raise ConfigError(
                f"--rotary-percent {args.rotary_percent} of {hidden // heads} channels per head "
                f"(--hidden-size {hidden} / --num-attention-heads {heads}) gives {rotary_dim} "
                "rotary channels; rotary embeddings need a positive even number"
            )


def _resolve_recompute(args: argparse.Namespace, notes: List[str]) -> None:
    if getattr(args, "checkpoint_activations", False):
        if args.recompute_granularity not in (None, "full"):
            raise ConfigError(
                "--checkpoint-activations means --recompute-granularity full, but "
                f"--recompute-granularity {args.recompute_granularity} was given; drop one"
            )
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        notes.append(
            "--checkpoint-activations is deprecated; using --recompute-granularity full "
            f"--recompute-method {args.recompute_method}"
        )
    if hasattr(args, "checkpoint_activations"):
        del args.checkpoint_activations  # Megatron drops the deprecated alias once applied.

    granularity, method = args.recompute_granularity, args.recompute_method
    if method is not None and granularity != "full":
        raise ConfigError(
            f"--recompute-method {method} needs --recompute-granularity full "
            f"({'it was not given' if granularity is None else f'got {granularity}'}); "
            "selective recompute takes no method"
        )
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
    if granularity == "full":
        layers = args.recompute_num_layers
        if layers < 1:
            raise ConfigError(f"--recompute-num-layers must be >= 1, got {layers}")
        if method == "block" and layers > args.num_layers:
            raise ConfigError(
                f"--recompute-num-layers {layers} is larger than --num-layers "
                f"{args.num_layers} with --recompute-method block"
            )


def _check_data(args: argparse.Namespace, notes: List[str]) -> None:
    per_split = {name: getattr(args, f"{name}_data_path") for name in ("train", "valid", "test")}
    given_per_split = {name: paths for name, paths in per_split.items() if paths is not None}
    if args.mock_data:
        _check_mock_data(args, given_per_split)
    elif args.data_path is None and not given_per_split:
        raise ConfigError(
            "no training data: give --data-path (divided by --split), or "
            "--train-data-path/--valid-data-path/--test-data-path"
        )
    if args.data_path is not None and given_per_split:
        others = ", ".join(f"--{name}-data-path" for name in given_per_split)
        raise ConfigError(f"--data-path and {others} were both given; use one data source")
    sources = {"data": args.data_path} if args.data_path is not None else given_per_split
    for name, paths in sources.items():
        flag = f"--{name}-path" if name == "data" else f"--{name}-data-path"
        try:
            prefixes = parse_data_path(paths, flag).prefixes
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for prefix in prefixes:
            # The dataset is PREFIX.bin + PREFIX.idx; a file name gets the prefix to give.
            suffix = os.path.splitext(prefix)[1]
            if suffix in (".bin", ".idx") and not os.path.isfile(prefix + ".idx"):
                raise ConfigError(
                    f"{flag} {prefix}: give the dataset prefix without {suffix}, "
                    f"i.e. {flag} {prefix[: -len(suffix)]}"
                )
    if args.data_path is not None:
        try:
            note = split_note(args.split)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if note is not None:
            notes.append(note)
    if args.data_impl in ("lazy", "cached"):
        raise ConfigError(
            f"--data-impl {args.data_impl} is not supported; only mmap datasets are read "
            "(use --data-impl mmap or infer, and tools/preprocess_data.py to convert)"
        )

    try:
        TokenizerFlags.from_args(args).check()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.vocab_size is not None and args.tokenizer_type not in ("TikTokenizer", "NullTokenizer"):
        # Megatron-Core reads --vocab-size for these two types only, and so does this project.
        notes.append(
            f"--vocab-size {args.vocab_size} is not read by {args.tokenizer_type}: its "
            "vocabulary is its files' (only TikTokenizer and NullTokenizer read --vocab-size)"
        )


def _check_mock_data(args: argparse.Namespace, given_per_split: dict) -> None:
    # Megatron-Core also takes a single data source: mock data, --data-path or the per-split paths.
    given = (["--data-path"] if args.data_path is not None else []) + [
        f"--{name}-data-path" for name in given_per_split
    ]
    if given:
        raise ConfigError(
            f"--mock-data and {', '.join(given)} were both given: --mock-data trains on "
            "synthetic tokens instead of a dataset; drop one of them"
        )


def _check_checkpointing(args: argparse.Namespace, notes: List[str]) -> None:
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "--override-opt_param-scheduler (this run's schedule) and "
            "--use-checkpoint-opt_param-scheduler (the checkpoint's) contradict each other; "
            "give at most one"
        )
    if args.save is not None and args.save_interval is None:
        raise ConfigError(f"--save {args.save} needs --save-interval (iterations between saves)")
    if args.save_interval is not None and args.save is None:
        raise ConfigError(
            f"--save-interval {args.save_interval} was given without --save; "
            "add --save DIR or drop --save-interval"
        )
    if args.load is not None and not os.path.isdir(args.load):
        notes.append(f"--load {args.load} does not exist; training starts from scratch")
    if args.finetune and args.load is None:
        notes.append("--finetune without --load: there is no checkpoint to start from")
    if args.async_save and not args.save:
        raise ConfigError(
            "--async-save was given without --save, so nothing would be saved; add --save DIR "
            "--save-interval N or drop --async-save"
        )
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ConfigError(
            f"--async-save writes torch_dist checkpoints, not --ckpt-format {args.ckpt_format}; "
            "drop --async-save or use --ckpt-format torch_dist"
        )


def _check_profiling(args: argparse.Namespace) -> None:
    if args.use_pytorch_profiler and not args.profile:
        raise ConfigError("--use-pytorch-profiler only takes effect with --profile; add --profile")
    if not args.profile:
        return
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0 or end <= start:
        raise ConfigError(
            f"--profile-step-start {start} and --profile-step-end {end} must satisfy "
            "0 <= start < end (iterations completed when profiling starts and stops)"
        )
    outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
    if outside:
        raise ConfigError(
            f"--profile-ranks {' '.join(map(str, outside))}: no such rank in a world of "
            f"{args.world_size} (ranks 0..{args.world_size - 1})"
        )
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        raise ConfigError(
            "--profile without --use-pytorch-profiler drives CUDA's profiler (for nsys) and "
            "needs a GPU; none is visible: add --use-pytorch-profiler"
        )
    if args.use_pytorch_profiler and args.tensorboard_dir is None:
        raise ConfigError(
            "--use-pytorch-profiler writes its trace to --tensorboard-dir; set --tensorboard-dir DIR"
        )


# Megatron-Core's default for --memory-snapshot-path: the working directory.
DEFAULT_MEMORY_SNAPSHOT_PATH = "snapshot.pickle"


def _resolve_memory_history(args: argparse.Namespace) -> None:
    if not args.record_memory_history:
        if args.memory_snapshot_path is not None:
            raise ConfigError(
                f"--memory-snapshot-path {args.memory_snapshot_path} only takes effect with "
                "--record-memory-history; add --record-memory-history"
            )
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "--record-memory-history records the CUDA caching allocator and needs a GPU; none "
            "is visible: drop --record-memory-history"
        )
    if args.memory_snapshot_path is None:
        args.memory_snapshot_path = DEFAULT_MEMORY_SNAPSHOT_PATH


def _check_wandb(args: argparse.Namespace) -> None:
    # Here, before any work, rather than when rank 0 opens the run after the model is built;
    # find_spec looks for the package without importing it on every rank.
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--wandb-project {args.wandb_project} logs to Weights & Biases, whose wandb package "
            "is not installed; install it (pip install -e '.[wandb]' in this repository, or "
            "pip install wandb) or drop --wandb-project"
        )
