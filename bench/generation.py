"""Generation throughput: tools/generate.py's engine on a checkpoint, beside transformers'
`generate` on the same model exported to a Hugging Face directory, in one process.

    # random-weight checkpoints of the example models (a trained dMoE 125M is 44 GB)
    python -m bench.generation --example gpt2_125m --load /tmp/gen/gpt2_125m \\
        --export-hf /tmp/gen/gpt2_125m_hf
    python -m bench.generation --example dmoe_125m --load /tmp/gen/dmoe_125m \\
        --export-hf /tmp/gen/dmoe_125m_hf
    # any checkpoint, and an export made before (tools/checkpoint/convert.py --saver hf)
    python -m bench.generation --load CKPT --hf-dir HF_DIR
    # a CPU smoke run: 2 layers, hidden 64
    python -m bench.generation --example dmoe_125m --tiny --load /tmp/gen/tiny \\
        --batch-sizes 1 2 --tokens 8

For each batch size: random prompts of --prompt-length tokens, then exactly --tokens new tokens
per row, greedy (the engine ignores the end-of-document token; transformers gets
do_sample=False, max_new_tokens = min_new_tokens = --tokens). One warm-up call, then the median
of --repeats timed calls; new tokens/s counts the generated tokens of all rows. Both run in the
same dtype (on a GPU the one the checkpoint trained in, bf16 for the examples, the models
cast; fp32 on the CPU). "agree" is the mean number of
leading new tokens per row that transformers' output shares with ours (the two agree on the
model; bf16 rounding makes near-ties diverge sooner or later).

--example writes the checkpoint first (only when --load holds none): the example's model
(examples/gpt2_125m_1gpu.sh, examples/dmoe_125m_1gpu.sh: 12 layers, hidden 768, 12 heads,
sequence 1024; the dMoE with --moe-num-experts 64 --moe-top-k 1) with Megatron's random init,
saved as pretrain_gpt.py saves it (--ckpt-format torch, fp32).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from gpt_pretraining import GPT_RUN
from gpt_pretraining.generation import load_text_generator, resolve_device, resolve_dtype
from megatron.checkpointing.layout import read_tracker
from megatron.checkpointing.save import CHECKPOINT_VERSION, write_torch_checkpoint
from megatron.inference import GenerationEngine, SamplingOptions

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / "data" / "sample" / "gpt2-vocab.json"
MERGES = REPO / "data" / "sample" / "gpt2-merges.txt"

# The model flags of examples/gpt2_125m_1gpu.sh and examples/dmoe_125m_1gpu.sh, with those of
# examples/common.sh that shape the model.
SHARED_FLAGS = [
    "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--make-vocab-size-divisible-by", "1024", "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(VOCAB), "--merge-file", str(MERGES), "--bf16",
    # Needed to build a config; nothing is trained or read.
    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
    "--lr", "0.0006", "--data-path", "unused",
]  # fmt: skip
GPT2_125M = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
             "--init-method-std", "0.01"]  # fmt: skip
EXAMPLES = {
    "gpt2_125m": GPT2_125M,
    "dmoe_125m": GPT2_125M + ["--moe-num-experts", "64", "--moe-top-k", "1",
                              "--moe-loss-weight", "0.1", "--moe-impl", "grouped"],
}  # fmt: skip
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--make-vocab-size-divisible-by", "128"]  # fmt: skip
TINY_MOE = ["--moe-num-experts", "4"]


def example_flags(example: str, tiny: bool) -> List[str]:
    """pretrain_gpt.py flags of `example` (later flags win), shrunk by `tiny`."""
    flags = SHARED_FLAGS + EXAMPLES[example]
    if tiny:
        flags += TINY + (TINY_MOE if "--moe-num-experts" in flags else [])
    return flags


def write_random_checkpoint(
    load: str, flags: Sequence[str], seed: int = 1234, log: Callable[[str], None] = print
) -> None:
    """A checkpoint of the model `flags` describe, Megatron's init with `seed`, at iteration 1
    of `load`, as pretrain_gpt.py writes one (torch format, fp32, checksums)."""
    config, _ = GPT_RUN.config_from_argv(list(flags), 1)
    torch.manual_seed(seed)
    model = GPT_RUN.model(config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    state = {
        "args": config.saved_arguments(),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 1,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "model": model.state_dict(),
    }
    path = write_torch_checkpoint(load, 1, state)
    log(f"wrote a random-weight checkpoint of {parameters / 1e6:.1f} M parameters: {path}")


def random_prompts(batch_size: int, length: int, vocab_size: int, seed: int) -> List[List[int]]:
    """`batch_size` prompts of `length` token ids drawn uniformly from the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, length), generator=generator).tolist()


def timed(function: Callable[[], List[List[int]]], device: torch.device, repeats: int):
    """(median seconds of `repeats` calls after one warm-up call, the last call's result)."""
    result = function()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def load_hf_model(directory: str, device: torch.device, dtype: torch.dtype):
    """transformers' model of `directory` (its own modeling code allowed), on `device` in
    `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    return model.to(device=device, dtype=dtype).eval()


def hf_generate(model, prompts: List[List[int]], tokens: int, pad: int, device: torch.device):
    """transformers' greedy generate of exactly `tokens` new tokens per prompt (equal lengths)."""
    input_ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=pad,
        )
    new = output[:, input_ids.shape[1] :]
    if new.shape[1] != tokens:
        raise RuntimeError(f"transformers generated {new.shape[1]} tokens, not {tokens}")
    return new.tolist()


