"""Pretrain a GPT model with Megatron-LM's flags.

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 ... \\
        --data-path my-gpt2_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

Builds the config, the tokenizer (for the padded vocabulary), the model and the datasets, and
hands them to `megatron.training.pretrain`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.checkpointing.directories import (
    check_checkpoint_directories,
    estimate_checkpoint_bytes,
)
from megatron.checkpointing.layout import resume_advice
from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS
from megatron.config import (
    Config,
    ConfigError,
    format_arguments_block,
    parse_arguments,
)
from megatron.config.validation import resolve_arguments_with_notes
from megatron.data.dataset_splits import get_train_valid_test_num_samples
from megatron.data.errors import check_datasets_serve_run
from megatron.data.gpt_dataset import SPLIT_NAMES, build_train_valid_test_datasets
from megatron.errors import UserError
from megatron.initialize import (
    DistributedContext,
    barrier,
    deterministic_mode,
    initialize_distributed,
    initialize_model_parallel,
    print_rank_0,
    set_random_seed,
    world_size_from_environment,
)
from megatron.kernels.dispatch import kernel_mode_set
from megatron.memory_plan import device_memory_bytes, memory_plan_lines
from megatron.model import DENSE_MLP, GPTModel, MlpSpec, num_floating_point_operations
from megatron.parallel_state import destroy_model_parallel
from megatron.parallelize import parallelize
from megatron.progress_board import is_collective_timeout
from megatron.tokenizer import MegatronTokenizer, build_tokenizer, vocab_size_with_padding
from megatron.training import TrainingResult, pretrain, total_train_iters
from megatron.training_hooks import TrainingHooks
from moe.arguments import MOE_MODEL_ARGUMENTS, add_moe_args
from moe.auxiliary_losses import MoEAuxiliaryLosses
from moe.config import MoEConfig, moe_config
from moe.mlp_spec import MoEMlpSpec
from moe.training_hooks import MoETrainingHooks


def get_batch(
    batch: Dict[str, torch.Tensor], eod_token: int, eod_mask_loss: bool
) -> Dict[str, torch.Tensor]:
    """Inputs, shifted labels and the loss mask from a batch of `seq_length + 1` tokens."""
    tokens_and_next = batch["text"].long()
    tokens = tokens_and_next[:, :-1].contiguous()
    labels = tokens_and_next[:, 1:].contiguous()
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def make_forward_step(
    eod_token: int,
    eod_mask_loss: bool,
    auxiliary_losses: Optional[Callable[[torch.nn.Module], Dict[str, torch.Tensor]]] = None,
):
    """forward_step(model, batch) -> (loss, {"lm loss": loss, ...}) with Megatron's masked mean.

    `auxiliary_losses(model)` (MoE: `MoEAuxiliaryLosses`) returns the extra loss terms of the
    forward `model` just ran, e.g. {"load balancing loss": ...}; each is added to the loss and
    reported. On a pipeline stage before the last they are that stage's share, returned as its
    reported values, which the schedule adds to the loss (megatron.pipeline.schedules).
    """

    def forward_step(
        model: torch.nn.Module, batch: Dict[str, torch.Tensor]
    ) -> Tuple[torch.Tensor, Dict]:
        inputs = get_batch(batch, eod_token, eod_mask_loss)
        per_token_losses = model(inputs["tokens"], labels=inputs["labels"])
        auxiliary = auxiliary_losses(model) if auxiliary_losses else {}
        if not getattr(model, "post_process", True):
            # A pipeline stage before the last: its hidden states go to the next stage.
            return per_token_losses, auxiliary
        loss_mask = inputs["loss_mask"]
        lm_loss = torch.sum(per_token_losses.float() * loss_mask) / loss_mask.sum()
        reported = {"lm loss": lm_loss.detach()}
        loss = lm_loss
        for name, value in auxiliary.items():
            loss = loss + value
            reported[name] = value.detach()
        return loss, reported

    return forward_step


def build_datasets(config: Config) -> Dict[str, Optional[torch.utils.data.Dataset]]:
    """Train/valid/test GPT datasets with Megatron's sample counts.

    Raises `DatasetError` (a UserError, one line) when they cannot serve the run: no train
    samples, a split without tokens, token ids at or above the padded vocabulary size.
    """
    training, data = config.training, config.data
    num_samples = get_train_valid_test_num_samples(
        global_batch_size=training.global_batch_size,
        eval_interval=training.eval_interval,
        eval_iters=training.eval_iters,
        train_iters=training.train_iters,
        train_samples=training.train_samples,
    )
    print_rank_0("> building train, validation, and test datasets ...")
    datasets = build_train_valid_test_datasets(
        data.data_path,
        data.split,
        num_samples,
        data.seq_length,
        training.seed,
        train_data_path=data.train_data_path,
        valid_data_path=data.valid_data_path,
        test_data_path=data.test_data_path,
        vocab_size=config.model.padded_vocab_size or None,
    )
    for name, dataset, requested in zip(SPLIT_NAMES, datasets, num_samples):
        size = len(dataset) if dataset is not None else 0
        print_rank_0(f"    {name}: {size} samples (requested {requested})")
    check_datasets_serve_run(datasets, data.data_path, data.split, training.global_batch_size)
    return dict(zip(SPLIT_NAMES, datasets))


def main(argv: Optional[List[str]] = None) -> TrainingResult:
    """Parse flags, set up, and train; bad flags raise SystemExit(2) with one message, before any work."""
    world_size = world_size_from_environment()
    try:
        namespace = parse_arguments(argv, extra_groups=[add_moe_args])
        args, notes = resolve_arguments_with_notes(namespace, world_size)
        _refuse_unsupported(args)
        # The padded vocabulary is part of the model's shape, so the tokenizer comes before the
        # config; its log lines wait until after the arguments block, where Megatron prints them.
        tokenizer_lines = [f"> building {args.tokenizer_type} tokenizer ..."]
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
        )
        padded_vocab_size = vocab_size_with_padding(
            tokenizer.vocab_size,
            args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size,
            log=tokenizer_lines.append,
        )
        config = Config.from_resolved(args, notes, padded_vocab_size, extensions=[moe_config])
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    parallel = config.parallel
    tensor_parallel_size = parallel.tensor_model_parallel_size

    with (
        deterministic_mode(config.training.deterministic_mode),
        kernel_mode_set(config.training.kernels),
    ):
        context = initialize_distributed(
            parallel.distributed_backend, parallel.distributed_timeout_minutes
        )
        initialize_model_parallel(
            tensor_parallel_size,
            parallel.expert_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size,
            parallel.distributed_timeout_minutes,
        )
        try:
            return _setup_and_train(config, tokenizer, tokenizer_lines, context)
        except UserError as error:
            # A problem with a checkpoint, a dataset or a directory: the message says what to
            # do, and a traceback would only bury it (MEGATRON_TRACEBACK=1 shows it).
            if _traceback_asked():
                raise
            print(f"error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except RuntimeError as error:
            if context.progress is None or not is_collective_timeout(error) or _traceback_asked():
                raise
            try:
                explained = context.progress.explain_timeout(error)
            except Exception:  # the store is gone too: torch's own error says what it can
                raise error from None
            advice = resume_advice(config.checkpoint.save)
            print(f"error: {explained}; {advice}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        finally:
            # Later runs in this process (tests) start from fresh groups.
            destroy_model_parallel()


def _traceback_asked() -> bool:
    """MEGATRON_TRACEBACK=1: errors the entry point reports in one line raise instead."""
    return os.environ.get("MEGATRON_TRACEBACK", "0") not in ("", "0")


def _refuse_unsupported(args: argparse.Namespace) -> None:
    unsupported = [
        flag
        for flag, value in (
            ("--reset-position-ids", args.reset_position_ids),
            ("--reset-attention-mask", args.reset_attention_mask),
        )
        if value
    ]
    if unsupported:
        raise ConfigError(f"{', '.join(unsupported)} are not supported yet")


def build_mlp_spec(config: Config) -> MlpSpec:
    """The MoE layers' spec when the run has MoE flags, else the dense MLP's."""
    moe = config.extension(MoEConfig)
    if moe is None:
        return DENSE_MLP
    return MoEMlpSpec(moe, config.parallel.expert_model_parallel_size)


def _setup_and_train(
    config: Config,
    tokenizer: MegatronTokenizer,
    tokenizer_lines: List[str],
    context: DistributedContext,
) -> TrainingResult:
    moe = config.extension(MoEConfig)
    print_rank_0(
        f"using world size: {context.world_size}, data-parallel size: "
        f"{config.parallel.data_parallel_size}, tensor-model-parallel size: "
        f"{config.parallel.tensor_model_parallel_size}, pipeline-model-parallel size: "
        f"{config.parallel.pipeline_model_parallel_size}, "
        f"expert-model-parallel size: {config.parallel.expert_model_parallel_size}"
    )
    print_rank_0(format_arguments_block(config.arguments))
    moe_notes = moe.notes() if moe is not None else []
    for note in [*config.notes, *moe_notes]:
        print_rank_0(f"note: {note}")
    for line in tokenizer_lines:
        print_rank_0(line)
    # Before any compile or data work: a run that will not fit says so, and what would.
    if context.is_first:
        for line in memory_plan_lines(config, build_mlp_spec, device_memory_bytes(context.device)):
            print(line, flush=True)
    print_rank_0(f"> setting random seeds to {config.training.seed} ...")
    set_random_seed(config.training.seed)

    print_rank_0("building GPT model ...")
    mlp_spec = build_mlp_spec(config)
    with torch.device("meta"):  # no memory yet: parallelize keeps this rank's shards only
        whole_model = GPTModel(config.model, mlp_spec)
    hooks = TrainingHooks()
    if moe is not None:
        hooks = MoETrainingHooks(
            moe,
            config.training,
            config.model.num_layers,
            tensorboard=bool(config.logging.tensorboard_dir),
        )
    model = parallelize(whole_model, config, context, hooks.compile_veto)
    del whole_model  # under a pipeline this rank's chunks hold their part of it
    check_checkpoint_directories(
        config.checkpoint,
        estimate_checkpoint_bytes(
            model.unwrapped.parameters(),
            config.optimizer.optimizer,
            config.optimizer.sgd_momentum,
            save_optimizer=not config.checkpoint.no_save_optim,
            data_parallel_size=config.parallel.data_parallel_size,
            expert_data_parallel_size=config.parallel.data_parallel_size
            // config.parallel.expert_model_parallel_size,
            device=context.device,
        ),
        final_iteration=total_train_iters(config),
    )

    datasets = build_datasets(config)
    barrier()
    auxiliary_losses = None
    if moe is not None:
        # Averaged over the whole model's MoE layers, whichever of them this rank holds.
        num_moe_layers = moe.num_moe_layers(config.model.num_layers)
        auxiliary_losses = MoEAuxiliaryLosses(model.unwrapped, num_moe_layers)
    forward_step = make_forward_step(tokenizer.eod, config.data.eod_mask_loss, auxiliary_losses)
    return pretrain(
        config,
        context,
        model,
        datasets,
        forward_step,
        model_arguments=MODEL_ARGUMENTS + MOE_MODEL_ARGUMENTS,
        hooks=hooks,
        flops_per_iteration=num_floating_point_operations(
            config.model, config.training.global_batch_size, config.data.seq_length, mlp_spec
        ),
    )


if __name__ == "__main__":
    main()
