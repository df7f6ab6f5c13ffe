"""A Hugging Face GPT-2, Llama or Mixtral directory (safetensors), or one this project exported
with its own dMoE modeling file -> a checkpoint of this project that
`pretrain_gpt.py --load DIR --finetune` continues from.

The checkpoint is Megatron's `release` checkpoint of the model weights alone (no optimizer,
no iteration), in the `torch` format, which loads at any parallel layout. Its saved arguments
are those of the pretrain_gpt.py flags that build the model, printed for the user to train
with; the vocabulary is padded as pretrain_gpt.py pads it (new rows zero).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import Callable, Dict, List, Tuple

import torch

from gpt_pretraining import GPT_RUN
from gpt_pretraining.huggingface import hf_gpt2, hf_llama
from gpt_pretraining.huggingface.hf_files import is_training_counter, read_safetensors
from megatron.checkpointing.layout import RELEASE, read_tracker
from megatron.checkpointing.progress import progress_bar, tensor_bytes
from megatron.checkpointing.save import CHECKPOINT_VERSION, write_torch_checkpoint
from megatron.composition.run import tokenizer_and_padded_vocab
from megatron.config import Config, ConfigError
from megatron.config.layer_pattern import pattern_text
from megatron.errors import UserError

# Flags a checkpoint's arguments need that do not shape the model; the user's training
# command gives its own.
_PLACEHOLDER_TRAINING_FLAGS = [
    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-5",
    "--data-path", "imported-model-no-data",
]  # fmt: skip
_VOCABULARY_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
MEGATRON_DMOE = "megatron_dmoe"  # gpt_pretraining/huggingface/remote_code


def _read_config(hf_dir: str):
    """The directory's config: transformers' class for its own models; for this project's
    dMoE the plain fields (reading them runs none of the directory's code)."""
    from transformers import AutoConfig

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{hf_dir} has no config.json: pass a Hugging Face model directory")
    with open(path, encoding="utf-8") as handle:
        fields = json.load(handle)
    if fields.get("model_type") == MEGATRON_DMOE:
        return argparse.Namespace(**fields)
    return AutoConfig.from_pretrained(hf_dir)


def _megatron_dmoe_flags(config) -> List[str]:
    """pretrain_gpt.py's flags for a config.json of gpt_pretraining/huggingface/remote_code."""
    flags = [
        "--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
        "--num-attention-heads", str(config.num_attention_heads),
        "--ffn-hidden-size", str(config.ffn_hidden_size),
        "--max-position-embeddings", str(config.max_position_embeddings),
        "--seq-length", str(config.max_position_embeddings),
        "--layernorm-epsilon", repr(config.layernorm_epsilon),
        "--init-method-std", repr(config.initializer_range),
        "--moe-num-experts", str(config.num_experts), "--moe-top-k", str(config.moe_top_k),
        "--moe-layer-freq", _layer_freq_flag(config.moe_layer_freq), "--mlp-type", config.mlp_type,
    ]  # fmt: skip
    # Exports before the experts had a size of their own have no such field.
    if getattr(config, "moe_ffn_hidden_size", None) is not None:
        flags += ["--moe-ffn-hidden-size", str(config.moe_ffn_hidden_size)]
    groups = getattr(config, "num_query_groups", config.num_attention_heads)
    if groups != config.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if not config.add_bias_linear:
        flags.append("--disable-bias-linear")
    if not getattr(config, "tie_word_embeddings", True):
        flags.append("--untie-embeddings-and-output-weights")
    if config.activation == "silu":
        flags.append("--swiglu")
    if config.normalize_expert_weights is not None:
        flags += ["--moe-normalize-expert-weights", repr(config.normalize_expert_weights)]
    return flags + _megatron_dmoe_routing_flags(config)


def _megatron_dmoe_routing_flags(config) -> List[str]:
    """The --moe-router-* flags of a megatron_dmoe config.json; exports made before these
    fields existed have none and route as the flags' defaults do."""
    flags = []
    score = getattr(config, "moe_router_score", "softmax")
    if score != "softmax":
        flags += ["--moe-router-score", score]
    if not getattr(config, "moe_router_pre_softmax", True):
        flags.append("--no-moe-router-pre-softmax")
    factor = getattr(config, "moe_router_topk_scaling_factor", None)
    if factor is not None:
        flags += ["--moe-router-topk-scaling-factor", repr(factor)]
    rate = getattr(config, "moe_router_bias_update_rate", 0.0)
    if rate > 0:
        flags += ["--moe-router-bias-update-rate", repr(rate)]
    router_dtype = getattr(config, "moe_router_dtype", None)
    if router_dtype is not None:
        flags += ["--moe-router-dtype", router_dtype]
    return flags


def _layer_freq_flag(value) -> str:
    """config.json's moe_layer_freq (an integer, or one 0/1 per layer) as the flag's value."""
    return str(value) if isinstance(value, int) else pattern_text(value)


def model_flags_and_state(hf_dir: str) -> Tuple[List[str], Dict[str, torch.Tensor], object]:
    """(pretrain_gpt.py model flags, unpadded state dict, HF config) of a model directory."""
    config = _read_config(hf_dir)
    tensors = read_safetensors(hf_dir)
    kind = config.model_type
    try:
        if kind == "gpt2":
            return hf_gpt2.model_flags(config), hf_gpt2.from_hf(tensors, config), config
        if kind == MEGATRON_DMOE:  # this project's own names
            return _megatron_dmoe_flags(config), dict(tensors), config
        if kind in ("llama", "mixtral"):
            moe = kind == "mixtral"
            flags = hf_llama.model_flags(config, moe)
            return flags, hf_llama.from_hf(tensors, config, moe), config
    except (ValueError, KeyError) as error:
        detail = f"missing tensor {error}" if isinstance(error, KeyError) else str(error)
        raise UserError(f"{hf_dir} ({kind}): {detail}") from None
    raise UserError(
        f"{hf_dir} holds a {kind!r} model; import reads gpt2, llama, mixtral and this "
        "project's megatron_dmoe directories"
    )


def tokenizer_flags(hf_dir: str, kind: str) -> List[str]:
    """The tokenizer flags that read the directory's own tokenizer files: GPT-2's vocab.json
    and merges.txt as GPT2BPETokenizer (Megatron's exact GPT-2 ids), else its tokenizer.json."""
    directory = os.path.abspath(hf_dir)
    vocab, merges = (os.path.join(directory, name) for name in ("vocab.json", "merges.txt"))
    if kind == "gpt2" and os.path.isfile(vocab) and os.path.isfile(merges):
        return [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab,
            "--merge-file",
            merges,
        ]
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory]
    raise UserError(
        f"{hf_dir} has no tokenizer.json (nor GPT-2's vocab.json and merges.txt): save the "
        "model's fast tokenizer into it with save_pretrained"
    )


