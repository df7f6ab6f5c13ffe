"""Typed configuration, one dataclass per concern, built once from validated Megatron flags."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Type, TypeVar

from megatron.arguments import ArgumentGroupAdder
from megatron.config.data_parallel_kind import DataParallelKind
from megatron.config.numerics import Numerics
from megatron.config.validation import (
    parse_arguments,
    resolve_arguments_with_notes,
)

T = TypeVar("T")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of the GPT model; what `megatron.model` is built from."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int = 0  # the tokenizer's vocabulary, padded (megatron.tokenizer)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    num_query_groups: int = 0  # 0 or num_attention_heads: plain multi-head attention
    recompute_granularity: str | None = None  # None | "full" | "selective"
    recompute_method: str | None = None  # None | "uniform" | "block"
    recompute_num_layers: int | None = None
    # --cross-entropy-fusion-impl linear: the output layer and its cross-entropy fused, the
    # logits never stored (megatron.kernels.linear_cross_entropy); Megatron-Core's other values
    # change nothing here.
    linear_cross_entropy_fusion: bool = False
    # Read by megatron.parallelize.steps's tensor-parallel step, not by the model (which is built
    # plain); the model config carries them as Megatron-core's TransformerConfig does.
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False  # only with tensor_model_parallel_size > 1

    @property
    def kv_channels(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout: world size, parallel degrees and the data-parallel implementation."""

    world_size: int
    data_parallel_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Data-parallel ranks each expert layer's experts are split over (megatron.parallel.parallel_state:
    # expert-parallel groups are carved out of data parallelism); 1: every rank holds them all.
    expert_model_parallel_size: int = 1
    # Model chunks per pipeline rank (interleaved 1F1B); None for the plain 1F1B schedule.
    virtual_pipeline_model_parallel_size: int | None = None
    distributed_backend: str = "nccl"
    distributed_timeout_minutes: float = 10.0
    accumulate_allreduce_grads_in_fp32: bool = False
    use_distributed_optimizer: bool = False
    # torch's fully_shard (megatron.parallelize.data_parallel.FullyShard): hybrid sharding
    # over this many replica groups, and bf16 instead of fp32 gradient reduce-scatters.
    use_torch_fsdp2: bool = False
    data_parallel_replicate_degree: int = 1
    grad_reduce_in_bf16: bool = False
    # The distributed optimizer's reduce-scatter, bucket by bucket during the last backward
    # (megatron.optimizer.grad_reduce); torch DDP always overlaps its all-reduce.
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int | None = None  # parameters per bucket; None: Megatron's default
    # Its all-gather after the step left in flight until each layer's forward needs it
    # (megatron.optimizer.param_gather); needs overlap_grad_reduce's buckets.
    overlap_param_gather: bool = False

    @property
    def data_parallel_kind(self) -> DataParallelKind:
        """The data-parallel mode these flags ask for (megatron.config.data_parallel_kind)."""
        return DataParallelKind.of(self.use_torch_fsdp2, self.use_distributed_optimizer)


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, run length, precision, evaluation cadence and exit conditions."""

    micro_batch_size: int
    global_batch_size: int
    num_micro_batches: int  # gradient-accumulation steps per optimizer step
    train_iters: int | None = None
    train_samples: int | None = None
    fp16: bool = False
    bf16: bool = False
    # FP8 products in the attention and MLP projections (megatron.kernels.fp8_linear).
    fp8_format: str | None = None
    fp8_recipe: str = "tensorwise"
    use_flash_attn: bool = False
    torch_compile: bool = True  # on GPUs only; --no-torch-compile turns it off
    # torch's deterministic algorithms (and cuBLAS/NCCL settings) for bit-exact GPU reruns and
    # resumes (megatron.initialize.deterministic_mode).
    deterministic_mode: bool = False
    # bf16/fp16 copies of the expert weights and fused accumulation of their gradients
    # (moe.experts); --no-gradient-accumulation-fusion leaves both to autocast and autograd.
    gradient_accumulation_fusion: bool = True
    # Triton kernels or plain-PyTorch references (megatron.kernels.dispatch): the MEGATRON_KERNELS
    # environment variable, read once when the config is built.
    kernels: str = "auto"
    seed: int = 1234
    eval_iters: int = 100
    eval_interval: int = 1000
    exit_interval: int | None = None
    exit_duration_in_mins: int | None = None
    exit_signal_handler: bool = False
    # A non-finite loss or gradient norm stops the run (megatron.training.trainer); off: trains on.
    check_for_nan_in_loss_and_grad: bool = True


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, learning-rate schedule and fp16 loss scaler.

    The warmup is kept as given: with `lr_warmup_fraction` set, the scheduler computes the
    warmup length as that fraction of `lr_decay_iters` (or `lr_decay_samples`).
    """

    lr: float
    optimizer: str = "adam"
    min_lr: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None
    # WSD's final decay (its length in iterations or samples, like lr_decay_iters/samples).
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    loss_scale: float | None = None  # static fp16 loss scale; None means dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    # On resume: the schedule from this run's flags, or from the checkpoint (at most one).
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    # The optimizer state's dtypes ("fp32", "bf16", "fp16") and host offload (validated in
    # megatron.config.validation; megatron/optimizer/precision.py says what each changes).
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """Dataset paths and split, tokenizer files, sample length and loader workers."""

    seq_length: int
    data_path: Tuple[str, ...] | None = None
    train_data_path: Tuple[str, ...] | None = None
    valid_data_path: Tuple[str, ...] | None = None
    test_data_path: Tuple[str, ...] | None = None
    split: str = "969, 30, 1"
    data_cache_path: str | None = None  # where the index caches go; None: beside the data
    mock_data: bool = False  # synthetic tokens instead of the paths (megatron/data/mock_dataset.py)
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    make_vocab_size_divisible_by: int = 128
    data_impl: str = "infer"
    num_workers: int = 2
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to save, and what to restore when loading."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_format: str = "torch_dist"
    async_save: bool = False
    keep_latest_checkpoints: int | None = None


