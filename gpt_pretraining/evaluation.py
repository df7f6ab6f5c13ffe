"""Loss and perplexity of a checkpoint on an indexed dataset, without training.

The library of tools/evaluate.py (its flags, `parse_arguments`; its entry, `main`). It reads the
checkpoint of any parallel layout and format as one process's model
(gpt_pretraining/checkpoint_model.py) and runs it over the samples training cuts from the
dataset: megatron.data.gpt_dataset's GPTDataset, samples of seq_length + 1 tokens in the order
training serves them for the same --split, --seq-length and --seed (each defaults to the
checkpoint's), made into inputs, labels and loss mask by the training run's `get_batch`. Every
sample of the split is evaluated once (one epoch, nothing repeated), or with --eval-iters N the
first N micro-batches of --micro-batch-size samples. It prints Megatron's validation line:

    validation loss on PREFIX (valid split of 969,30,1) | lm loss value: X | lm loss PPL: Y | tokens: N |

The loss is the token-weighted mean of the per-token losses over every token the loss mask
keeps (all of them, or all but those after an end-of-document token with --eod-mask-loss),
summed in fp64. Training's validation averages micro-batch means instead; the two agree
whenever every micro-batch keeps the same number of tokens (always without --eod-mask-loss).
PPL is Megatron's exp(min(20, loss)). The weights stay fp32; --bf16 runs the forward under
bf16 autocast, as training does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch

from gpt_pretraining.checkpoint_model import (
    CheckpointModel,
    checkpoint_tokenizer,
    read_checkpoint_model,
)
from megatron.checkpointing.layout import CheckpointError, read_tracker
from megatron.composition.forward_step import get_batch
from megatron.data.dataset_splits import get_train_valid_test_split
from megatron.data.gpt_dataset import SPLIT_NAMES, GPTDataset
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.errors import UserError, traceback_asked

# Megatron's --split default, for a checkpoint whose run gave none (separate data paths).
DEFAULT_SPLIT = "969,30,1"
# GPTDataset's name for the samples of every document; it names the index cache files.
WHOLE_DATASET_NAME = "whole"


class EvaluationError(UserError):
    """Flags that cannot evaluate as given; the message names the flag, its value and the fix."""


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation measured: the token-weighted mean loss over `tokens` tokens."""

    checkpoint: str
    iteration: Union[int, str]
    data_path: str
    split: Optional[str]  # the --split string; None for --whole-dataset
    split_name: str  # train, valid, test, or "whole" for --whole-dataset
    seq_length: int
    micro_batch_size: int
    samples: int
    tokens: int
    lm_loss: float
    eod_mask_loss: bool
    bf16: bool

    @property
    def lm_loss_ppl(self) -> float:
        """Megatron's perplexity, exp(min(20, loss)) so that a diverged model still prints."""
        return math.exp(min(20.0, self.lm_loss))

    @property
    def where(self) -> str:
        """The dataset and split, as the validation line names them."""
        if self.split is None:
            return f"{self.data_path} (all documents)"
        return f"{self.data_path} ({self.split_name} split of {self.split})"


