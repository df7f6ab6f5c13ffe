"""Generate text from a checkpoint of pretrain_gpt.py (any format, any parallel layout).

The library of tools/generate.py (its flags, `build_parser`; its entry, `main`): the prompts of
--prompt or --prompts-file, the sampling the flags ask for, and each completion printed (as text,
or one JSON object per line with --json); the checkpoint becomes a TextGenerator through
gpt_pretraining.generation, whose flags (`add_model_args`) the server shares.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from gpt_pretraining.generation import (
    OneLineErrorParser,
    add_model_args,
    generator_from_model_args,
    log_to_stderr,
)
from megatron.errors import UserError
from megatron.inference import SamplingOptions


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
    log_to_stderr(f"decode steps: {generator.engine.decode_mode}")
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