@dataclass(frozen=True)
class LoggingConfig:
    """Log-line cadence, TensorBoard and Weights & Biases output, and optional diagnostics."""

    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    # Megatron-LM's W&B flags; empty means unset, as there.
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    wandb_entity: str = ""
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    timing_log_level: int = 0
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: Tuple[int, ...] = (0,)
    record_memory_history: bool = False
    memory_snapshot_path: str | None = None  # snapshot.pickle once --record-memory-history

    @property
    def writes_metrics(self) -> bool:
        """Whether rank 0 writes scalars for a dashboard (TensorBoard, W&B or both): what a
        model extension's logging collectives are gathered for, decided alike on every rank."""
        return bool(self.tensorboard_dir or self.wandb_project)


# Builds an extension's config (e.g. moe.config.moe_config) from the resolved flags and the
# config of the rest of the run; None when the run does not use the extension.
ExtensionBuilder = Callable[[argparse.Namespace, "Config"], Optional[Any]]


@dataclass(frozen=True)
class Config:
    """The whole run's configuration, built once from the flags and never changed.

    `notes` are informational lines to print on rank 0. `arguments` are the resolved flags by
    Megatron's attribute names, what the arguments block prints; the `args` a checkpoint saves
    are derived from them (`saved_arguments`). `extensions` hold the configs of packages built
    on megatron (e.g. MoEConfig), found by type with `extension`.
    """

    model: ModelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    parallel: ParallelConfig
    notes: Tuple[str, ...] = ()
    arguments: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    extensions: Tuple[Any, ...] = ()

    @functools.cached_property
    def numerics(self) -> Numerics:
        """Compute, gradient and optimizer-state dtypes, decided from the sections
        (megatron.config.numerics); derived once per Config (the trainer reads it every
        micro-batch), and anew for a changed copy (dataclasses.replace); told by the
        data-parallel mode whether it holds the weights in the compute dtype."""
        numerics = Numerics.of(self.training, self.optimizer)
        return numerics.held_by(self.parallel.data_parallel_kind)

    def extension(self, kind: Type[T]) -> Optional[T]:
        """The extension config of type `kind`, or None when the run has none."""
        found = [value for value in self.extensions if isinstance(value, kind)]
        return found[0] if found else None

    def saved_arguments(self) -> argparse.Namespace:
        """Megatron's `args` as checkpoints save them, a fresh namespace: the resolved flags and
        the padded vocabulary size (a checkpoint whose embedding does not fit is then explained
        by this number)."""
        saved = argparse.Namespace(**copy.deepcopy(dict(self.arguments)))
        if self.model.padded_vocab_size:
            saved.padded_vocab_size = self.model.padded_vocab_size
        return saved

    @classmethod
    def from_args(
        cls,
        namespace: argparse.Namespace,
        world_size: int,
        padded_vocab_size: int = 0,
        extensions: Sequence[ExtensionBuilder] = (),
    ) -> Config:
        """Validate `namespace` (from `parse_arguments`) for `world_size` ranks and build.

        Raises `ConfigError` naming the offending flags; the namespace is not modified.
        """
        args, notes = resolve_arguments_with_notes(namespace, world_size)
        return cls.from_resolved(args, notes, padded_vocab_size, extensions)

    @classmethod
    def from_resolved(
        cls,
        args: argparse.Namespace,
        notes: Sequence[str],
        padded_vocab_size: int = 0,
        extensions: Sequence[ExtensionBuilder] = (),
    ) -> Config:
        """Build from flags `resolve_arguments_with_notes` already resolved, with the padded
        vocabulary size (megatron.tokenizer.vocab_size_with_padding; 0 while unknown) and the
        extension configs `extensions` build."""
        base = cls(
            model=_model_config(args, padded_vocab_size),
            training=TrainingConfig(
                num_micro_batches=args.global_batch_size
                // (args.micro_batch_size * args.data_parallel_size),
                **_pick(args, TrainingConfig, skip=("num_micro_batches",)),
            ),
            optimizer=OptimizerConfig(**_pick(args, OptimizerConfig)),
            data=DataConfig(
                data_path=_as_tuple(args.data_path),
                train_data_path=_as_tuple(args.train_data_path),
                valid_data_path=_as_tuple(args.valid_data_path),
                test_data_path=_as_tuple(args.test_data_path),
                **_pick(args, DataConfig, skip=_PATH_LISTS),
            ),
            checkpoint=CheckpointConfig(
                save=args.save,
                load=args.load,
                save_interval=args.save_interval,
                no_save_optim=bool(args.no_save_optim),
                no_save_rng=bool(args.no_save_rng),
                no_load_optim=bool(args.no_load_optim),
                no_load_rng=bool(args.no_load_rng),
                finetune=args.finetune,
                ckpt_format=args.ckpt_format,
                async_save=args.async_save,
                keep_latest_checkpoints=args.keep_latest_checkpoints,
            ),
            logging=LoggingConfig(
                **_pick(args, LoggingConfig, skip=("profile_ranks",)),
                profile_ranks=tuple(args.profile_ranks),
            ),
            parallel=ParallelConfig(
                # Absent from the arguments of checkpoints saved before expert parallelism was
                # a layout degree of its own.
                expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
                data_parallel_replicate_degree=_replicate_degree(args),
                **_pick(
                    args,
                    ParallelConfig,
                    skip=(
                        "expert_model_parallel_size",
                        "data_parallel_replicate_degree",
                    ),
                ),
            ),
            notes=tuple(notes),
            arguments=MappingProxyType(dict(vars(args))),
        )
        built = tuple(build(args, base) for build in extensions)
        return dataclasses.replace(
            base, extensions=tuple(value for value in built if value is not None)
        )


