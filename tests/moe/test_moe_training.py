"""pretrain_gpt.py with MoE layers: trains on the sample corpus, logs the load-balancing loss,
and rejects impossible MoE flags before any work."""

import re

import pytest

import pretrain_gpt
from tests.test_pretrain_gpt import data_prefix, tiny_gpt_args  # noqa: F401  (fixture)

MOE_LINE = re.compile(r" iteration +(\d+)/.*\| load balancing loss: ([0-9.E+-]+) \|")
# Shorter samples than the dense tests use: the same learning signal at a third of the cost.
SHORT = ("--seq-length", "32", "--max-position-embeddings", "32")


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", "reference")


def test_dmoe_top2_trains_and_logs_load_balancing_loss(data_prefix, capsys):  # noqa: F811
    args = tiny_gpt_args(
        data_prefix, *SHORT, "--moe-num-experts", "4", "--moe-top-k", "2", train_iters=16
    )
    result = pretrain_gpt.main(args)
    output = capsys.readouterr().out
    lines = MOE_LINE.findall(output)
    assert len(lines) == 16, output[-3000:]
    balance = [float(value) for _, value in lines]
    # Weight 0.1 times a loss that is 1 at perfect balance and larger otherwise.
    assert all(0.099 < value < 0.4 for value in balance), balance
    losses = [step["lm loss"] for step in result.losses]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    assert "number of parameters" in output


def test_moe_with_capacity_every_other_layer_and_zloss(data_prefix, capsys):  # noqa: F811
    args = tiny_gpt_args(
        data_prefix, *SHORT,
        "--moe-num-experts", "4", "--moe-top-k", "1", "--no-moe-dropless",
        "--moe-capacity-factor", "1.5", "--moe-layer-freq", "2", "--moe-zloss-weight", "0.001",
        "--moe-router-bias-update-rate", "0.001", "--moe-impl", "grouped",
        train_iters=4, micro_batch=2, global_batch=4,
    )  # fmt: skip
    result = pretrain_gpt.main(args)
    output = capsys.readouterr().out
    assert " load balancing loss: " in output and " router z loss: " in output
    assert all("router z loss" in step for step in result.losses)
    assert len(result.losses) == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--moe-num-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5"),
        (
            ["--moe-num-experts", "4", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 does not divide the data-parallel size 1",
        ),
        (["--moe-num-experts", "4", "--moe-layer-freq", "3"], "--moe-layer-freq 3"),
        (["--moe-num-experts", "4", "--moe-impl", "nope"], "--moe-impl"),
        (["--moe-num-experts", "4", "--swiglu", "--mlp-type", "mlp"], "--mlp-type glu"),
    ],
)
def test_bad_moe_flags_are_rejected_before_work(data_prefix, capsys, extra, message):  # noqa: F811
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, *extra))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error
