"""A checkpoint of this project -> a Hugging Face model directory that `transformers` loads
with no edits: config.json, safetensors weights, generation_config.json and the tokenizer.

The class is chosen from the model's shape, the first that expresses it exactly:
GPT2LMHeadModel (learned positions, LayerNorm, GELU, biases, tied), LlamaForCausalLM (RoPE,
RMSNorm, SwiGLU), MixtralForCausalLM (the same with dMoE SwiGLU experts and Mixtral's
routing), else for a GPT-2-style dMoE this project's own modeling file, carried in the
directory and loaded with trust_remote_code=True (gpt_pretraining/huggingface/remote_code). A model no
class fits is refused with what each one lacks. Padded vocabulary rows are dropped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from gpt_pretraining.checkpoint_model import (
    CheckpointModel,
    checkpoint_tokenizer,
    read_checkpoint_model,
)
from gpt_pretraining.huggingface import hf_gpt2, hf_llama
from gpt_pretraining.huggingface.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    is_training_counter,
    unsupported_tokenizer_message,
    write_safetensors,
    write_tokenizer,
)
from megatron.checkpointing.layout import CheckpointError
from megatron.config import ModelConfig
from megatron.errors import UserError
from moe.config import MoEConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REMOTE_DMOE = "MegatronDMoEForCausalLM"


@dataclass(frozen=True)
class TokenizerFiles:
    """Where the tokenizer's files are, when the checkpoint's saved paths are not valid here."""

    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None


def architecture_for(model: ModelConfig, moe: Optional[MoEConfig]) -> str:
    """The Hugging Face class name this model exports as; UserError listing what each
    candidate lacks when none fits."""
    candidates = [
        (hf_gpt2.ARCHITECTURE, hf_gpt2.refusals(model, moe)),
        (hf_llama.LLAMA, hf_llama.llama_refusals(model, moe)),
        (hf_llama.MIXTRAL, hf_llama.mixtral_refusals(model, moe)),
    ]
    if moe is not None:
        candidates.append((REMOTE_DMOE, _remote_code_refusals(model, moe)))
    for name, problems in candidates:
        if not problems:
            return name
    reasons = "; ".join(
        f"{name} (remote code): {problems[0]}"
        if name == REMOTE_DMOE
        else f"{name} cannot express {', '.join(problems)}"
        for name, problems in candidates
    )
    raise UserError(f"no Hugging Face class fits this model: {reasons}")


def _remote_code_refusals(model: ModelConfig, moe: MoEConfig) -> List[str]:
    from gpt_pretraining.huggingface.remote_code.writer import megatron_dmoe_config_from

    try:
        megatron_dmoe_config_from(model, moe, model.padded_vocab_size, 0)
    except ValueError as error:
        return [str(error)]
    return []


def hf_weights_and_config(checkpoint: CheckpointModel, vocab_size: int, eod: int) -> tuple:
    """(architecture, Hugging Face tensors, config object) of a checkpoint's model."""
    from gpt_pretraining.huggingface.remote_code.writer import (
        megatron_dmoe_config_from,
        remote_code_config,
    )

    model, moe = checkpoint.config.model, checkpoint.moe
    state = checkpoint.state_dict
    architecture = architecture_for(model, moe)
    if architecture == hf_gpt2.ARCHITECTURE:
        return (
            architecture,
            hf_gpt2.to_hf(state, model, vocab_size),
            hf_gpt2.hf_config(model, vocab_size, eod),
        )
    if architecture == hf_llama.LLAMA:
        config = hf_llama.llama_config(model, vocab_size, eod)
        return architecture, hf_llama.to_hf(state, model, None, vocab_size), config
    if architecture == hf_llama.MIXTRAL:
        config = hf_llama.mixtral_config(model, moe, vocab_size, eod)
        return architecture, hf_llama.to_hf(state, model, moe, vocab_size), config
    # This project's own names: only the vocabulary padding goes.
    tensors = {
        name: (tensor[:vocab_size] if name in _VOCABULARY_ROWS else tensor)
        for name, tensor in state.items()
        if not is_training_counter(name)
    }
    return (
        architecture,
        tensors,
        remote_code_config(**megatron_dmoe_config_from(model, moe, vocab_size, eod)),
    )


