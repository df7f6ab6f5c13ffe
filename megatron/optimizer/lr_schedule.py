"""Learning-rate schedule with Megatron's semantics: steps are counted in samples.

Linear warmup from 0 to `max_lr`, then constant, linear or cosine decay to `min_lr`, and
`min_lr` once the decay is over. WSD (warmup-stable-decay, Megatron-Core's
`--lr-decay-style WSD`) holds `max_lr` after the warmup and decays only over the last
`wsd_decay_steps` of the decay length, by `lr_wsd_decay_style` with the decayed fraction r of
that phase: linear 1 - r, cosine (1 + cos(pi r)) / 2, exponential 2 * 0.5**r - 1, minus_sqrt
1 - sqrt(r), each the share of `max_lr - min_lr` kept above `min_lr`. The weight decay is constant (Megatron's
`--weight-decay-incr-style constant`); each param group's `wd_mult` (0.0 for biases and norm
weights, see `build_optimizer`) scales it.
"""

from __future__ import annotations

import math
from typing import Any, Dict

from megatron.arguments.run import LR_DECAY_STYLES, LR_WSD_DECAY_STYLES
from megatron.config import OptimizerConfig, TrainingConfig


class OptimizerParamScheduler:
    """Sets every param group's `lr` and `weight_decay` from the number of samples consumed.

    `optimizer` is anything with `param_groups` (a `MegatronOptimizer` or a torch optimizer).
    On `load_state_dict` the checkpoint's sample count is always restored; for the schedule
    values (max_lr, min_lr, warmup_steps, decay_steps, decay_style, and for WSD
    wsd_decay_steps and lr_wsd_decay_style) Megatron's rule applies:
    by default they must equal the current ones (a mismatch raises), with
    `use_checkpoint_opt_param_scheduler` the checkpoint's are taken, with
    `override_opt_param_scheduler` the current ones are kept.
    """

    def __init__(
        self,
        optimizer: Any,
        max_lr: float,
        min_lr: float,
        warmup_steps: float,
        decay_steps: float,
        decay_style: str,
        weight_decay: float,
        use_checkpoint_opt_param_scheduler: bool = False,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: float | None = None,
        lr_wsd_decay_style: str = "exponential",
    ) -> None:
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr}): check --min-lr")
        if decay_steps <= 0:
            raise ValueError(f"the decay length must be positive, got {decay_steps} samples")
        if not 0 <= warmup_steps < decay_steps:
            raise ValueError(
                f"the warmup ({warmup_steps} samples) must be shorter than the decay "
                f"({decay_steps} samples): check --lr-warmup-* and --lr-decay-*"
            )
        if decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {decay_style!r} is not one of {LR_DECAY_STYLES}")
        if decay_style == "WSD":
            _check_wsd(wsd_decay_steps, lr_wsd_decay_style, decay_steps)
        if weight_decay < 0.0:
            raise ValueError(f"--weight-decay must be non-negative, got {weight_decay}")
        if use_checkpoint_opt_param_scheduler and override_opt_param_scheduler:
            raise ValueError(
                "use_checkpoint_opt_param_scheduler and override_opt_param_scheduler "
                "contradict each other; set at most one"
            )
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.weight_decay = float(weight_decay)
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        """The learning rate after `num_steps` samples."""
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * float(self.num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        decay_ratio = float(self.num_steps - self.warmup_steps) / float(
            self.decay_steps - self.warmup_steps
        )
        if self.decay_style == "WSD":
            coefficient = self._wsd_coefficient()
        else:
            coefficient = _DECAY_SHAPES[self.decay_style](decay_ratio)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def _wsd_coefficient(self) -> float:
        # The final decay ends where the decay length does; before it the lr stays at max_lr.
        decay_start = self.decay_steps - self.wsd_decay_steps
        if self.num_steps <= decay_start:
            return 1.0
        ratio = float(self.num_steps - decay_start) / float(self.wsd_decay_steps)
        return _DECAY_SHAPES[self.lr_wsd_decay_style](ratio)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples (the global batch size per iteration), then set lr/wd."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's keys: max_lr, warmup_steps, num_steps, decay_style, decay_steps, min_lr;
        a WSD schedule adds wsd_decay_steps and lr_wsd_decay_style (which Megatron-Core does not
        save), so a resume keeps its final decay too."""
        state = {
            "max_lr": self.max_lr,
            "warmup_steps": self.warmup_steps,
            "num_steps": self.num_steps,
            "decay_style": self.decay_style,
            "decay_steps": self.decay_steps,
            "min_lr": self.min_lr,
        }
        if self.decay_style == "WSD":
            state["wsd_decay_steps"] = self.wsd_decay_steps
            state["lr_wsd_decay_style"] = self.lr_wsd_decay_style
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the sample count and reconcile the schedule values (see the class docstring).

        Older Megatron key names (start_lr, warmup_iter, end_iter, num_iters) are accepted.
        The WSD keys are compared only where the checkpoint has them (Megatron-Core's do not).
        Raises ValueError naming every value that differs, unless one of the two rules is set.
        """
        saved = {
            "max_lr": _first(state_dict, "start_lr", "max_lr"),
            "min_lr": state_dict["min_lr"],
            "warmup_steps": _first(state_dict, "warmup_iter", "warmup_steps"),
            "decay_steps": _first(state_dict, "end_iter", "decay_steps"),
            "decay_style": state_dict["decay_style"],
        }
        for name in _WSD_KEYS:
            if name in state_dict:
                saved[name] = state_dict[name]
        current = {name: getattr(self, name) for name in saved}
        differing = [name for name in saved if saved[name] != current[name]]
        if differing and not (
            self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler
        ):
            described = "; ".join(
                f"{name} {saved[name]!r} in the checkpoint, {current[name]!r} now "
                f"({_SCHEDULE_FLAGS[name]})"
                for name in differing
            )
            raise ValueError(
                f"the learning-rate schedule differs from the checkpoint's: {described}; to "
                "continue with this run's schedule pass --override-opt_param-scheduler, to keep "
                "the checkpoint's pass --use-checkpoint-opt_param-scheduler, or restore the "
                "original flags"
            )
        if not self.override_opt_param_scheduler:
            for name, value in saved.items():
                setattr(self, name, value)
        # Megatron adds the checkpoint's count to a fresh scheduler's 0; assigning is the same
        # there and keeps a second load from counting twice.
        self.num_steps = 0
        self.step(_first(state_dict, "num_iters", "num_steps"))


# What sets each schedule value, for the mismatch message (lengths are counted in samples).
_SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_steps": "samples: --lr-warmup-iters x --global-batch-size, --lr-warmup-samples or "
    "--lr-warmup-fraction",
    "decay_steps": "samples: --lr-decay-iters (default --train-iters) x --global-batch-size, or "
    "--lr-decay-samples (default --train-samples)",
    "decay_style": "--lr-decay-style",
    "wsd_decay_steps": "samples: --lr-wsd-decay-iters x --global-batch-size, or "
    "--lr-wsd-decay-samples",
    "lr_wsd_decay_style": "--lr-wsd-decay-style",
}
_WSD_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")

