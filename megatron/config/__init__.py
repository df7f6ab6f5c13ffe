"""Typed run configuration built from Megatron-LM-compatible command-line flags.

    config = parse_config(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", 1)))

Packages with flags of their own (e.g. MoE) add their group to the parser (`extra_groups`) and
an extension builder to `Config.from_args(namespace, world_size, padded_vocab_size,
extensions=[...])`, which builds their config with the rest, once; the run then finds it with
`config.extension(MoEConfig)`. A run does both through megatron.composition.run.RunComposition.
Every section is frozen.
"""

from megatron.arguments import build_parser, format_arguments_block
from megatron.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    parse_config,
)
from megatron.config.validation import ConfigError, parse_arguments, resolve_arguments

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainingConfig",
    "build_parser",
    "format_arguments_block",
    "parse_arguments",
    "parse_config",
    "resolve_arguments",
]