_VOCABULARY_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def build_checkpoint_tokenizer(checkpoint: CheckpointModel, files: TokenizerFiles):
    """The tokenizer the checkpoint was trained with, from its saved flags or `files`."""
    return checkpoint_tokenizer(
        checkpoint.args,
        vocab_file=files.vocab_file,
        merge_file=files.merge_file,
        tokenizer_model=files.tokenizer_model,
    )


def export_checkpoint(
    load_dir: str,
    save_dir: str,
    *,
    iteration: Optional[int] = None,
    dtype: Optional[str] = None,
    tokenizer_files: TokenizerFiles = TokenizerFiles(),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    print_fn: Callable[[str], None] = print,
) -> str:
    """Export the checkpoint under `load_dir` to the new directory `save_dir`; returns the
    class name. The directory is written under a temporary name and renamed when complete, so
    an interrupted export leaves nothing that looks finished."""
    if os.path.exists(save_dir) and os.listdir(save_dir):
        raise UserError(f"--save-dir {save_dir} exists and is not empty; choose a new directory")
    checkpoint = read_checkpoint_model(load_dir, iteration, print_fn)
    tokenizer = build_checkpoint_tokenizer(checkpoint, tokenizer_files)
    unsupported = unsupported_tokenizer_message(tokenizer)
    if unsupported:
        raise UserError(unsupported)
    vocab_size, eod = tokenizer.vocab_size, tokenizer.eod
    if vocab_size > checkpoint.config.model.padded_vocab_size:
        raise CheckpointError(
            f"the tokenizer has {vocab_size} tokens, the checkpoint's embedding "
            f"{checkpoint.config.model.padded_vocab_size} rows: not the tokenizer it was "
            "trained with"
        )
    architecture, tensors, config = hf_weights_and_config(checkpoint, vocab_size, eod)
    stored = _stored_dtype(checkpoint.state_dict)
    target = DTYPES[dtype] if dtype else stored
    config.dtype = str(target).replace("torch.", "")
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=os.path.basename(save_dir) + ".partial-", dir=parent)
    try:
        config.save_pretrained(temporary)
        files = write_safetensors(temporary, tensors, target, max_shard_bytes, print_fn)
        _write_generation_config(temporary, eod)
        write_tokenizer(temporary, tokenizer, eod)
        if architecture == REMOTE_DMOE:
            from gpt_pretraining.huggingface.remote_code.writer import write_remote_code

            write_remote_code(temporary)
        if os.path.isdir(save_dir):
            os.rmdir(save_dir)  # empty, checked above
        os.replace(temporary, save_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    parameters = sum(tensor.numel() for tensor in tensors.values())
    print_fn(
        f"exported iteration {checkpoint.iteration} of {load_dir} as {architecture} to "
        f"{save_dir}: {parameters / 1e6:.2f} M parameters in {target}, {len(files)} weight "
        f"file(s), vocabulary {vocab_size} (of {checkpoint.config.model.padded_vocab_size} "
        "padded rows)"
    )
    for note in _notes(architecture, checkpoint):
        print_fn(f"note: {note}")
    return architecture


def _stored_dtype(state: Dict[str, torch.Tensor]) -> torch.dtype:
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    return max(set(floating), key=floating.count) if floating else torch.float32


def _write_generation_config(directory: str, eod: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod).save_pretrained(
        directory
    )


def _notes(architecture: str, checkpoint: CheckpointModel) -> List[str]:
    notes = []
    moe = checkpoint.moe
    if architecture == hf_llama.MIXTRAL:
        notes.append(
            f"router_aux_loss_coef = --moe-loss-weight / top-k = {moe.loss_weight / moe.top_k:g}: "
            "transformers' balancing loss (output_router_logits=True) is top-k times this "
            "project's per layer, and pools all layers' tokens where this project averages "
            "the layers' losses"
        )
    if architecture == REMOTE_DMOE:
        notes.append(
            "load with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True): the "
            "modeling file travels in the directory"
        )
    if moe is not None and moe.zloss_weight:
        notes.append("the router z-loss weight is a training setting and is not exported")
    return notes
