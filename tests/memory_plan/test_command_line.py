"""tools/estimate_memory.py's command line (megatron.memory_plan.command_line): what it needs of
a training command, and what it fills in."""

import pytest

from gpt_pretraining import GPT_RUN
from megatron.config import ConfigError
from megatron.memory_plan import estimate_memory
from megatron.memory_plan.command_line import build_config, main
from tests.memory_plan.test_memory_plan import DMOE_125M

SCHEDULE = ["--lr", "6e-4", "--train-iters", "10"]


def _without(flags, removed):
    kept = list(flags)
    for flag in removed[::2]:
        at = kept.index(flag)
        del kept[at : at + 2]
    return kept


def _estimate(argv):
    config, notes = build_config(GPT_RUN, argv, 8)
    return estimate_memory(config, GPT_RUN.mlp_spec(config), 80 << 30), notes


def test_estimate_without_lr_and_train_iters_equals_the_one_with_them():
    without = _without(DMOE_125M, SCHEDULE)
    estimate, notes = _estimate(without)
    assert estimate == _estimate([*without, *SCHEDULE])[0]
    assert "no --lr or --train-iters: placeholders stand in" in "\n".join(notes)


def test_a_schedule_in_samples_gets_a_length_in_samples():
    without = _without(DMOE_125M, SCHEDULE)
    samples = ["--lr-warmup-samples", "100", "--min-lr", "1e-5"]
    estimate, notes = _estimate([*without, *samples])
    assert estimate == _estimate(DMOE_125M)[0]
    assert any("no --lr or --train-samples" in note for note in notes)


def test_the_training_run_still_asks_for_them():
    with pytest.raises(ConfigError, match="missing required flags: --lr"):
        GPT_RUN.resolve(_without(DMOE_125M, SCHEDULE), 8)


def test_flags_from_an_argument_file(tmp_path, capsys):
    (tmp_path / "run.args").write_text(" ".join(DMOE_125M))
    assert main(GPT_RUN, [f"@{tmp_path / 'run.args'}", "--world-size", "8"]) == 0
    from_file = capsys.readouterr().out
    assert main(GPT_RUN, [*DMOE_125M, "--world-size", "8"]) == 0
    assert from_file == capsys.readouterr().out


def test_mock_data_is_a_data_source_of_its_own():
    """A command with --mock-data gets no placeholder --data-path, which the run would refuse
    beside it, and its estimate equals the same command's on a dataset."""
    estimate, notes = _estimate([*DMOE_125M, "--mock-data"])
    assert estimate == _estimate(DMOE_125M)[0]
    assert not any("no --data-path" in note for note in notes)
