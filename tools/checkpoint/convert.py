"""Convert checkpoints of this project to and from Hugging Face model directories, with
Megatron-LM's converter flags.

    # export: any checkpoint (any parallel layout, either --ckpt-format) -> transformers
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \\
        --load-dir checkpoints/gpt2_125m --save-dir hf/gpt2_125m
    # import: a GPT-2, Llama, Mixtral (or exported dMoE) directory -> a release checkpoint
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron \\
        --load-dir hf/Mixtral-8x7B --save-dir checkpoints/mixtral

Export picks GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM or, for a GPT-2-style dMoE,
this project's modeling file carried in the directory (trust_remote_code=True); see
gpt_pretraining/huggingface/hf_export.py. Import prints the pretrain_gpt.py flags that build the model;
train on with `--load DIR --finetune` and them. Needs `pip install -e .[hf]`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

from megatron.errors import UserError  # noqa: E402

LOADERS = ("megatron", "hf")


def build_parser() -> argparse.ArgumentParser:
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


if __name__ == "__main__":
    sys.exit(main())
