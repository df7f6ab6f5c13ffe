"""Convert a checkpoint between --ckpt-format torch (one Megatron model_optim_rng.pt) and
torch_dist (sharded, through torch.distributed.checkpoint), tensor for tensor.

The library of tools/convert_checkpoint_format.py (`convert`, and the command line's flags and
entry, `main`), and the order of a saved model's parameters, which both formats name their
tensors by."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

from gpt_pretraining import GPT_RUN
from megatron.checkpointing.convert import (
    model_order_names,
    read_sharded_as_torch_state,
    torch_state_as_sharded,
)
from megatron.checkpointing.layout import (
    CheckpointError,
    iteration_directory_name,
    read_tracker,
)
from megatron.checkpointing.load import read_torch_checkpoint
from megatron.checkpointing.progress import progress_bar, tensor_bytes
from megatron.checkpointing.save import write_torch_checkpoint
from megatron.checkpointing.sharded_load import verify_sharded_checkpoint
from megatron.checkpointing.sharded_save import write_sharded_checkpoint
from megatron.checkpointing.torch_dist import is_sharded_checkpoint, read_common
from megatron.errors import UserError

FORMATS = ("torch", "torch_dist")


def model_order(args: argparse.Namespace) -> tuple:
    """The state-dict keys and the optimizer's parameter names per group of the model the
    saved arguments build (on the meta device: no memory)."""
    config = GPT_RUN.config_from_saved(args)
    with torch.device("meta"):
        model = GPT_RUN.model(config)
    return model_order_names(model, config.optimizer.weight_decay)


def convert(load: str, save: str, ckpt_format: str) -> str:
    """Convert the checkpoint the tracker of `load` names into `ckpt_format` under `save`;
    returns the written iteration's directory."""
    iteration = read_tracker(load)
    if iteration is None:
        raise CheckpointError(f"{load} has no tracker file: there is no checkpoint to convert")
    directory = os.path.join(load, iteration_directory_name(iteration))
    source = "torch_dist" if is_sharded_checkpoint(directory) else "torch"
    if source == ckpt_format:
        raise UserError(f"{directory} is already in the {ckpt_format} format; nothing to convert")
    if os.path.realpath(load) == os.path.realpath(save):
        raise UserError("--save must be another directory than --load")
    if source == "torch":
        state = read_torch_checkpoint(load, iteration, print_fn=print)
    else:
        verify_sharded_checkpoint(load, iteration, directory, None, print)
        state = read_common(directory)
    args = state.get("args")
    if args is None or not hasattr(args, "padded_vocab_size"):
        raise UserError(
            f"{directory} carries no saved arguments with the padded vocabulary size, which "
            "name the model's parameters in order; it was not saved by pretrain_gpt.py"
        )
    model_keys, parameter_groups = model_order(args)
    if source == "torch_dist":
        state = read_sharded_as_torch_state(directory, model_keys, parameter_groups)
        with progress_bar(f"writing {save}", tensor_bytes(state), "B") as bar:
            return write_torch_checkpoint(save, iteration, state, progress=bar)
    tensors, common = torch_state_as_sharded(state, parameter_groups)
    with progress_bar(f"writing {save}", tensor_bytes(state), "B") as bar:
        error = write_sharded_checkpoint(save, iteration, tensors, common, None, progress=bar)
    if error is not None:
        raise CheckpointError(error)
    return os.path.join(save, iteration_directory_name(iteration))


def main(argv: Optional[List[str]] = None) -> int:
    """tools/convert_checkpoint_format.py: 0, or 1 after one `error:` line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory to convert")
    parser.add_argument("--save", required=True, help="directory to write the converted one to")
    parser.add_argument(
        "--ckpt-format", required=True, choices=FORMATS, help="the format to convert to"
    )
    args = parser.parse_args(argv)
    try:
        written = convert(args.load, args.save, args.ckpt_format)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"converted to {args.ckpt_format}: {written}")
    return 0