# Each shape maps the decayed fraction r in [0, 1] to the share of max_lr - min_lr left.
_DECAY_SHAPES = {
    "linear": lambda ratio: 1.0 - ratio,
    "cosine": lambda ratio: 0.5 * (math.cos(math.pi * ratio) + 1.0),
    "exponential": lambda ratio: 2.0 * math.pow(0.5, ratio) - 1.0,
    "minus_sqrt": lambda ratio: 1.0 - math.sqrt(ratio),
}


def _check_wsd(wsd_decay_steps: float | None, style: str, decay_steps: float) -> None:
    if wsd_decay_steps is None:
        raise ValueError(
            "--lr-decay-style WSD needs the length of its final decay: add "
            "--lr-wsd-decay-iters or --lr-wsd-decay-samples"
        )
    if not 0 <= wsd_decay_steps <= decay_steps:
        raise ValueError(
            f"WSD's final decay ({wsd_decay_steps} samples) must lie within the decay length "
            f"({decay_steps} samples): check --lr-wsd-decay-* and --lr-decay-*"
        )
    if style not in LR_WSD_DECAY_STYLES:
        raise ValueError(f"--lr-wsd-decay-style {style!r} is not one of {LR_WSD_DECAY_STYLES}")


def build_lr_scheduler(
    optimizer: Any,
    optimizer_config: OptimizerConfig,
    training_config: TrainingConfig,
    use_checkpoint_opt_param_scheduler: bool | None = None,
    override_opt_param_scheduler: bool | None = None,
) -> OptimizerParamScheduler:
    """The scheduler for a run, with warmup and decay lengths converted to samples.

    Runs measured in iterations multiply by the global batch size; a warmup fraction is a
    fraction of the decay samples. A missing decay length defaults to the run length; WSD's
    final decay is counted in the same unit as the run (Megatron-Core ignores the other). What
    a resume does with the checkpoint's schedule comes from the config's
    --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler unless given here.
    """
    config = optimizer_config
    if use_checkpoint_opt_param_scheduler is None:
        use_checkpoint_opt_param_scheduler = config.use_checkpoint_opt_param_scheduler
    if override_opt_param_scheduler is None:
        override_opt_param_scheduler = config.override_opt_param_scheduler
    if training_config.train_iters is not None:
        decay_iters = config.lr_decay_iters
        if decay_iters is None:
            decay_iters = training_config.train_iters
        decay_steps = decay_iters * training_config.global_batch_size
        warmup_steps: float = config.lr_warmup_iters * training_config.global_batch_size
        wsd_decay_steps = None
        if config.lr_wsd_decay_iters is not None:
            wsd_decay_steps = config.lr_wsd_decay_iters * training_config.global_batch_size
    elif training_config.train_samples is not None:
        decay_steps = config.lr_decay_samples
        if decay_steps is None:
            decay_steps = training_config.train_samples
        warmup_steps = config.lr_warmup_samples
        wsd_decay_steps = config.lr_wsd_decay_samples
    else:
        raise ValueError("the training config has neither train_iters nor train_samples")
    if config.lr_warmup_fraction is not None:
        warmup_steps = config.lr_warmup_fraction * decay_steps
    return OptimizerParamScheduler(
        optimizer,
        max_lr=config.lr,
        min_lr=config.min_lr,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_style=config.lr_decay_style,
        weight_decay=config.weight_decay,
        use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=config.lr_wsd_decay_style,
    )


def _first(state_dict: Dict[str, Any], legacy_key: str, key: str) -> Any:
    return state_dict[legacy_key] if legacy_key in state_dict else state_dict[key]
