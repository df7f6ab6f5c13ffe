"""The tiny GPT and dMoE GPT tests share: their ModelConfig, their pretrain_gpt.py command
line on the bundled sample corpus, the TensorBoard scalars a run of it logged, and the one-line
error a user error prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import pytest
import torch

import pretrain_gpt
from gpt_pretraining.checkpoint_format import model_order
from megatron.checkpointing.convert import read_sharded_as_torch_state
from megatron.checkpointing.torch_dist import is_sharded_checkpoint, read_common
from megatron.config import ModelConfig
from megatron.model import DENSE_MLP, GPTModel, MlpSpec
from megatron.parallelize.steps import shard_model
from tests.sample_data import MERGES, VOCAB

# dMoE layers of 4 experts with top-2 routing, added to `tiny_gpt_args`.
MOE_ARGS = ("--moe-num-experts", "4", "--moe-top-k", "2")


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """A 2-layer GPT small enough for exact fp32 comparisons on the CPU; dropout off."""
    fields: Dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=8,
        max_position_embeddings=8,
        padded_vocab_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def sharded_gpt_model(config: ModelConfig, mlp_spec: MlpSpec = DENSE_MLP) -> GPTModel:
    """This rank's shards of the GPT model, built as pretrain_gpt.py builds it: on the meta
    device, then megatron.parallelize.steps's tensor- and expert-parallel steps and weights."""
    with torch.device("meta"):
        model = GPTModel(config, mlp_spec)
    return shard_model(model, config)


def bf16_autocast_loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """The mean loss of a tiny model (vocabulary 64) on 4 random sequences of 8 tokens drawn
    from `seed`, under the CPU's bf16 autocast (the FP8 products' compute dtype)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (4, 9), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(tokens[:, :-1], labels=tokens[:, 1:])
    return losses.float().mean()


def moe_layer_model_config(
    hidden_size: int, ffn_hidden_size: int, seq_length: int, **overrides: Any
) -> ModelConfig:
    """The ModelConfig an MoE layer test builds its layer from: 2 layers of 2 heads, no linear
    biases; vocabulary and dropout keep ModelConfig's defaults."""
    fields: Dict[str, Any] = dict(
        num_layers=2,
        hidden_size=hidden_size,
        num_attention_heads=2,
        ffn_hidden_size=ffn_hidden_size,
        seq_length=seq_length,
        max_position_embeddings=seq_length,
        add_bias_linear=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_gpt_args(
    data_prefix: str,
    *extra: str,
    num_layers: int = 2,
    hidden_size: int = 64,
    seq_length: int = 64,
    micro_batch: int = 4,
    global_batch: int = 8,
    train_iters: int = 20,
    dropout: float = 0.0,
    eval_interval: int = 1000,
    eval_iters: int = 1,
    tensor_parallel: Optional[int] = None,
) -> List[str]:
    """pretrain_gpt.py flags for a tiny GPT (4 heads, GPT-2 BPE, fp32) on `data_prefix`, then
    `extra`; a flag repeated in `extra` wins (argparse keeps the last value).

    With `tensor_parallel`, also --make-vocab-size-divisible-by 128 / TP: Megatron pads the
    vocabulary to a multiple of that value x TP, so every TP size pads it to 50304, the
    single-process model's.
    """
    args = [
        "--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
        "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
        "--train-iters", str(train_iters), "--lr", "0.003", "--min-lr", "0.0003",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--clip-grad", "1.0",
        "--weight-decay", "0.01", "--init-method-std", "0.02",
        "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
        "--data-path", data_prefix, "--split", "949,50,1",
        "--vocab-file", str(VOCAB), "--merge-file", str(MERGES),
        "--log-interval", "1", "--eval-interval", str(eval_interval),
        "--eval-iters", str(eval_iters), "--num-workers", "0", "--seed", "1234",
    ]  # fmt: skip
    if tensor_parallel is not None:
        args += ["--tensor-model-parallel-size", str(tensor_parallel)]
        args += ["--make-vocab-size-divisible-by", str(128 // tensor_parallel)]
    return args + list(extra)


def tensorboard_scalars(directory: Path, names: Iterable[str]) -> Dict[str, Dict[int, float]]:
    """{name: {iteration: value}} of the scalars `names` a run logged under `directory`, at
    full precision (the log lines round them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {name: {event.step: event.value for event in events.Scalars(name)} for name in names}


def run_expecting_error(argv, capsys) -> str:
    """The one `error: ...` line a user error prints, after checking the exit status is 1."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(argv)
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error, error
    return error


def saved_state(root: Path, iteration: Optional[int] = None) -> Dict[str, Any]:
    """A checkpoint pretrain_gpt.py saved under `root` (the tracker's iteration by default), in
    the torch format's form whatever its format: single-process tensors, the optimizer
    numbered as one process numbers it."""
    root = Path(root)
    if iteration is None:
        iteration = int((root / "latest_checkpointed_iteration.txt").read_text())
    directory = root / f"iter_{iteration:07d}"
    if not is_sharded_checkpoint(str(directory)):
        path = directory / "mp_rank_00" / "model_optim_rng.pt"
        return torch.load(path, map_location="cpu", weights_only=False)
    model_keys, parameter_groups = model_order(read_common(str(directory))["args"])
    return read_sharded_as_torch_state(str(directory), model_keys, parameter_groups)
