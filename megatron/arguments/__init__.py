"""The command-line surface: Megatron-LM's flag names, meanings and defaults, and nothing else.

Validation, derived defaults and the typed config live in `megatron.config`. Another module
(e.g. the MoE layers) adds its own flags by passing a callable to `build_parser(extra_groups=...)`
that receives the parser and calls `parser.add_argument_group(...)` on it. `@FILE` stands for the
flags written in FILE (megatron.arguments.argument_files).
"""

from __future__ import annotations

import argparse
from typing import Callable, Mapping, Sequence, Union

from megatron.arguments.argument_files import ArgumentFileParser
from megatron.arguments.distributed import add_distributed_args
from megatron.arguments.megatron_core import add_megatron_core_model_args
from megatron.arguments.model import (
    add_initialization_args,
    add_mixed_precision_args,
    add_network_size_args,
    add_regularization_args,
)
from megatron.arguments.optimizer import add_optimizer_memory_args
from megatron.arguments.run import (
    add_checkpointing_args,
    add_data_args,
    add_learning_rate_args,
    add_logging_args,
    add_training_args,
    add_validation_args,
)
from megatron.arguments.tokenizer import add_tokenizer_args

ArgumentGroupAdder = Callable[[argparse.ArgumentParser], object]


def build_parser(
    extra_groups: Sequence[ArgumentGroupAdder] = (), exit_on_error: bool = True
) -> argparse.ArgumentParser:
    """Build the argument parser with Megatron-LM's flags plus each of `extra_groups`.

    Every callable in `extra_groups` is called with the parser and registers its own argument
    group. With `exit_on_error=False`, bad values raise `argparse.ArgumentError` instead of
    exiting, so `megatron.config.parse_arguments` can report them as a `ConfigError`; so does an
    `@FILE` that cannot be read.
    """
    parser = ArgumentFileParser(
        description="Megatron-LM-style GPT pretraining arguments",
        allow_abbrev=False,
        exit_on_error=exit_on_error,
    )
    for add_group in (
        add_network_size_args,
        add_regularization_args,
        add_training_args,
        add_optimizer_memory_args,
        add_initialization_args,
        add_learning_rate_args,
        add_checkpointing_args,
        add_mixed_precision_args,
        add_distributed_args,
        add_validation_args,
        add_data_args,
        add_tokenizer_args,
        add_logging_args,
        add_megatron_core_model_args,
        *extra_groups,
    ):
        add_group(parser)
    return parser


def format_arguments_block(
    arguments: Union[argparse.Namespace, Mapping[str, object]], title: str = "arguments"
) -> str:
    """Render arguments as Megatron prints them at startup: a titled block, one sorted line each.

    Each line is two spaces, the name, a space, `48 - len(name)` dots, a space and the value;
    lines are sorted case-insensitively, as Megatron sorts them.
    """
    values = vars(arguments) if isinstance(arguments, argparse.Namespace) else dict(arguments)
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in values.items()]
    lines.sort(key=str.lower)
    header = f"------------------------ {title} ------------------------"
    footer = f"-------------------- end of {title} ---------------------"
    return "\n".join([header, *lines, footer])
