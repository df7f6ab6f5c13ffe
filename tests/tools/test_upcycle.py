"""tools/checkpoint/upcycle.py: a dense checkpoint grown into a dMoE whose experts are copies
of the dense MLP computes the dense model's loss at its first step, and trains."""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from gpt_pretraining import upcycle
from gpt_pretraining.checkpoint_model import read_checkpoint_model
from tests.tiny_gpt import tiny_gpt_args

SWIGLU = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear",
]  # fmt: skip


def finetune_losses(data_prefix, load_dir, *extra, iterations):
    argv = tiny_gpt_args(data_prefix, *extra, train_iters=iterations)
    argv += ["--load", str(load_dir), "--finetune", "--lr", "0.003", "--min-lr", "0.003"]
    return [step["lm loss"] for step in pretrain_gpt.main(argv).losses]


@pytest.mark.parametrize(
    "dense_flags, moe_flags",
    [
        (["--disable-bias-linear"], ["--moe-num-experts", "8", "--moe-top-k", "1"]),
        (
            SWIGLU,
            [
                "--moe-num-experts",
                "4",
                "--moe-top-k",
                "2",
                "--moe-normalize-expert-weights",
                "1",
                "--moe-layer-freq",
                "2",
            ],
        ),  # fmt: skip
    ],
)
def test_upcycled_model_starts_as_the_dense_one_and_trains(
    dense_flags, moe_flags, data_prefix, tmp_path
):
    dense_run = tiny_gpt_args(data_prefix, *dense_flags, train_iters=3)
    pretrain_gpt.main(dense_run + ["--save", str(tmp_path / "dense"), "--save-interval", "3"])
    assert upcycle.main(["--load-dir", str(tmp_path / "dense"), "--save-dir",
                         str(tmp_path / "moe"), *moe_flags]) == 0  # fmt: skip

    dense = read_checkpoint_model(str(tmp_path / "dense"), print_fn=lambda _: None)
    upcycled = read_checkpoint_model(str(tmp_path / "moe"), print_fn=lambda _: None)
    assert upcycled.moe is not None and upcycled.moe.num_experts == int(moe_flags[1])
    tokens = torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense_loss = dense.build_model()(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        moe_loss = upcycled.build_model()(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    assert abs(moe_loss.item() - dense_loss.item()) <= 1e-6 * dense_loss.item()

    dense_losses = finetune_losses(data_prefix, tmp_path / "dense", *dense_flags, iterations=3)
    moe_losses = finetune_losses(
        data_prefix, tmp_path / "moe", *dense_flags, *moe_flags, iterations=12
    )
    assert abs(moe_losses[0] - dense_losses[0]) <= 1e-6 * dense_losses[0]
    # It trains: batches differ, so compare the last iterations with the first by a margin
    # well beyond their spread (about 0.1 for this barely trained model).
    assert max(moe_losses[-3:]) < moe_losses[0] - 0.3, moe_losses


def test_refusals(data_prefix, tmp_path, capsys):
    pretrain_gpt.main(
        tiny_gpt_args(data_prefix, train_iters=2)
        + ["--save", str(tmp_path / "biased"), "--save-interval", "2", "--lr-warmup-iters", "0"]
    )
    argv = ["--load-dir", str(tmp_path / "biased"), "--save-dir", str(tmp_path / "moe")]
    assert upcycle.main(argv + ["--moe-num-experts", "4"]) == 1
    assert "--disable-bias-linear" in capsys.readouterr().err
    assert upcycle.main(argv) == 1
    assert "--moe-num-experts" in capsys.readouterr().err
    assert upcycle.main(argv + ["--moe-num-experts", "4", "--mlp-type", "glu"]) == 1
    assert "--mlp-type glu" in capsys.readouterr().err
    # Experts copy the dense MLP whole: they cannot take another size.
    assert upcycle.main(argv + ["--moe-num-experts", "4", "--moe-ffn-hidden-size", "64"]) == 1
    assert capsys.readouterr().err == (
        "error: --moe-ffn-hidden-size 64: the dense checkpoint's MLPs have --ffn-hidden-size "
        "256, and upcycling copies them into the experts whole; drop --moe-ffn-hidden-size (or "
        "give 256)\n"
    )
    assert not (tmp_path / "moe").exists()
