"""Generate text from a checkpoint of pretrain_gpt.py (any format, any parallel layout).

    python tools/generate.py --load runs/quickstart/checkpoints --prompt "The city of" \\
        --tokens-to-generate 32 --greedy
    python tools/generate.py --load CKPT --prompts-file prompts.txt --top-p 0.9 --seed 7

Prints each prompt followed by its completion (--json: one JSON object per line instead);
progress goes to stderr. The model runs on the GPU when there is one, in bf16 (the model is
cast; no autocast), else on the CPU in fp32 (--device, --dtype). Sampling is at temperature
1 over the whole vocabulary unless --greedy, --top-k, --top-p or --temperature say otherwise,
and a completion stops at the end-of-document token or after --tokens-to-generate tokens.
The tokenizer is the checkpoint's (its saved --tokenizer-type and files); --vocab-file,
--merge-file and --tokenizer-model replace files saved as paths of another machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, List, NoReturn, Optional

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.config import Config  # noqa: E402
from megatron.errors import UserError  # noqa: E402
from megatron.inference import GenerationEngine, SamplingOptions, TextGenerator  # noqa: E402
from moe.config import MoEConfig, with_grouped_gemm_for  # noqa: E402
from tools.checkpoint.checkpoint_model import (  # noqa: E402
    checkpoint_tokenizer,
    read_checkpoint_model,
)

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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype: "auto" is bf16 on a GPU and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


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
    dtype: torch.dtype,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    cuda_graphs: bool = True,
    max_batch_size: int = 32,
    log: Callable[[str], None] = print,
) -> TextGenerator:
    """The checkpoint under `load` (its tracker's iteration) as a TextGenerator on `device`."""
    if not os.path.isdir(load):
        raise UserError(f"--load {load} is not a directory; pass the --save directory of a run")
    checkpoint = read_checkpoint_model(load, print_fn=log, flag="--load")
    tokenizer = checkpoint_tokenizer(
        checkpoint.args,
        vocab_file=vocab_file,
        merge_file=merge_file,
        tokenizer_model=tokenizer_model,
    )
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
    return f", {moe.num_experts} experts (top-{moe.top_k}, {moe.grouped_gemm})"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags that pick the checkpoint, its tokenizer files and where it runs."""
    parser.add_argument("--load", required=True, help="checkpoint directory (pretrain's --save)")
    parser.add_argument("--vocab-file", help="replaces the checkpoint's GPT-2 vocab.json")
    parser.add_argument("--merge-file", help="replaces the checkpoint's GPT-2 merges.txt")
    parser.add_argument("--tokenizer-model", help="replaces the checkpoint's tokenizer model")
    parser.add_argument("--device", default="auto", help="auto (GPU if any), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
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
        resolve_dtype(args.dtype, device),
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        cuda_graphs=args.cuda_graphs,
        max_batch_size=max_batch_size,
        log=_log,
    )


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one `error: ...` line and exits 1."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    """tools/generate.py's flags."""
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_model_args(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    prompts.add_argument("--prompts-file", help="a text file of prompts, one per line")
    parser.add_argument("--tokens-to-generate", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling (0: off)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the sampling")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts generated together")
    parser.add_argument("--json", action="store_true", help="one JSON object per completion")
    return parser


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    """The SamplingOptions of the flags; UserError naming the flag of a bad value."""
    if args.greedy and (args.top_k or args.top_p or args.temperature != 1.0):
        raise UserError(
            "--greedy takes the likeliest token: drop --top-k, --top-p and --temperature, "
            "or drop --greedy to sample"
        )
    for flag, value, valid, fix in (
        ("--temperature", args.temperature, args.temperature > 0, "use a value > 0"),
        ("--top-k", args.top_k, args.top_k >= 0, "use 0 (no cut) or more"),
        ("--top-p", args.top_p, 0.0 <= args.top_p <= 1.0, "use a value in [0, 1]"),
    ):
        if not valid:
            raise UserError(f"{flag} {value} is out of range; {fix}")
    return SamplingOptions(args.greedy, args.temperature, args.top_k, args.top_p, args.seed)


def read_prompts(args: argparse.Namespace) -> List[str]:
    """--prompt values, or the non-empty lines of --prompts-file."""
    if args.prompt is not None:
        return list(args.prompt)
    try:
        with open(args.prompts_file, encoding="utf-8") as file:
            prompts = [line.rstrip("\r\n") for line in file if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--prompts-file {args.prompts_file}: cannot read it ({error})") from None
    if not prompts:
        raise UserError(f"--prompts-file {args.prompts_file} has no prompt: write one per line")
    return prompts


def main(argv: Optional[List[str]] = None) -> int:
    """Generate and print; 1 with one `error: ...` line when an input is wrong."""
    args = build_parser().parse_args(argv)
    try:
        if args.tokens_to_generate < 0:
            raise UserError(f"--tokens-to-generate {args.tokens_to_generate} must be >= 0")
        if args.batch_size < 1:
            raise UserError(f"--batch-size {args.batch_size} must be >= 1")
        sampling = sampling_options(args)
        prompts = read_prompts(args)
        generator = generator_from_model_args(args, args.batch_size)
        try:
            completions = generator.complete(prompts, args.tokens_to_generate, sampling)
        except ValueError as error:  # a prompt too long for the model's positions
            raise UserError(f"{error} (--tokens-to-generate)") from None
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    _log(f"decode steps: {generator.engine.decode_mode}")
    for index, completion in enumerate(completions):
        if args.json:
            record = {"prompt": completion.prompt, "completion": completion.text}
            record["tokens"] = completion.tokens
            print(json.dumps(record, ensure_ascii=False))
        else:
            if index > 0:
                print("-" * 40)
            print(completion.full_text)
    return 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