def import_hf(hf_dir: str, save_dir: str, print_fn: Callable[[str], None] = print) -> List[str]:
    """Import `hf_dir` into a release checkpoint under `save_dir`; returns the model and
    tokenizer flags to train it with."""
    if read_tracker(save_dir) is not None:
        raise UserError(f"--save-dir {save_dir} already holds a checkpoint; choose a new directory")
    flags, state, config = model_flags_and_state(hf_dir)
    flags += tokenizer_flags(hf_dir, config.model_type)
    try:
        args, notes = GPT_RUN.resolve(flags + _PLACEHOLDER_TRAINING_FLAGS, 1)
    except ConfigError as error:
        raise UserError(
            f"{hf_dir}: its model maps to flags this project refuses: {error}"
        ) from None
    tokenizer, padded = tokenizer_and_padded_vocab(args)
    rows = state["embedding.word_embeddings.weight"].shape[0]
    if rows > padded:
        raise UserError(
            f"{hf_dir}: the embedding has {rows} rows, more than the tokenizer's "
            f"{tokenizer.vocab_size} tokens padded to {padded}; its extra rows have no token"
        )
    state = {name: _pad_rows(tensor, padded) if name in _VOCABULARY_ROWS else tensor
             for name, tensor in state.items()}  # fmt: skip
    run_config = GPT_RUN.config(args, notes, padded)
    state = _checked_with_training_counters(state, run_config)
    args.padded_vocab_size = padded
    release = _release_state(args, state)
    with progress_bar(f"writing {save_dir}", tensor_bytes(release), "B") as bar:
        write_torch_checkpoint(save_dir, RELEASE, release, progress=bar)
    print_fn(
        f"imported {hf_dir} ({config.model_type}, {sum(t.numel() for t in state.values()) / 1e6:.2f}"
        f" M parameters with the padded vocabulary of {padded}) into {save_dir}/release"
    )
    model_flags = flags
    print_fn(
        "train it with: pretrain_gpt.py --load "
        f"{shlex.quote(save_dir)} --finetune {shlex.join(model_flags)} [data, batch, lr flags]"
    )
    return model_flags


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat((tensor, padding), dim=0)


def _checked_with_training_counters(
    state: Dict[str, torch.Tensor], config: Config
) -> Dict[str, torch.Tensor]:
    """`state` and, at zero, the training counters the model checkpoints and an export leaves
    out (the expert bias's pending token counts); UserError unless the tensors are then exactly
    the model's, names and shapes."""
    with torch.device("meta"):
        model = GPT_RUN.model(config)
    expected = model.state_dict()
    state = dict(state)
    for name in sorted(expected.keys() - state.keys()):
        if not is_training_counter(name):
            raise UserError(f"the imported model lacks {name}: the mapping is incomplete")
        state[name] = torch.zeros(expected[name].shape, dtype=expected[name].dtype)
    for name, tensor in state.items():
        shape = tuple(expected[name].shape) if name in expected else None
        if shape != tuple(tensor.shape):
            raise UserError(f"{name}: imported shape {tuple(tensor.shape)}, the model's {shape}")
    return state


def _release_state(args: argparse.Namespace, model_state: Dict[str, torch.Tensor]) -> Dict:
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    return {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "model": model_state,
    }
