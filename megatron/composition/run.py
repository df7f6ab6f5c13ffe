"""A GPT run composed once: from flags (or a checkpoint's saved arguments) to the Config, the
tokenizer's padded vocabulary, the MLP of the model's layers, the model, the work around the
steps, the forward step and the saved model arguments, with the extensions it is given
(megatron.composition.extension). Training, the tools and the benches all build what they need
through one RunComposition (gpt_pretraining.GPT_RUN), so they cannot disagree.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, List, Optional, Sequence, Tuple

from torch import nn

from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS
from megatron.composition.extension import RunExtension
from megatron.composition.forward_step import make_forward_step
from megatron.config import Config, ConfigError, parse_arguments
from megatron.config.validation import resolve_arguments_with_notes
from megatron.model import DENSE_MLP, GPTModel, MlpSpec, num_floating_point_operations
from megatron.tokenizer import (
    MegatronTokenizer,
    TokenizerFlags,
    build_tokenizer_from_flags,
    vocab_size_with_padding,
)
from megatron.training.hooks import TrainingHooks
from megatron.training.trainer import ForwardStep

# Megatron flags this project parses but does not implement yet.
_NOT_SUPPORTED = (
    ("--reset-position-ids", "reset_position_ids"),
    ("--reset-attention-mask", "reset_attention_mask"),
)


def tokenizer_and_padded_vocab(
    args: argparse.Namespace, log: Optional[Callable[[str], None]] = None
) -> Tuple[MegatronTokenizer, int]:
    """The tokenizer that resolved flags name, and its vocabulary padded as Megatron pads it (a
    multiple of --make-vocab-size-divisible-by times the tensor-parallel size): part of the
    model's shape. ConfigError, one line naming the flag, when a file is missing or unreadable."""
    try:
        tokenizer = build_tokenizer_from_flags(TokenizerFlags.from_args(args))
    except (OSError, ValueError) as error:
        raise ConfigError(str(error)) from None
    padded = vocab_size_with_padding(
        tokenizer.vocab_size,
        args.make_vocab_size_divisible_by,
        args.tensor_model_parallel_size,
        log=log,
    )
    return tokenizer, padded