def parse_config(
    argv: Sequence[str] | None = None,
    world_size: int = 1,
    extra_groups: Sequence[ArgumentGroupAdder] = (),
) -> Config:
    """Parse `argv` (default: sys.argv[1:]), validate for `world_size` ranks and build a Config.

    Flags registered by `extra_groups` are accepted here; read them from `parse_arguments`.
    """
    return Config.from_args(parse_arguments(argv, extra_groups), world_size)


_MODEL_DERIVED = (
    "padded_vocab_size",
    "num_query_groups",
    "recompute_num_layers",
    "linear_cross_entropy_fusion",
)
_PATH_LISTS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def _model_config(args: argparse.Namespace, padded_vocab_size: int) -> ModelConfig:
    full = args.recompute_granularity == "full"
    return ModelConfig(
        padded_vocab_size=padded_vocab_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else 0,
        recompute_num_layers=args.recompute_num_layers if full else None,
        linear_cross_entropy_fusion=getattr(args, "cross_entropy_fusion_impl", None) == "linear",
        **_pick(args, ModelConfig, skip=_MODEL_DERIVED),
    )


def _pick(args: argparse.Namespace, section: type, skip: Sequence[str] = ()) -> dict:
    """The namespace values for `section`'s fields (which share Megatron's attribute names); a
    field with a default that `args` lacks (the arguments saved in a checkpoint from before the
    flag existed) takes the default."""
    picked = {}
    for name, spec in section.__dataclass_fields__.items():
        if name in skip:
            continue
        if hasattr(args, name) or spec.default is dataclasses.MISSING:
            picked[name] = getattr(args, name)
        else:
            picked[name] = spec.default
    return picked


def _as_tuple(paths: Sequence[str] | None) -> Tuple[str, ...] | None:
    return None if paths is None else tuple(paths)


def _replicate_degree(args: argparse.Namespace) -> int:
    """--data-parallel-replicate-degree. Checkpoints saved before it had a name of its own hold
    it as num_distributed_optimizer_instances; a run refuses that attribute above 1
    (megatron.config.layout_validation), so a value above 1 is such a checkpoint's."""
    saved_under_the_old_name = getattr(args, "num_distributed_optimizer_instances", 1)
    if saved_under_the_old_name > 1:
        return saved_under_the_old_name
    return getattr(args, "data_parallel_replicate_degree", 1)
