"""Checks of the learning-rate schedule's flags, and the decay length's default (Megatron's
validate_args fills --lr-decay-iters/--lr-decay-samples from the run length).

A run measured in iterations gives every schedule length in iterations, one measured in
samples in samples; megatron/optimizer/lr_schedule.py converts them to samples.
"""

from __future__ import annotations

import argparse

from megatron.config.errors import ConfigError


def resolve_lr_schedule(args: argparse.Namespace) -> None:
    """Refuse schedules that cannot run and fill `lr_decay_iters`/`lr_decay_samples`."""
    if (args.train_iters is None) == (args.train_samples is None):
        given = "both were given" if args.train_iters is not None else "neither was given"
        raise ConfigError(f"give exactly one of --train-iters and --train-samples; {given}")
    if args.train_iters is not None:
        unit, other = "iters", "samples"
    else:
        unit, other = "samples", "iters"
    if (
        getattr(args, f"lr_decay_{other}") is not None
        or getattr(args, f"lr_warmup_{other}")
        or getattr(args, f"lr_wsd_decay_{other}") is not None
    ):
        raise ConfigError(
            f"--train-{unit} measures the run in {unit}, so the schedule must too: replace "
            f"--lr-decay-{other}/--lr-warmup-{other}/--lr-wsd-decay-{other} with "
            f"--lr-decay-{unit}/--lr-warmup-{unit}/--lr-wsd-decay-{unit}"
        )
    warmup = getattr(args, f"lr_warmup_{unit}")
    if args.lr_warmup_fraction is not None and warmup != 0:
        raise ConfigError(
            f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-{unit} {warmup} "
            "both set the warmup; give only one"
        )
    decay_name = f"lr_decay_{unit}"
    if getattr(args, decay_name) is None:
        setattr(args, decay_name, getattr(args, f"train_{unit}"))
    decay = getattr(args, decay_name)
    if warmup >= decay:
        raise ConfigError(
            f"--lr-warmup-{unit} {warmup} must be smaller than the decay length "
            f"--lr-decay-{unit} {decay} (which defaults to --train-{unit})"
        )
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    _check_wsd(args, unit, decay)


def _check_wsd(args: argparse.Namespace, unit: str, decay: int) -> None:
    wsd_decay = getattr(args, f"lr_wsd_decay_{unit}")
    style = args.lr_decay_style
    if style == "WSD" and wsd_decay is None:
        raise ConfigError(
            f"--lr-decay-style WSD needs the length of its final decay: add "
            f"--lr-wsd-decay-{unit} N (the last N {unit} of --lr-decay-{unit})"
        )
    if style != "WSD" and wsd_decay is not None:
        raise ConfigError(
            f"--lr-wsd-decay-{unit} {wsd_decay} is the final decay of --lr-decay-style WSD, "
            f"but --lr-decay-style is {style}: add --lr-decay-style WSD or drop "
            f"--lr-wsd-decay-{unit}"
        )
    if wsd_decay is None:
        return
    if wsd_decay < 0:
        raise ConfigError(f"--lr-wsd-decay-{unit} must be >= 0, got {wsd_decay}")
    if wsd_decay > decay:
        raise ConfigError(
            f"--lr-wsd-decay-{unit} {wsd_decay} is longer than the decay length "
            f"--lr-decay-{unit} {decay} (which defaults to --train-{unit}) that it ends: "
            f"give at most {decay}"
        )