class RunComposition:
    """Builds a run's parts from megatron and `extensions`; an extension's builders run only
    when the run's flags asked for it (its config section is present)."""

    def __init__(self, extensions: Sequence[RunExtension] = ()) -> None:
        self.extensions = tuple(extensions)
        self.model_arguments: Tuple[str, ...] = MODEL_ARGUMENTS + tuple(
            name for extension in self.extensions for name in extension.model_arguments
        )
        self.kernel_arguments: Tuple[str, ...] = tuple(
            name for extension in self.extensions for name in extension.kernel_arguments
        )

    # ------------------------------------------------------------------ config
    def parse_arguments(self, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
        """Megatron's flags and every extension's (ConfigError, or SystemExit from argparse)."""
        return parse_arguments(
            argv, extra_groups=[extension.add_arguments for extension in self.extensions]
        )

    def resolve(
        self, argv: Optional[Sequence[str]], world_size: int
    ) -> Tuple[argparse.Namespace, List[str]]:
        """The flags parsed, checked and resolved for `world_size` ranks, and the notes to print;
        ConfigError names what is wrong."""
        return self.resolve_parsed(self.parse_arguments(argv), world_size)

    def resolve_parsed(
        self, parsed: argparse.Namespace, world_size: int
    ) -> Tuple[argparse.Namespace, List[str]]:
        """`resolve` of flags already parsed (`parse_arguments`), left untouched."""
        args, notes = resolve_arguments_with_notes(parsed, world_size)
        unsupported = [flag for flag, name in _NOT_SUPPORTED if getattr(args, name, False)]
        if unsupported:
            raise ConfigError(f"{', '.join(unsupported)} are not supported yet")
        return args, notes + self.resolve_extension_arguments(args)

    def resolve_extension_arguments(self, args: argparse.Namespace) -> List[str]:
        """Every extension's settings that `args` leaves unset filled in, in place (each
        extension's `resolve_arguments`); the notes they print. A tool that writes arguments
        it parsed itself (an upcycled checkpoint's) calls this before saving them."""
        notes: List[str] = []
        for extension in self.extensions:
            if extension.resolve_arguments is not None:
                notes += extension.resolve_arguments(args)
        return notes

    def config(
        self, args: argparse.Namespace, notes: Sequence[str], padded_vocab_size: int
    ) -> Config:
        """The frozen Config of resolved flags, with every extension's section."""
        builders = [extension.build_config for extension in self.extensions]
        return Config.from_resolved(args, notes, padded_vocab_size, extensions=builders)

    def config_from_argv(
        self,
        argv: Optional[Sequence[str]],
        world_size: int,
        tokenizer_log: Optional[Callable[[str], None]] = None,
    ) -> Tuple[Config, MegatronTokenizer]:
        """What pretrain_gpt.py builds from its flags before any distributed work: the Config
        (its padded vocabulary from the tokenizer) and the tokenizer. `tokenizer_log` receives
        the padding line."""
        args, notes = self.resolve(argv, world_size)
        tokenizer, padded = tokenizer_and_padded_vocab(args, tokenizer_log)
        return self.config(args, notes, padded), tokenizer

    def config_from_saved(self, args: argparse.Namespace) -> Config:
        """The Config of a checkpoint's saved arguments (resolved when saved, with the padded
        vocabulary size). A flag added since the checkpoint was saved has no attribute there:
        it takes its default, as the run that saved it behaved; so do the extensions'
        `kernel_arguments`, chosen again for the device that reads it. The extensions resolve
        the rest as a run does (`resolve_extension_arguments`; their notes are not kept)."""
        defaults = vars(self.parse_arguments([]))
        saved = {k: v for k, v in vars(args).items() if k not in self.kernel_arguments}
        args = argparse.Namespace(**{**defaults, **saved})
        self.resolve_extension_arguments(args)
        return self.config(args, [], args.padded_vocab_size)

    def notes(self, config: Config) -> List[str]:
        """The config's notes, then each present extension's."""
        return [
            *config.notes,
            *(n for ext, section in self._present(config) for n in ext.notes(section)),
        ]

    # ------------------------------------------------------------------ model
    def mlp_spec(self, config: Config) -> MlpSpec:
        """The MLP of the model's layers: the first present extension's, else the dense MLP."""
        for extension, section in self._present(config):
            return extension.mlp_spec(section, config)
        return DENSE_MLP

    def model(self, config: Config) -> GPTModel:
        """The whole GPTModel of `config`, on the current default device (meta for a run that
        parallelizes it)."""
        return GPTModel(config.model, self.mlp_spec(config))

    def flops_per_iteration(self, config: Config) -> int:
        """Model FLOPs of one global batch, for the log line's TFLOP/s."""
        return num_floating_point_operations(
            config.model,
            config.training.global_batch_size,
            config.data.seq_length,
            self.mlp_spec(config),
        )

    # ------------------------------------------------------------------ training
    def training_hooks(self, config: Config) -> TrainingHooks:
        """The work around the steps: the first present extension's, else none."""
        for extension, section in self._present(config):
            return extension.training_hooks(section, config)
        return TrainingHooks()

    def forward_step(self, config: Config, model: nn.Module, eod_token: int) -> ForwardStep:
        """Megatron's forward step with every present extension's loss terms for `model` (this
        rank's chunks under a pipeline)."""
        extras = [
            extension.auxiliary_losses(section, config, model)
            for extension, section in self._present(config)
        ]

        def auxiliary_losses(chunk: nn.Module):
            terms = {}
            for losses in extras:
                terms.update(losses(chunk))
            return terms

        return make_forward_step(
            eod_token, config.data.eod_mask_loss, auxiliary_losses if extras else None
        )

    def _present(self, config: Config) -> List[Tuple[RunExtension, Any]]:
        found = [
            (extension, config.extension(extension.config_type)) for extension in self.extensions
        ]
        return [(extension, section) for extension, section in found if section is not None]