def format_evaluation_line(evaluation: Evaluation) -> str:
    """Megatron's validation line for `evaluation`, with the number of tokens averaged over."""
    return (
        f" validation loss on {evaluation.where} | lm loss value: {evaluation.lm_loss:.6E} | "
        f"lm loss PPL: {evaluation.lm_loss_ppl:.6E} | tokens: {evaluation.tokens} |"
    )


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The tool's flags; a flag conflict exits 2 with argparse's message, before any work."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--load", required=True, help="the directory pretrain_gpt.py's --save wrote"
    )
    parser.add_argument(
        "--data-path", required=True, help="indexed dataset prefix (PREFIX.bin/.idx)"
    )
    parser.add_argument("--split", help="train,valid,test weights (default: the checkpoint's)")
    parser.add_argument("--split-name", choices=SPLIT_NAMES, help="the split to evaluate (valid)")
    parser.add_argument(
        "--whole-dataset", action="store_true", help="evaluate every document, as one split"
    )
    parser.add_argument("--seq-length", type=int, help="tokens per sample (the checkpoint's)")
    parser.add_argument(
        "--micro-batch-size", type=int, help="samples per forward (the checkpoint's)"
    )
    parser.add_argument(
        "--eval-iters", type=int, help="evaluate the first N micro-batches (default: all samples)"
    )
    parser.add_argument("--seed", type=int, help="the sample shuffle's seed (the checkpoint's)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--bf16", action="store_true", help="run the forward under bf16 autocast")
    parser.add_argument(
        "--eod-mask-loss", action="store_true", help="leave tokens after an end of document out"
    )
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        parser.add_argument(flag, help=f"with --eod-mask-loss: {flag} (the checkpoint's)")
    parser.add_argument("--log-interval", type=int, default=100, help="batches between progress")
    parser.add_argument("--output-json", help="also write the result to this JSON file")
    args = parser.parse_args(argv)
    if args.whole_dataset and (args.split is not None or args.split_name is not None):
        parser.error(
            "--whole-dataset evaluates every document: give it without --split/--split-name"
        )
    if args.split_name is None:
        args.split_name = WHOLE_DATASET_NAME if args.whole_dataset else "valid"
    return args


def load_checkpoint_model(load: str) -> CheckpointModel:
    """The checkpoint the tracker of --load names; EvaluationError when there is none."""
    fix = "point --load at the directory pretrain_gpt.py's --save wrote"
    if not os.path.isdir(load):
        raise EvaluationError(f"--load {load}: no such directory; {fix}")
    try:
        if read_tracker(load) is None:
            raise EvaluationError(
                f"--load {load} holds no latest_checkpointed_iteration.txt, so no checkpoint; {fix}"
            )
        return read_checkpoint_model(load)
    except CheckpointError as error:
        raise EvaluationError(f"--load {load}: {error}") from None


def check_sequence_length(checkpoint: CheckpointModel, seq_length: int) -> None:
    """Refuse a --seq-length the model cannot take: learned positions end at its table."""
    if seq_length < 1:
        raise EvaluationError(f"--seq-length {seq_length} must be at least 1")
    model = checkpoint.config.model
    if seq_length <= model.max_position_embeddings:
        return
    if model.position_embedding_type == "learned_absolute":
        raise EvaluationError(
            f"--seq-length {seq_length} is larger than the checkpoint's --max-position-embeddings "
            f"{model.max_position_embeddings}: its learned position table has no row past "
            f"position {model.max_position_embeddings - 1}; give --seq-length "
            f"{model.max_position_embeddings} or less"
        )
    print(
        f"note: --seq-length {seq_length} is beyond the --max-position-embeddings "
        f"{model.max_position_embeddings} of this RoPE model; positions past it were not trained"
    )