def leading_agreement(ours: List[List[int]], theirs: List[List[int]]) -> float:
    """Mean over rows of how many leading tokens the two outputs share."""
    counts = []
    for row_ours, row_theirs in zip(ours, theirs):
        count = 0
        while count < min(len(row_ours), len(row_theirs)) and row_ours[count] == row_theirs[count]:
            count += 1
        counts.append(count)
    return sum(counts) / len(counts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory (written by --example)")
    parser.add_argument("--example", choices=sorted(EXAMPLES), help="write this model first")
    parser.add_argument("--tiny", action="store_true", help="--example at 2 layers, hidden 64")
    parser.add_argument("--hf-dir", help="the same model as a Hugging Face directory")
    parser.add_argument("--export-hf", help="export --load to this directory (if absent), use it")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per row")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = " ".join(["python", "-m", "bench.generation", *argv])
    if args.hf_dir and args.export_hf:
        raise SystemExit("error: give --hf-dir (an export made before) or --export-hf, not both")
    if args.example and read_tracker(args.load) is None:
        write_random_checkpoint(args.load, example_flags(args.example, args.tiny))
    device = resolve_device(args.device)
    generator = load_text_generator(
        args.load,
        device,
        resolve_dtype(args.dtype),
        cuda_graphs=args.cuda_graphs,
        max_batch_size=max(args.batch_sizes),
    )
    engine: GenerationEngine = generator.engine
    dtype = engine.dtype
    tokenizer = generator.tokenizer
    hf_model, hf_note = None, ""
    if args.hf_dir or args.export_hf:
        try:
            hf_model = load_hf_model(_hf_directory(args, dtype), device, dtype)
        except Exception as error:  # our engine's numbers are still worth printing
            hf_note = f"transformers skipped: {type(error).__name__}: {error}"
            print(hf_note, file=sys.stderr)

    rows = []
    greedy = SamplingOptions(greedy=True)
    for batch_size in args.batch_sizes:
        prompts = random_prompts(batch_size, args.prompt_length, tokenizer.vocab_size, batch_size)
        seconds, ours = timed(
            lambda prompts=prompts: engine.generate(
                prompts, args.tokens, greedy, stop_at_eod=False
            ),
            device,
            args.repeats,
        )
        row = {"engine": "megatron.inference", "mode": engine.decode_mode, "batch": batch_size}
        rows.append(dict(row, seconds=seconds))
        if hf_model is not None:
            hf_seconds, theirs = timed(
                lambda prompts=prompts: hf_generate(
                    hf_model, prompts, args.tokens, tokenizer.eod, device
                ),
                device,
                args.repeats,
            )
            rows[-1]["speedup"] = hf_seconds / seconds
            rows.append(
                {
                    "engine": "transformers generate",
                    "mode": "eager",
                    "batch": batch_size,
                    "seconds": hf_seconds,
                    "agree": leading_agreement(ours, theirs),
                }
            )
    print_table(args, device, dtype, generator.engine.config, rows)
    if hf_note:
        print(hf_note)


def _hf_directory(args: argparse.Namespace, dtype: torch.dtype) -> str:
    """--hf-dir, or --export-hf after exporting --load there (in `dtype`) unless it exists."""
    if args.hf_dir:
        return args.hf_dir
    if not os.path.isdir(args.export_hf):
        from gpt_pretraining.huggingface.hf_export import export_checkpoint

        stored = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        export_checkpoint(args.load, args.export_hf, dtype=stored)
    return args.export_hf


def print_table(args, device: torch.device, dtype: torch.dtype, model_config, rows) -> None:
    """The results as a Markdown table, headed by the device, versions, date and command."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    versions = f"torch {torch.__version__}"
    if any(row["engine"].startswith("transformers") for row in rows):
        import transformers

        versions += f", transformers {transformers.__version__}"
    print(
        f"\n{name}, {versions}, {str(dtype).replace('torch.', '')}, "
        f"{datetime.date.today().isoformat()}"
    )
    print(f"command: {args.command}")
    print(
        f"model: {args.load} ({model_config.num_layers} layers, hidden "
        f"{model_config.hidden_size}); prompts of {args.prompt_length} tokens, "
        f"{args.tokens} new tokens per row, median of {args.repeats}"
    )
    print("| engine | decode steps | batch | seconds | new tokens/s | vs transformers | agree |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        throughput = row["batch"] * args.tokens / row["seconds"]
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else ""
        agree = f"{row['agree']:.1f} / {args.tokens}" if "agree" in row else ""
        print(
            f"| {row['engine']} | {row['mode']} | {row['batch']} | {row['seconds']:.3f} | "
            f"{throughput:,.0f} | {speedup} | {agree} |"
        )


if __name__ == "__main__":
    main()
