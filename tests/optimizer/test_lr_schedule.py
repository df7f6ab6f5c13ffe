"""OptimizerParamScheduler against hand-computed learning rates (steps are samples)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.config import OptimizerConfig, TrainingConfig
from megatron.optimizer import OptimizerParamScheduler, build_lr_scheduler


def training(**overrides) -> TrainingConfig:
    fields = dict(micro_batch_size=1, global_batch_size=8, num_micro_batches=8, train_iters=100)
    fields.update(overrides)
    return TrainingConfig(**fields)


def two_group_optimizer() -> torch.optim.Optimizer:
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.SGD(
        [{"params": [weight], "wd_mult": 1.0}, {"params": [bias], "wd_mult": 0.0}], lr=1.0
    )


def lr_at(scheduler: OptimizerParamScheduler, samples: int) -> float:
    scheduler.num_steps = 0
    scheduler.step(samples)
    assert scheduler.optimizer.param_groups[1]["lr"] == scheduler.optimizer.param_groups[0]["lr"]
    return scheduler.optimizer.param_groups[0]["lr"]


def iteration_schedule(style: str, **overrides) -> OptimizerParamScheduler:
    # 10 warmup iterations and 50 decay iterations of 8 samples: warmup 80, decay 400 samples.
    config = OptimizerConfig(
        lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=10, lr_decay_iters=50,
        weight_decay=0.25, **overrides,
    )  # fmt: skip
    return build_lr_scheduler(two_group_optimizer(), config, training())


def test_warmup_then_linear_decay():
    scheduler = iteration_schedule("linear")
    assert (scheduler.warmup_steps, scheduler.decay_steps) == (80, 400)
    assert lr_at(scheduler, 0) == 0.0
    assert lr_at(scheduler, 40) == pytest.approx(0.5)
    assert lr_at(scheduler, 80) == pytest.approx(1.0)  # the warmup end is still warmup
    assert lr_at(scheduler, 160) == pytest.approx(0.1 + 0.75 * 0.9)
    assert lr_at(scheduler, 240) == pytest.approx(0.55)
    assert lr_at(scheduler, 400) == pytest.approx(0.1)


def test_warmup_then_cosine_decay():
    scheduler = iteration_schedule("cosine")
    assert lr_at(scheduler, 8) == pytest.approx(0.1)
    assert lr_at(scheduler, 160) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(2) / 2))
    assert lr_at(scheduler, 240) == pytest.approx(0.55)
    assert lr_at(scheduler, 320) == pytest.approx(0.1 + 0.45 * (1 - math.sqrt(2) / 2))


def test_constant_keeps_max_lr_past_the_decay_end():
    scheduler = iteration_schedule("constant")
    assert lr_at(scheduler, 40) == pytest.approx(0.5)
    assert lr_at(scheduler, 81) == 1.0
    assert lr_at(scheduler, 10_000) == 1.0


def test_min_lr_after_decay_end():
    for style in ("linear", "cosine"):
        scheduler = iteration_schedule(style)
        assert lr_at(scheduler, 401) == 0.1
        assert lr_at(scheduler, 10_000) == 0.1


def test_warmup_fraction_of_decay_samples():
    # 1000 training samples, decay defaults to them, 10% warmup = 100 samples.
    config = OptimizerConfig(lr=2.0, min_lr=0.0, lr_warmup_fraction=0.1)
    scheduler = build_lr_scheduler(
        two_group_optimizer(), config, training(train_iters=None, train_samples=1000)
    )
    assert (scheduler.warmup_steps, scheduler.decay_steps) == (100, 1000)
    assert lr_at(scheduler, 50) == pytest.approx(1.0)
    assert lr_at(scheduler, 550) == pytest.approx(1.0)  # halfway through 900 decay samples
    assert lr_at(scheduler, 1000) == pytest.approx(0.0)


def test_warmup_fraction_with_iterations_and_default_decay():
    config = OptimizerConfig(lr=1.0, lr_warmup_fraction=0.25)
    scheduler = build_lr_scheduler(two_group_optimizer(), config, training(train_iters=10))
    assert (scheduler.warmup_steps, scheduler.decay_steps) == (20, 80)


def test_weight_decay_follows_wd_mult_and_step_accumulates_samples():
    scheduler = iteration_schedule("linear")
    for _ in range(5):
        scheduler.step(increment=8)
    groups = scheduler.optimizer.param_groups
    assert scheduler.num_steps == 40
    assert groups[0]["lr"] == pytest.approx(0.5)
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (0.25, 0.0)


def test_state_round_trip_restores_samples_and_lr():
    scheduler = iteration_schedule("cosine")
    scheduler.step(168)
    state = scheduler.state_dict()
    assert set(state) == {
        "max_lr", "warmup_steps", "num_steps", "decay_style", "decay_steps", "min_lr"
    }  # fmt: skip
    restored = iteration_schedule("cosine")
    restored.load_state_dict(state)
    assert restored.num_steps == 168
    assert restored.optimizer.param_groups[0]["lr"] == scheduler.optimizer.param_groups[0]["lr"]
    restored.load_state_dict(state)  # loading twice does not count the samples twice
    assert restored.num_steps == 168


def test_checkpoint_values_must_match_unless_told_otherwise():
    state = iteration_schedule("cosine").state_dict()
    with pytest.raises(ValueError, match="decay_style"):
        iteration_schedule("linear").load_state_dict(state)
    state["num_steps"] = 240

    override = iteration_schedule("linear")
    override.override_opt_param_scheduler = True
    override.load_state_dict(state)
    assert override.decay_style == "linear"
    assert override.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)

    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_decay_iters=50)
    from_checkpoint = build_lr_scheduler(
        two_group_optimizer(), config, training(), use_checkpoint_opt_param_scheduler=True
    )
    from_checkpoint.load_state_dict(state)
    assert (from_checkpoint.decay_style, from_checkpoint.warmup_steps) == ("cosine", 80)


def test_invalid_schedules_are_rejected():
    with pytest.raises(ValueError, match="warmup"):
        OptimizerParamScheduler(two_group_optimizer(), 1.0, 0.0, 400, 400, "linear", 0.0)
    with pytest.raises(ValueError, match="lr-decay-style"):
        OptimizerParamScheduler(two_group_optimizer(), 1.0, 0.0, 0, 400, "exponential", 0.0)


def wsd_schedule(wsd_style: str, **overrides) -> OptimizerParamScheduler:
    # Warmup 80 and decay 400 samples as above; the final 20 iterations (160 samples) decay,
    # so the lr holds at 1.0 from sample 80 to 240.
    return iteration_schedule(
        "WSD", lr_wsd_decay_style=wsd_style, lr_wsd_decay_iters=20, **overrides
    )


@pytest.mark.parametrize(
    "wsd_style, middle",
    [
        ("linear", 0.1 + 0.9 * 0.5),
        ("cosine", 0.1 + 0.9 * 0.5),
        ("exponential", 0.1 + 0.9 * (2 * 0.5**0.5 - 1)),
        ("minus_sqrt", 0.1 + 0.9 * (1 - math.sqrt(0.5))),
    ],
)
def test_wsd_warms_up_holds_then_decays_over_its_last_phase(wsd_style, middle):
    scheduler = wsd_schedule(wsd_style)
    assert scheduler.wsd_decay_steps == 160
    assert lr_at(scheduler, 40) == pytest.approx(0.5)
    assert lr_at(scheduler, 80) == pytest.approx(1.0)  # warmup end
    assert lr_at(scheduler, 160) == 1.0  # stable
    assert lr_at(scheduler, 240) == 1.0  # the decay's start
    assert lr_at(scheduler, 320) == pytest.approx(middle)
    assert lr_at(scheduler, 400) == pytest.approx(0.1)  # the decay's end
    assert lr_at(scheduler, 401) == 0.1


def test_wsd_quarter_of_the_decay_by_shape():
    # 40 of the 160 decay samples: r = 0.25.
    expected = {"linear": 0.75, "cosine": 0.5 * (1 + math.sqrt(2) / 2), "minus_sqrt": 0.5}
    expected["exponential"] = 2 * 0.5**0.25 - 1
    for wsd_style, coefficient in expected.items():
        assert lr_at(wsd_schedule(wsd_style), 280) == pytest.approx(0.1 + 0.9 * coefficient)


def test_wsd_counted_in_samples():
    config = OptimizerConfig(
        lr=1.0, lr_decay_style="WSD", lr_wsd_decay_style="linear", lr_wsd_decay_samples=100
    )
    scheduler = build_lr_scheduler(
        two_group_optimizer(), config, training(train_iters=None, train_samples=1000)
    )
    assert (scheduler.decay_steps, scheduler.wsd_decay_steps) == (1000, 100)
    assert lr_at(scheduler, 900) == 1.0
    assert lr_at(scheduler, 950) == pytest.approx(0.5)


def test_wsd_resume_keeps_the_final_decay():
    scheduler = wsd_schedule("minus_sqrt")
    scheduler.step(320)
    state = scheduler.state_dict()
    assert (state["wsd_decay_steps"], state["lr_wsd_decay_style"]) == (160, "minus_sqrt")
    restored = wsd_schedule("minus_sqrt")
    restored.load_state_dict(state)
    assert restored.num_steps == 320
    assert restored.optimizer.param_groups[0]["lr"] == scheduler.optimizer.param_groups[0]["lr"]

    with pytest.raises(ValueError, match="lr_wsd_decay_style 'minus_sqrt' in the checkpoint"):
        wsd_schedule("linear").load_state_dict(state)
    with pytest.raises(ValueError, match="wsd_decay_steps 160 in the checkpoint, 80 now"):
        iteration_schedule(
            "WSD", lr_wsd_decay_style="minus_sqrt", lr_wsd_decay_iters=10
        ).load_state_dict(state)
    from_checkpoint = wsd_schedule("linear", use_checkpoint_opt_param_scheduler=True)
    from_checkpoint.load_state_dict(state)
    assert from_checkpoint.lr_wsd_decay_style == "minus_sqrt"
    assert from_checkpoint.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.1 + 0.9 * (1 - math.sqrt(0.5))
    )


def test_wsd_resume_from_a_checkpoint_without_its_keys():
    # Megatron-Core saves no WSD keys: the run's own final decay is kept.
    state = wsd_schedule("cosine").state_dict()
    del state["wsd_decay_steps"], state["lr_wsd_decay_style"]
    state["num_steps"] = 320
    restored = wsd_schedule("cosine")
    restored.load_state_dict(state)
    assert restored.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)


def test_invalid_wsd_schedules_are_rejected():
    def wsd(wsd_decay_steps, style="linear"):
        optimizer = two_group_optimizer()
        return OptimizerParamScheduler(
            optimizer, 1.0, 0.0, 0, 400, "WSD", 0.0,
            wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=style,
        )  # fmt: skip

    with pytest.raises(ValueError, match="WSD needs the length of its final decay"):
        wsd(None)
    with pytest.raises(ValueError, match="must lie within the decay length"):
        wsd(401)
    with pytest.raises(ValueError, match="--lr-wsd-decay-style 'square'"):
        wsd(100, style="square")
    no_final_decay = wsd(0)  # as in Megatron-Core: max_lr to the decay's end, then min_lr
    assert (lr_at(no_final_decay, 400), lr_at(no_final_decay, 401)) == (1.0, 0.0)