def build_evaluation_dataset(
    data_path: str,
    split: Optional[str],
    split_name: str,
    seq_length: int,
    seed: int,
    vocab_size: int,
) -> GPTDataset:
    """Every sample of one split of `data_path` (of all its documents when `split` is None),
    once each, in the order training serves them; EvaluationError when there are none."""
    try:
        indexed_dataset = MMapIndexedDataset(data_path)
    except IndexedDatasetError as error:
        raise EvaluationError(
            f"--data-path {data_path}: {error}; give the prefix of a .bin/.idx pair "
            "(tools/preprocess_data.py --output-prefix, plus _text_document)"
        ) from None
    num_documents = len(indexed_dataset)
    if split is None:
        start, stop = 0, num_documents
    else:
        try:
            boundaries = get_train_valid_test_split(split, num_documents)
        except ValueError as error:
            raise EvaluationError(str(error)) from None
        index = SPLIT_NAMES.index(split_name)
        start, stop = boundaries[index], boundaries[index + 1]
    where = f"--data-path {data_path} ({split_name} split of --split {split})"
    if split is None:
        where = f"--data-path {data_path} (--whole-dataset)"
    if stop <= start:
        raise EvaluationError(
            f"{where}: no documents of its {num_documents}; choose another --split-name or "
            "--split, or --whole-dataset"
        )
    # Asking for 0 samples gives one epoch: every sample of the split once, shuffled as
    # training shuffles it (one epoch's order does not depend on how many samples were asked).
    dataset = GPTDataset(
        split_name,
        data_path,
        np.arange(start, stop, dtype=np.int32),
        indexed_dataset,
        0,
        seq_length,
        seed,
        split=split,
        vocab_size=vocab_size,
    )
    if len(dataset) == 0:
        tokens = int(indexed_dataset.sizes[start:stop].sum(dtype=np.int64))
        raise EvaluationError(
            f"{where}: its {stop - start} documents hold {tokens} tokens, fewer than one sample "
            f"of --seq-length {seq_length} + 1; lower --seq-length or evaluate more documents"
        )
    return dataset


def end_of_document_token(args: argparse.Namespace, saved: argparse.Namespace) -> int:
    """The tokenizer's end-of-document id for --eod-mask-loss, from the checkpoint's tokenizer
    (its files, or those the flags give where they have moved)."""
    try:
        tokenizer = checkpoint_tokenizer(
            saved,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
        )
    except UserError as error:
        raise EvaluationError(
            f"--eod-mask-loss needs the checkpoint's tokenizer for its end-of-document id: "
            f"{error} (give where its files are now with --vocab-file/--merge-file or "
            "--tokenizer-model)"
        ) from None
    return tokenizer.eod


def evaluate_loss(
    model: torch.nn.Module,
    batches: Iterable[Dict[str, torch.Tensor]],
    num_batches: int,
    device: torch.device,
    bf16: bool,
    eod_token: Optional[int],
    log_interval: int,
    print_fn: Callable[[str], None] = print,
) -> Tuple[float, int]:
    """(token-weighted mean loss, tokens counted) of `model` over `batches` of seq_length + 1
    tokens; with `eod_token`, tokens after an end of document are left out (--eod-mask-loss).
    Prints a progress line every `log_interval` batches."""
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    )
    # fp64 sums stay exact to far more tokens than any dataset holds; on the device, so that
    # no batch waits for the host.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    token_count = torch.zeros((), dtype=torch.float64, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        for number, batch in enumerate(batches, start=1):
            # -1 is no token id: without --eod-mask-loss get_batch never compares with it.
            inputs = get_batch(batch, -1 if eod_token is None else eod_token, eod_token is not None)
            inputs = {name: value.to(device, non_blocking=True) for name, value in inputs.items()}
            with autocast:
                per_token_losses = model(inputs["tokens"], labels=inputs["labels"])
            loss_mask = inputs["loss_mask"].double()
            loss_sum += (per_token_losses.double() * loss_mask).sum()
            token_count += loss_mask.sum()
            if number % log_interval == 0 or number == num_batches:
                tokens = int(token_count.item())
                seconds = time.perf_counter() - start
                print_fn(
                    f" evaluated batch {number:8d}/{num_batches:8d} | tokens: {tokens} | "
                    f"lm loss: {loss_sum.item() / max(tokens, 1):.6E} | "
                    f"tokens per second: {tokens / max(seconds, 1e-9):.0f} |"
                )
    tokens = int(token_count.item())
    if tokens == 0:
        raise EvaluationError("the loss mask left no token to average over (--eod-mask-loss)")
    return loss_sum.item() / tokens, tokens


