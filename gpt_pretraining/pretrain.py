"""pretrain_gpt.py's run: flags to Config (gpt_pretraining.GPT_RUN), distributed set-up, the
memory plan, the model built on the meta device and parallelized, the datasets, then
megatron.training.loop.pretrain; errors a user can fix end in one line and a non-zero exit.

The same run without the checkout, once the package is installed:

    torchrun --nproc_per_node 8 -m gpt_pretraining.pretrain --num-layers 12 ...
    megatron-dmoe-pretrain --num-layers 12 ...    # one process, or under torchrun's --no-python
"""

from __future__ import annotations

import sys
from typing import List, Optional

import torch

from gpt_pretraining import GPT_RUN
from megatron.checkpointing.directories import (
    check_checkpoint_directories,
    estimate_checkpoint_bytes,
)
from megatron.checkpointing.layout import resume_advice
from megatron.composition.datasets import build_datasets
from megatron.config import Config, ConfigError, format_arguments_block
from megatron.console import print_line
from megatron.errors import UserError, traceback_asked
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
from megatron.parallel.parallel_state import destroy_model_parallel
from megatron.parallel.progress_board import is_collective_timeout
from megatron.parallelize.steps import parallelize
from megatron.tokenizer import MegatronTokenizer
from megatron.training.loop import TrainingResult, pretrain, total_train_iters
from megatron.training.memory_history import start_memory_history


def main(argv: Optional[List[str]] = None) -> TrainingResult:
    """Parse flags, set up, and train; bad flags raise SystemExit(2) with one message, before any work."""
    world_size = world_size_from_environment()
    try:
        # The padded vocabulary is part of the model's shape, so the tokenizer comes before the
        # config; its log lines wait until after the arguments block, where Megatron prints them.
        tokenizer_lines: List[str] = []
        config, tokenizer = GPT_RUN.config_from_argv(argv, world_size, tokenizer_lines.append)
        tokenizer_lines.insert(0, f"> building {config.arguments['tokenizer_type']} tokenizer ...")
    except ConfigError as error:
        print_line(f"error: {error}", sys.stderr)
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
            if traceback_asked():
                raise
            print_line(f"error: {error}", sys.stderr)
            raise SystemExit(1) from None
        except RuntimeError as error:
            if context.progress is None or not is_collective_timeout(error) or traceback_asked():
                raise
            try:
                explained = context.progress.explain_timeout(error)
            except Exception:  # the store is gone too: torch's own error says what it can
                raise error from None
            advice = resume_advice(config.checkpoint.save)
            print_line(f"error: {explained}; {advice}", sys.stderr)
            raise SystemExit(1) from None
        finally:
            # Later runs in this process (tests) start from fresh groups.
            destroy_model_parallel()


def _setup_and_train(
    config: Config,
    tokenizer: MegatronTokenizer,
    tokenizer_lines: List[str],
    context: DistributedContext,
) -> TrainingResult:
    print_rank_0(
        f"using world size: {context.world_size}, data-parallel size: "
        f"{config.parallel.data_parallel_size}, tensor-model-parallel size: "
        f"{config.parallel.tensor_model_parallel_size}, pipeline-model-parallel size: "
        f"{config.parallel.pipeline_model_parallel_size}, "
        f"expert-model-parallel size: {config.parallel.expert_model_parallel_size}"
    )
    print_rank_0(format_arguments_block(config.arguments))
    for note in GPT_RUN.notes(config):
        print_rank_0(f"note: {note}")
    for line in tokenizer_lines:
        print_rank_0(line)
    # Before any compile or data work: a run that will not fit says so, and what would.
    if context.is_first:
        for line in memory_plan_lines(
            config, GPT_RUN.mlp_spec, device_memory_bytes(context.device)
        ):
            print_line(line)
    print_rank_0(f"> setting random seeds to {config.training.seed} ...")
    set_random_seed(config.training.seed)

    start_memory_history(config.logging)  # where Megatron-Core starts it: before the model
    print_rank_0("building GPT model ...")
    with torch.device("meta"):  # no memory yet: parallelize keeps this rank's shards only
        whole_model = GPT_RUN.model(config)
    hooks = GPT_RUN.training_hooks(config)
    model = parallelize(whole_model, config, context, hooks.compile_choice)
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

    datasets = build_datasets(config, tokenizer)
    barrier()
    return pretrain(
        config,
        context,
        model,
        datasets,
        GPT_RUN.forward_step(config, model.unwrapped, tokenizer.eod),
        model_arguments=GPT_RUN.model_arguments,
        hooks=hooks,
        flops_per_iteration=GPT_RUN.flops_per_iteration(config),
    )


def command_line() -> None:
    """`python -m gpt_pretraining.pretrain` and the megatron-dmoe-pretrain console script: main on
    sys.argv. Its result is dropped: a console script exits with what its function returns, and a
    finished run exits 0."""
    main()


if __name__ == "__main__":
    command_line()
