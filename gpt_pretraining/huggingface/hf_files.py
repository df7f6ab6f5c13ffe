"""The files of a Hugging Face model directory: safetensors weights (one file or shards with
their index), and the tokenizer files `AutoTokenizer` loads."""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Dict, List, Optional

import torch

from megatron.checkpointing.progress import progress_bar

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size
# Buffers of the MoE layers (moe.layers) that count tokens in training: state, not weights. An
# export leaves them out; an import starts them at zero.
TRAINING_COUNTERS = ("tokens_per_expert", "window_tokens_per_expert", "pending_tokens_per_expert")


def is_training_counter(name: str) -> bool:
    """Whether the state dict entry `name` is one of the MoE layers' training counters."""
    return name.rsplit(".", 1)[-1] in TRAINING_COUNTERS


def _shard_plan(tensors: Dict[str, torch.Tensor], max_shard_bytes: int) -> List[List[str]]:
    """Names grouped into shards of at most `max_shard_bytes` (a larger tensor alone), in
    order."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_safetensors(
    directory: str,
    tensors: Dict[str, torch.Tensor],
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    print_fn: Callable[[str], None] = print,
) -> List[str]:
    """Write `tensors` (cast to `dtype` when given) as model.safetensors, or as numbered
    shards and their index when they exceed `max_shard_bytes`; returns the files written."""
    from safetensors.torch import save_file

    plan = _shard_plan(tensors, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    weight_map, total = {}, 0
    expected = sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors.values())
    bar = progress_bar(f"writing {directory}", expected, "B")
    for file_name, shard in zip(names, plan):
        # Copies: safetensors refuses tensors sharing storage (views of one fused tensor).
        content = {
            name: tensors[name].detach().to(dtype=dtype or tensors[name].dtype).contiguous().clone()
            for name in shard
        }
        shard_bytes = sum(t.numel() * t.element_size() for t in content.values())
        total += shard_bytes
        save_file(content, os.path.join(directory, file_name), metadata={"format": "pt"})
        bar.update(shard_bytes)
        weight_map.update({name: file_name for name in shard})
        if len(plan) > 1:
            print_fn(f"  wrote {file_name} ({len(shard)} tensors)")
    bar.close()
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)
        names.append(INDEX_FILE)
    return names


def read_safetensors(directory: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors weights (one file or an index's
    shards). Raises FileNotFoundError naming the directory when it has none."""
    from safetensors.torch import load_file

    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as handle:
            files = sorted(set(json.load(handle)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(
            f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}: import reads safetensors "
            "weights (re-save a .bin model with save_pretrained(safe_serialization=True))"
        )
    tensors: Dict[str, torch.Tensor] = {}
    paths = [os.path.join(directory, name) for name in files]
    with progress_bar(f"reading {directory}", sum(map(os.path.getsize, paths)), "B") as bar:
        for path in paths:
            tensors.update(load_file(path))
            bar.update(os.path.getsize(path))
    return tensors


def unsupported_tokenizer_message(tokenizer) -> str:
    """Why `write_tokenizer` cannot write this tokenizer; empty when it can."""
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
    from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    if isinstance(tokenizer, (GPT2BPETokenizer, HuggingFaceTokenizer)):
        return ""
    return (
        f"the checkpoint's {type(tokenizer).__name__} has no Hugging Face tokenizer this export "
        "writes exactly (it writes GPT2BPETokenizer and HuggingFaceTokenizer ones); train with "
        "a tokenizer.json (--tokenizer-type HuggingFaceTokenizer) to export"
    )


def write_tokenizer(directory: str, tokenizer, eod: int) -> None:
    """The tokenizer files `AutoTokenizer.from_pretrained(directory)` loads, for this
    project's GPT-2 BPE or Hugging Face tokenizer (megatron.tokenizer), its end-of-document
    token as BOS and EOS."""
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
    from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    end = tokenizer.inv_vocab[eod]
    if isinstance(tokenizer, GPT2BPETokenizer):
        from transformers import GPT2TokenizerFast

        # The same `tokenizers` pipeline this project encodes with (megatron.tokenizer.gpt2_bpe);
        # vocab.json and merges.txt go beside it for tools that read GPT-2's own files.
        exported = GPT2TokenizerFast(
            tokenizer_object=tokenizer.hf_tokenizer,
            unk_token=end,
            bos_token=end,
            eos_token=end,
        )
        shutil.copyfile(tokenizer.vocab_file, os.path.join(directory, "vocab.json"))
        shutil.copyfile(tokenizer.merge_file, os.path.join(directory, "merges.txt"))
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        from transformers import PreTrainedTokenizerFast

        exported = PreTrainedTokenizerFast(
            tokenizer_file=tokenizer.tokenizer_file, bos_token=end, eos_token=end
        )
    else:
        raise ValueError(unsupported_tokenizer_message(tokenizer))
    exported.model_max_length = int(1e30)
    exported.save_pretrained(directory)