def _device(name: Optional[str]) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise EvaluationError(f"--device {name}: {error}; give e.g. cpu, cuda or cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvaluationError(f"--device {name}: this torch sees no CUDA device; use --device cpu")
    return device


def _positive(flag: str, value: int) -> int:
    if value < 1:
        raise EvaluationError(f"{flag} {value} must be at least 1")
    return value


def evaluate_checkpoint(args: argparse.Namespace) -> Evaluation:
    """Evaluate the checkpoint of `args.load` on `args.data_path` as the flags ask."""
    _positive("--log-interval", args.log_interval)
    output_directory = os.path.dirname(os.path.abspath(args.output_json or "."))
    if args.output_json and not os.path.isdir(output_directory):
        raise EvaluationError(
            f"--output-json {args.output_json}: directory {output_directory} does not exist; "
            "create it or write the file elsewhere"
        )
    device = _device(args.device)
    checkpoint = load_checkpoint_model(args.load)
    saved = checkpoint.args
    seq_length = checkpoint.config.data.seq_length if args.seq_length is None else args.seq_length
    check_sequence_length(checkpoint, seq_length)
    micro_batch_size = saved.micro_batch_size
    if args.micro_batch_size is not None:
        micro_batch_size = _positive("--micro-batch-size", args.micro_batch_size)
    split = None if args.whole_dataset else (args.split or getattr(saved, "split", None))
    if not args.whole_dataset and split is None:
        split = DEFAULT_SPLIT
    eod_token = end_of_document_token(args, saved) if args.eod_mask_loss else None
    dataset = build_evaluation_dataset(
        args.data_path,
        split,
        args.split_name,
        seq_length,
        saved.seed if args.seed is None else args.seed,
        checkpoint.config.model.padded_vocab_size,
    )
    num_samples = len(dataset)
    if args.eval_iters is not None:
        asked = _positive("--eval-iters", args.eval_iters) * micro_batch_size
        if asked > num_samples:
            raise EvaluationError(
                f"--eval-iters {args.eval_iters} x --micro-batch-size {micro_batch_size} asks for "
                f"{asked} samples, but {args.data_path} ({args.split_name}) has {num_samples} at "
                f"--seq-length {seq_length}; lower --eval-iters, or leave it out to evaluate all"
            )
        num_samples = asked
    num_batches = -(-num_samples // micro_batch_size)
    print(
        f"> evaluating {checkpoint.directory} on {args.data_path} ({args.split_name}): "
        f"{num_samples} of {len(dataset)} samples of {seq_length} + 1 tokens, {num_batches} "
        f"batches of {micro_batch_size}, on {device}{' in bf16' if args.bf16 else ''}",
        flush=True,
    )
    # The training sampler in order; a last, partial batch is evaluated too.
    sampler = MegatronPretrainingSampler(num_samples, 0, micro_batch_size, 0, 1, drop_last=False)
    batches = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, pin_memory=device.type == "cuda"
    )
    model = checkpoint.build_model(device, torch.float32)
    loss, tokens = evaluate_loss(
        model, batches, num_batches, device, args.bf16, eod_token, args.log_interval
    )
    return Evaluation(
        checkpoint=args.load,
        iteration=checkpoint.iteration,
        data_path=args.data_path,
        split=split,
        split_name=args.split_name,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        samples=num_samples,
        tokens=tokens,
        lm_loss=loss,
        eod_mask_loss=args.eod_mask_loss,
        bf16=args.bf16,
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Evaluate, print the validation line (and write --output-json); 0, or 1 after one
    `error: ...` line for a checkpoint, dataset or flag value that cannot be evaluated."""
    args = parse_arguments(argv)
    try:
        evaluation = evaluate_checkpoint(args)
    except UserError as error:
        if traceback_asked():
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    line = format_evaluation_line(evaluation)
    rule = "-" * (len(line) + 1)
    print(f"{rule}\n{line}\n{rule}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump({**asdict(evaluation), "lm_loss_ppl": evaluation.lm_loss_ppl}, file, indent=2)
            file.write("\n")
    return 0
