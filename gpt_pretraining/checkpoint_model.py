"""A checkpoint of this project, whatever its parallel layout and format, as the model of one
process: what export, generation and evaluation start from.

Both formats hold single-process tensors (a `torch` file is gathered when saved, a `torch_dist`
directory is read whole here), so the layout the run used does not matter. Checksums are
verified before anything is read.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch

from gpt_pretraining import GPT_RUN
from gpt_pretraining.checkpoint_format import model_order
from megatron.checkpointing.convert import read_sharded_model_state
from megatron.checkpointing.layout import (
    CheckpointError,
    Iteration,
    iteration_directory_name,
    read_tracker,
)
from megatron.checkpointing.load import read_torch_checkpoint
from megatron.checkpointing.sharded_load import verify_sharded_checkpoint
from megatron.checkpointing.torch_dist import is_sharded_checkpoint, read_common
from megatron.config import Config
from megatron.errors import UserError
from megatron.model import GPTModel
from megatron.tokenizer import (
    TOKENIZER_TYPES,
    MegatronTokenizer,
    TokenizerFlags,
    build_tokenizer_from_flags,
)
from moe.config import MoEConfig


@dataclass
class CheckpointModel:
    """A checkpoint's model: its saved arguments, the config they build, the single-process
    state dict (padded vocabulary included) and where it came from."""

    args: argparse.Namespace
    config: Config
    state_dict: Dict[str, torch.Tensor]
    iteration: Iteration
    directory: str

    @property
    def moe(self) -> Optional[MoEConfig]:
        """The dMoE/MoE config, None for a dense model."""
        return self.config.extension(MoEConfig)

    def build_model(
        self, device: Union[str, torch.device] = "cpu", dtype: torch.dtype = torch.float32
    ) -> GPTModel:
        """The model with the checkpoint's weights, in eval mode, on `device` in `dtype`.

        Built on the meta device and given storage only where it runs: no weights are drawn
        only to be overwritten, and no full-precision copy is made on the way to `dtype`."""
        with torch.device("meta"):
            model = GPT_RUN.model(self.config)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.load_state_dict(self.state_dict, strict=True)
        # Buffers checkpoints do not hold (the MoE layers' token counters) start at zero.
        for name, buffer in model.named_buffers():
            if name not in self.state_dict:
                buffer.zero_()
        return model.eval()


def read_checkpoint_model(
    load_dir: str,
    iteration: Optional[int] = None,
    print_fn: Callable[[str], None] = print,
    flag: str = "--load-dir",
) -> CheckpointModel:
    """Read the checkpoint the tracker of `load_dir` names (or `iteration`), verified.

    Raises CheckpointError (one line: what is missing and what to do, naming the tool's `flag`)
    for a directory without a checkpoint, a damaged one, or one not saved by pretrain_gpt.py.
    """
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist; check {flag}")
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            raise CheckpointError(
                f"{load_dir} has no latest_checkpointed_iteration.txt: no checkpoint to read "
                f"(point {flag} at the directory pretrain_gpt.py's --save wrote)"
            )
    directory = os.path.join(load_dir, iteration_directory_name(iteration))
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"{directory} does not exist: {load_dir} has no iteration {iteration}"
        )
    if is_sharded_checkpoint(directory):
        verify_sharded_checkpoint(load_dir, iteration, directory, None, print_fn)
        args = read_common(directory).get("args")
        _check_saved_arguments(args, directory)
        model_keys, _ = model_order(args)
        model_state = read_sharded_model_state(directory, model_keys)
    else:
        state = read_torch_checkpoint(load_dir, iteration, print_fn=print_fn)
        args = state.get("args")
        _check_saved_arguments(args, directory)
        model_state = dict(state["model"])
    config = GPT_RUN.config_from_saved(args)
    return CheckpointModel(args, config, model_state, iteration, directory)


# The files each tokenizer type reads, by the saved argument and the flag that replaces it
# (NullTokenizer reads none).
TOKENIZER_FILES = {
    "GPT2BPETokenizer": {"vocab_file": "--vocab-file", "merge_file": "--merge-file"},
    **{
        name: {"tokenizer_model": "--tokenizer-model"}
        for name in TOKENIZER_TYPES
        if name not in ("GPT2BPETokenizer", "NullTokenizer")
    },
}


def checkpoint_tokenizer(
    saved: argparse.Namespace, **overrides: Optional[str]
) -> MegatronTokenizer:
    """The tokenizer the checkpoint's saved arguments name, with any of its files replaced by
    `overrides` (vocab_file, merge_file, tokenizer_model; None keeps the saved one). UserError
    naming the flag when a saved file is not where the training run saw it."""
    tokenizer_type = getattr(saved, "tokenizer_type", None) or "GPT2BPETokenizer"
    files = {}
    for name, flag in TOKENIZER_FILES.get(tokenizer_type, {}).items():
        path = overrides.get(name) or getattr(saved, name, None)
        if path is not None and overrides.get(name) is None and not os.path.exists(path):
            raise UserError(
                f"the checkpoint's {flag} {path} does not exist here (saved as the training "
                f"run named it, maybe relative to another directory); pass {flag} with the file"
            )
        files[name] = path
    try:
        return build_tokenizer_from_flags(TokenizerFlags.from_args(saved, **files))
    except (ValueError, OSError) as error:  # a missing or unreadable file, named by its flag
        raise UserError(str(error)) from None


def _check_saved_arguments(args: Optional[argparse.Namespace], directory: str) -> None:
    if args is None or not hasattr(args, "padded_vocab_size"):
        raise CheckpointError(
            f"{directory} carries no saved arguments with the padded vocabulary size, which "
            "describe its model; it was not saved by pretrain_gpt.py"
        )
