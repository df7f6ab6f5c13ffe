"""The run's composition (gpt_pretraining.GPT_RUN, megatron.composition): what a dense and an
MoE run get from the same flags path, and that no tool or bench composes a run from the
training script."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_pretraining import GPT_RUN
from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS
from megatron.config import ConfigError
from megatron.model import DENSE_MLP
from megatron.training.hooks import TrainingHooks
from moe.arguments import MOE_MODEL_ARGUMENTS
from moe.mlp_spec import MoEMlpSpec
from moe.training_hooks import MoETrainingHooks
from tests.sample_data import MERGES, VOCAB
from tests.test_architecture import _imported_names

REPO_ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
    "--vocab-file", str(VOCAB), "--merge-file", str(MERGES), "--data-path", "unused",
]  # fmt: skip
MOE_FLAGS = ["--moe-num-experts", "4", "--moe-top-k", "2", "--moe-loss-weight", "0.1"]


def test_a_dense_run_gets_megatrons_parts_only():
    config, tokenizer = GPT_RUN.config_from_argv(FLAGS, world_size=1)
    assert config.model.padded_vocab_size == 50304 and tokenizer.vocab_size == 50257
    assert config.extensions == ()
    assert GPT_RUN.mlp_spec(config) is DENSE_MLP
    assert type(GPT_RUN.training_hooks(config)) is TrainingHooks
    model = GPT_RUN.model(config)
    batch = {"text": torch.randint(0, 50257, (2, 33))}
    loss, reported = GPT_RUN.forward_step(config, model, tokenizer.eod)(model, batch)
    assert list(reported) == ["lm loss"] and torch.isfinite(loss)


def test_an_moe_run_gets_the_extensions_parts():
    lines = []
    config, tokenizer = GPT_RUN.config_from_argv(FLAGS + MOE_FLAGS, 1, tokenizer_log=lines.append)
    assert lines and "padded vocab" in lines[0]
    assert isinstance(GPT_RUN.mlp_spec(config), MoEMlpSpec)
    assert isinstance(GPT_RUN.training_hooks(config), MoETrainingHooks)
    assert GPT_RUN.model_arguments == MODEL_ARGUMENTS + MOE_MODEL_ARGUMENTS
    model = GPT_RUN.model(config)
    batch = {"text": torch.randint(0, 50257, (2, 33))}
    loss, reported = GPT_RUN.forward_step(config, model, tokenizer.eod)(model, batch)
    assert list(reported) == ["lm loss", "load balancing loss"]
    assert float(loss.detach()) == pytest.approx(
        float(reported["lm loss"] + reported["load balancing loss"])
    )
    # A checkpoint's saved arguments build the same config again; those of a checkpoint saved
    # before a flag existed, with the flag's default (an extension's flags too: the dMoE's
    # checkpoints from before --moe-expert-parallel-chunked-overlap had crashed the tools).
    again = GPT_RUN.config_from_saved(config.saved_arguments())
    assert again.model == config.model and again.extensions == config.extensions
    older = config.saved_arguments()
    del older.moe_expert_parallel_chunked_overlap, older.moe_expert_parallel_comm_chunks
    del older.check_for_nan_in_loss_and_grad
    assert GPT_RUN.config_from_saved(older) == again


def test_the_tokenizer_flags_give_the_padded_vocabulary_or_one_config_error(tmp_path):
    null = FLAGS + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    config, tokenizer = GPT_RUN.config_from_argv(null, world_size=1)
    assert (tokenizer.vocab_size, tokenizer.eod, config.model.padded_vocab_size) == (
        1000,
        999,
        1024,
    )
    missing = str(tmp_path / "missing.model")
    with pytest.raises(ConfigError) as error:
        GPT_RUN.config_from_argv(
            FLAGS + ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", missing], 1
        )
    assert str(error.value) == (
        f"--tokenizer-model {missing} does not exist (needed by --tokenizer-type "
        "Llama2Tokenizer); pass an existing file"
    )


def test_megatrons_unimplemented_flags_are_refused():
    with pytest.raises(ConfigError, match="--reset-position-ids are not supported yet"):
        GPT_RUN.resolve(FLAGS + ["--reset-position-ids"], 1)


def test_no_tool_or_bench_imports_the_training_script():
    """They build runs through gpt_pretraining, which the training script only calls."""
    offending = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for folder in ("tools", "bench")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for line, name in _imported_names(path)
        if name == "pretrain_gpt"
    ]
    assert not offending, "\n".join(offending)
