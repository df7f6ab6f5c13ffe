"""Convert checkpoints of this project to and from Hugging Face model directories, with
Megatron-LM's converter flags.

The library of tools/checkpoint/convert.py (its flags, `build_parser`; its entry, `main`): export
through hf_export.export_checkpoint, import through hf_import.import_hf, both imported only when
asked for, so that a missing `transformers` is one `error:` line naming the `.[hf]` extra.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megatron.errors import UserError

LOADERS = ("megatron", "hf")


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's converter flags (tools/checkpoint/convert.py), for one model family."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model-type", required=True, choices=["GPT"], help="the model family")
    parser.add_argument("--loader", required=True, choices=LOADERS, help="what --load-dir holds")
    parser.add_argument("--saver", required=True, choices=LOADERS, help="what to write")
    parser.add_argument("--load-dir", required=True, help="the checkpoint or model to read")
    parser.add_argument("--save-dir", required=True, help="the new directory to write")
    parser.add_argument(
        "--iteration", type=int, default=None, help="export this iteration (default: latest)"
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="weights' dtype in the export (default: the checkpoint's)",
    )
    parser.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json, if moved")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt, if moved")
    parser.add_argument(
        "--tokenizer-model", default=None, help="the tokenizer.json (directory), if moved"
    )
    parser.add_argument(
        "--max-shard-size",
        type=float,
        default=5.0,
        help="largest safetensors file in GB (default 5, transformers' own)",
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """tools/checkpoint/convert.py: 0, or 1 after one `error:` line."""
    args = build_parser().parse_args(argv)
    if args.loader == args.saver:
        print(
            f"error: --loader {args.loader} --saver {args.saver}: nothing to convert; "
            "use tools/convert_checkpoint_format.py to change a checkpoint's --ckpt-format",
            file=sys.stderr,
        )
        return 1
    try:
        if args.saver == "hf":
            from gpt_pretraining.huggingface.hf_export import TokenizerFiles, export_checkpoint

            export_checkpoint(
                args.load_dir,
                args.save_dir,
                iteration=args.iteration,
                dtype=args.dtype,
                tokenizer_files=TokenizerFiles(
                    args.vocab_file, args.merge_file, args.tokenizer_model
                ),
                max_shard_bytes=int(args.max_shard_size * 1e9),
            )
        else:
            from gpt_pretraining.huggingface.hf_import import import_hf

            import_hf(args.load_dir, args.save_dir)
    except ImportError as error:
        print(
            f"error: {error}; install the Hugging Face extra: pip install -e '.[hf]'",
            file=sys.stderr,
        )
        return 1
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
