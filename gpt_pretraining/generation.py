"""A checkpoint of pretrain_gpt.py (any format, any parallel layout) as a TextGenerator on one
device: the flags that pick it (`add_model_args`, shared by tools/generate.py and
tools/run_text_generation_server.py, whose libraries are gpt_pretraining.generate_text and
gpt_pretraining.text_generation_server), the device and dtype they name, and the config for
running it there (the experts all local, the grouped GEMM chosen for that device and dtype)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable, NoReturn, Optional

import torch

from gpt_pretraining.checkpoint_model import checkpoint_tokenizer, read_checkpoint_model
from megatron.config import Config
from megatron.errors import UserError
from megatron.inference import GenerationEngine, TextGenerator
from moe.config import MoEConfig, with_grouped_gemm_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """--device: "auto" (the GPU when there is one), "cpu", "cuda" or "cuda:N"."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: this machine's torch sees no GPU; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(
            f"--device {name}: there are {torch.cuda.device_count()} GPUs; pick one of them"
        )
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: generation runs on cpu or cuda devices only")
    return device


def resolve_dtype(name: str) -> Optional[torch.dtype]:
    """--dtype: a dtype, or None for "auto" (`generation_dtype` decides from the checkpoint)."""
    return None if name == "auto" else DTYPES[name]


def generation_dtype(
    config: Config, device: torch.device, dtype: Optional[torch.dtype]
) -> torch.dtype:
    """`dtype`, or when None the one the run computed in (its numerics' compute dtype: bf16
    under --bf16, fp16 under --fp16, else fp32) on a GPU, and fp32 on the CPU."""
    if dtype is not None:
        return dtype
    return config.numerics.compute_dtype if device.type == "cuda" else torch.float32


def inference_config(config: Config, device: torch.device, dtype: torch.dtype) -> Config:
    """`config` for one process on `device` in `dtype`: MoE experts all local, the dMoE's
    grouped GEMM chosen for that device and dtype rather than the training run's."""
    moe = config.extension(MoEConfig)
    if moe is None:
        return config
    moe = with_grouped_gemm_for(
        moe, config, device, dtype, expert_parallel_size=1, tensor_parallel_size=1
    )
    extensions = tuple(moe if isinstance(e, MoEConfig) else e for e in config.extensions)
    parallel = dataclasses.replace(config.parallel, expert_model_parallel_size=1)
    return dataclasses.replace(config, extensions=extensions, parallel=parallel)


def load_text_generator(
    load: str,
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    cuda_graphs: bool = True,
    max_batch_size: int = 32,
    log: Callable[[str], None] = print,
) -> TextGenerator:
    """The checkpoint under `load` (its tracker's iteration) as a TextGenerator on `device`, in
    `dtype` (None: `generation_dtype`'s choice)."""
    if not os.path.isdir(load):
        raise UserError(f"--load {load} is not a directory; pass the --save directory of a run")
    checkpoint = read_checkpoint_model(load, print_fn=log, flag="--load")
    tokenizer = checkpoint_tokenizer(
        checkpoint.args,
        vocab_file=vocab_file,
        merge_file=merge_file,
        tokenizer_model=tokenizer_model,
    )
    dtype = generation_dtype(checkpoint.config, device, dtype)
    config = inference_config(checkpoint.config, device, dtype)
    model = dataclasses.replace(checkpoint, config=config).build_model(device, dtype)
    log(
        f"loaded iteration {checkpoint.iteration} of {load}: {config.model.num_layers} layers, "
        f"hidden {config.model.hidden_size}{_moe_description(config)}, on {device} in "
        f"{str(dtype).replace('torch.', '')}"
    )
    engine = GenerationEngine(model, tokenizer.eod, tokenizer.vocab_size, cuda_graphs)
    return TextGenerator(engine, tokenizer, max_batch_size)


def _moe_description(config: Config) -> str:
    moe = config.extension(MoEConfig)
    if moe is None:
        return ""
    return f", {moe.num_experts} experts (top-{moe.top_k}, {moe.grouped_gemm.name})"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags that pick the checkpoint, its tokenizer files and where it runs."""
    parser.add_argument("--load", required=True, help="checkpoint directory (pretrain's --save)")
    parser.add_argument("--vocab-file", help="replaces the checkpoint's GPT-2 vocab.json")
    parser.add_argument("--merge-file", help="replaces the checkpoint's GPT-2 merges.txt")
    parser.add_argument("--tokenizer-model", help="replaces the checkpoint's tokenizer model")
    parser.add_argument("--device", default="auto", help="auto (GPU if any), cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto: the dtype the run trained in (--bf16, --fp16, else float32) on a GPU, "
        "float32 on the CPU",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every decode step eagerly instead of replaying a captured CUDA graph",
    )


def generator_from_model_args(args: argparse.Namespace, max_batch_size: int) -> TextGenerator:
    """The TextGenerator the flags of `add_model_args` describe, for up to `max_batch_size`
    prompts at once."""
    device = resolve_device(args.device)
    return load_text_generator(
        args.load,
        device,
        resolve_dtype(args.dtype),
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        cuda_graphs=args.cuda_graphs,
        max_batch_size=max_batch_size,
        log=log_to_stderr,
    )


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one `error: ...` line and exits 1."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(1)


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
