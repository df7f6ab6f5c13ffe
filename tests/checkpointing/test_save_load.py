"""Round trip, layout and the --no-load-*/--finetune rules of megatron.checkpointing."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch import nn

from megatron.checkpointing import (
    CheckpointError,
    checkpoint_file,
    load_checkpoint,
    read_checkpoint_args,
    restore_rng_state,
    save_checkpoint,
    tracker_file,
)
from tests.checkpointing.helpers import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    build,
    checkpoint_config,
    draw_from_every_generator,
    seed_every_generator,
    train,
)


def save_trained(directory, iteration=2, steps=2, **flags):
    """Train a fresh tiny model `steps` steps and save it as `iteration`; returns the trio."""
    model, optimizer, scheduler = build(seed=iteration)
    train(model, optimizer, scheduler, steps)
    save_checkpoint(
        checkpoint_config(directory, **flags),
        iteration,
        model,
        optimizer,
        scheduler,
        args=argparse.Namespace(num_layers=2, consumed_train_samples=0),
        consumed_train_samples=8 * iteration,
        consumed_valid_samples=iteration,
    )
    return model, optimizer, scheduler


def test_checkpoint_file_uses_megatron_names():
    assert checkpoint_file("ckpt", 5) == os.path.join(
        "ckpt", "iter_0000005", "mp_rank_00", "model_optim_rng.pt"
    )
    assert checkpoint_file("ckpt", 1234567, tp_rank=1, pp_rank=2, pp_size=4) == os.path.join(
        "ckpt", "iter_1234567", "mp_rank_01_002", "model_optim_rng.pt"
    )
    assert checkpoint_file("ckpt", "release") == os.path.join(
        "ckpt", "release", "mp_rank_00", "model_optim_rng.pt"
    )


def test_round_trip_resumes_training_exactly(tmp_path):
    args = argparse.Namespace(num_layers=2, consumed_train_samples=0)
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 3)
    save_checkpoint(
        checkpoint_config(tmp_path), 3, model, optimizer, scheduler, args=args,
        consumed_train_samples=24, consumed_valid_samples=4,
    )  # fmt: skip
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optimizer, scheduler, 2)  # what the saving run does next

    resumed_model, resumed_optimizer, resumed_scheduler = build(seed=99)
    loaded = load_checkpoint(
        checkpoint_config(tmp_path), resumed_model, resumed_optimizer, resumed_scheduler
    )
    path = checkpoint_file(str(tmp_path), 3)
    assert loaded.iteration == 3
    assert (loaded.consumed_train_samples, loaded.consumed_valid_samples) == (24, 4)
    assert loaded.loaded_from == path
    train(resumed_model, resumed_optimizer, resumed_scheduler, 2)

    assert_state_dicts_equal(model.state_dict(), resumed_model.state_dict())
    assert_optimizer_states_equal(optimizer.state_dict(), resumed_optimizer.state_dict())
    assert resumed_scheduler.num_steps == scheduler.num_steps == 5

    with open(tracker_file(str(tmp_path))) as f:
        assert f.read() == "3"
    state = torch.load(path, weights_only=False)
    assert state["checkpoint_version"] == 3.0
    assert state["iteration"] == 3
    assert state["consumed_train_samples"] == 24
    assert_state_dicts_equal(state["model"], saved_model)
    assert state["opt_param_scheduler"] == {"num_steps": 3, "period": 2}
    assert len(state["rng_state"]) == 1
    assert set(state["rng_state"][0]) >= {
        "random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"
    }  # fmt: skip
    saved_args = read_checkpoint_args(str(tmp_path))
    assert saved_args.consumed_train_samples == 24
    assert saved_args.consumed_valid_samples == 4
    assert saved_args.num_layers == 2
    assert args.consumed_train_samples == 0  # the caller's namespace is left alone
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def test_rng_streams_continue_where_the_save_left_them(tmp_path):
    model, optimizer, scheduler = build()
    seed_every_generator(7)
    draw_from_every_generator()
    save_checkpoint(checkpoint_config(tmp_path), 1, model, optimizer, scheduler)
    expected = draw_from_every_generator()
    seed_every_generator(8)
    load_checkpoint(checkpoint_config(tmp_path), model, optimizer, scheduler)
    assert draw_from_every_generator() == expected


def test_no_load_or_no_tracker_starts_from_scratch(tmp_path, capsys):
    model, optimizer, scheduler = build()
    for config in (checkpoint_config(None), checkpoint_config(tmp_path)):
        loaded = load_checkpoint(config, model, optimizer, scheduler)
        assert (loaded.iteration, loaded.consumed_train_samples, loaded.loaded_from) == (0, 0, None)
    output = capsys.readouterr().out
    assert "from scratch" in output
    assert "latest_checkpointed_iteration.txt" in output
    assert read_checkpoint_args(str(tmp_path)) is None


@pytest.mark.parametrize("content", ["abc", "-3", "", "12.5"])
def test_bad_tracker_content_is_named(tmp_path, content):
    with open(tracker_file(str(tmp_path)), "w") as f:
        f.write(content)
    with pytest.raises(
        CheckpointError, match=f"latest_checkpointed_iteration.txt holds '{content}'"
    ):
        load_checkpoint(checkpoint_config(tmp_path), *build())


def test_missing_checkpoint_is_named(tmp_path):
    with open(tracker_file(str(tmp_path)), "w") as f:
        f.write("7")
    with pytest.raises(
        CheckpointError,
        match="iter_0000007.*does not exist.*no earlier checkpoint.*remove .*latest_checkpointed",
    ):
        load_checkpoint(checkpoint_config(tmp_path), *build())


def test_damaged_checkpoint_is_named(tmp_path):
    save_trained(tmp_path)
    path = checkpoint_file(str(tmp_path), 2)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="model_optim_rng.pt is damaged: it is .* bytes"):
        load_checkpoint(checkpoint_config(tmp_path), *build())
    with pytest.raises(CheckpointError, match="iter_0000002"):
        read_checkpoint_args(str(tmp_path))


def test_unreadable_checkpoint_without_checksums_is_named(tmp_path):
    save_trained(tmp_path)
    path = checkpoint_file(str(tmp_path), 2)
    os.remove(os.path.join(os.path.dirname(os.path.dirname(path)), "checksums.json"))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(
        CheckpointError, match="could not read .*model_optim_rng.pt.*remove .*latest_checkpointed"
    ):
        load_checkpoint(checkpoint_config(tmp_path), *build())


def test_no_load_optim_skips_optimizer_and_scheduler(tmp_path):
    saved, _, _ = save_trained(tmp_path)
    seed_every_generator(3)
    save_checkpoint(checkpoint_config(tmp_path), 3, saved)  # no optimizer state, rng known
    expected = draw_from_every_generator()
    model, optimizer, scheduler = build(seed=5)
    seed_every_generator(4)
    loaded = load_checkpoint(
        checkpoint_config(tmp_path, no_load_optim=True), model, optimizer, scheduler
    )
    assert loaded.iteration == 3
    assert optimizer.state_dict()["state"] == {}
    assert scheduler.num_steps == 0
    assert_state_dicts_equal(model.state_dict(), saved.state_dict())
    assert draw_from_every_generator() == expected


def test_no_load_rng_leaves_generators_alone(tmp_path):
    saved, saved_optimizer, _ = save_trained(tmp_path)
    model, optimizer, scheduler = build(seed=5)
    seed_every_generator(4)
    expected = draw_from_every_generator()
    seed_every_generator(4)
    load_checkpoint(checkpoint_config(tmp_path, no_load_rng=True), model, optimizer, scheduler)
    assert draw_from_every_generator() == expected
    assert_optimizer_states_equal(optimizer.state_dict(), saved_optimizer.state_dict())
    assert scheduler.num_steps == 2


def test_finetune_loads_only_weights_and_restarts(tmp_path):
    saved, _, _ = save_trained(tmp_path)
    model, optimizer, scheduler = build(seed=5)
    seed_every_generator(4)
    expected = draw_from_every_generator()
    seed_every_generator(4)
    loaded = load_checkpoint(
        checkpoint_config(tmp_path, finetune=True), model, optimizer, scheduler
    )
    assert (loaded.iteration, loaded.consumed_train_samples, loaded.consumed_valid_samples) == (
        0, 0, 0
    )  # fmt: skip
    assert loaded.loaded_from == checkpoint_file(str(tmp_path), 2)
    assert_state_dicts_equal(model.state_dict(), saved.state_dict())
    assert optimizer.state_dict()["state"] == {}
    assert scheduler.num_steps == 0
    assert draw_from_every_generator() == expected


def test_no_save_optim_and_rng_leave_them_out(tmp_path):
    save_trained(tmp_path, no_save_optim=True, no_save_rng=True)
    state = torch.load(checkpoint_file(str(tmp_path), 2), weights_only=False)
    assert not {"optimizer", "opt_param_scheduler", "rng_state"} & state.keys()
    with pytest.raises(CheckpointError, match="no 'optimizer'.*--no-load-optim"):
        load_checkpoint(checkpoint_config(tmp_path), *build())
    with pytest.raises(CheckpointError, match="no 'rng_state'.*--no-load-rng"):
        load_checkpoint(checkpoint_config(tmp_path, no_load_optim=True), *build())
    loaded = load_checkpoint(
        checkpoint_config(tmp_path, no_load_optim=True, no_load_rng=True), *build()
    )
    assert loaded.iteration == 2


def test_model_load_is_strict(tmp_path):
    save_trained(tmp_path)
    with pytest.raises(CheckpointError, match=r"12 missing tensors: decoder.layers.2"):
        load_checkpoint(checkpoint_config(tmp_path), *build(num_layers=3))


class Float16Module(nn.Module):
    """Named like Megatron's wrapper; the checkpoint must hold the wrapped model's keys."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_wrapped_model_saves_and_loads_unwrapped_keys(tmp_path):
    model, optimizer, scheduler = build()
    save_checkpoint(checkpoint_config(tmp_path), 1, Float16Module(model), optimizer, scheduler)
    state = torch.load(checkpoint_file(str(tmp_path), 1), weights_only=False)
    assert state["model"].keys() == model.state_dict().keys()
    resumed, optimizer, scheduler = build(seed=3)
    load_checkpoint(checkpoint_config(tmp_path), Float16Module(resumed), optimizer, scheduler)
    assert_state_dicts_equal(resumed.state_dict(), model.state_dict())


def test_rank_beyond_saved_states_needs_no_load_rng():
    with pytest.raises(ValueError, match="2 data-parallel ranks.*rank 2.*--no-load-rng"):
        restore_rng_state([{}, {}], 2, "ckpt/model_optim_rng.pt")
