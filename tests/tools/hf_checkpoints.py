"""Checkpoints of tiny random models in either format, written as pretrain_gpt.py writes them,
for the Hugging Face conversion tests: weights drawn at random everywhere (norms and biases
too), so that a misplaced tensor shows in the logits."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from gpt_pretraining import GPT_RUN
from megatron.checkpointing.convert import torch_state_as_sharded
from megatron.checkpointing.save import CHECKPOINT_VERSION, write_torch_checkpoint
from megatron.checkpointing.sharded_save import write_sharded_checkpoint
from megatron.config import Config
from megatron.config.validation import parse_arguments, resolve_arguments_with_notes
from megatron.tokenizer import vocab_size_with_padding
from moe.arguments import add_moe_args
from moe.config import moe_config
from tests.sample_data import MERGES, VOCAB

GPT2_VOCAB_SIZE = 50257
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--ffn-hidden-size", "48", "--seq-length", "16", "--max-position-embeddings", "16",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
]  # fmt: skip
LLAMA = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--rotary-base", "5000",
]  # fmt: skip
MIXTRAL = LLAMA + [
    "--moe-num-experts", "4", "--moe-top-k", "2", "--moe-normalize-expert-weights", "1",
]  # fmt: skip
TRAINING = [
    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
    "--data-path", "unused", "--vocab-file", str(VOCAB), "--merge-file", str(MERGES),
]  # fmt: skip


def tiny_config(flags: Sequence[str]):
    """(saved arguments, Config) of TINY + `flags` with the GPT-2 vocabulary."""
    namespace = parse_arguments([*TINY, *TRAINING, *flags], [add_moe_args])
    args, notes = resolve_arguments_with_notes(namespace, 1)
    padded = vocab_size_with_padding(GPT2_VOCAB_SIZE, 128, 1, log=None)
    args.padded_vocab_size = padded
    return args, Config.from_resolved(args, notes, padded, extensions=[moe_config])


def random_state(config: Config, seed: int = 0):
    """The model's state dict with every floating tensor drawn from N(0, 0.1) (norm weights
    around 1)."""
    torch.manual_seed(seed)
    model = GPT_RUN.model(config)
    state = model.state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point():
            base = 1.0 if "layernorm" in name and name.endswith("weight") else 0.0
            tensor.copy_(base + 0.1 * torch.randn_like(tensor))
    return state


def write_checkpoint(
    root: Path,
    flags: Sequence[str],
    ckpt_format: str = "torch",
    seed: int = 0,
    zero_padding: bool = False,
):
    """A random tiny model's checkpoint at iteration 3 under `root`; returns its state dict and
    config. `zero_padding` zeroes the padded vocabulary rows, as an import leaves them."""
    args, config = tiny_config(flags)
    state = random_state(config, seed)
    if zero_padding:
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in state:
                state[name][GPT2_VOCAB_SIZE:] = 0
    full = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 3,
        "consumed_train_samples": 3,
        "consumed_valid_samples": 0,
        "model": state,
    }
    if ckpt_format == "torch":
        write_torch_checkpoint(str(root), 3, full)
    else:
        tensors, common = torch_state_as_sharded(full, [])
        assert write_sharded_checkpoint(str(root), 3, tensors, common, None) is None
    return state, config
