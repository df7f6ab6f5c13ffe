"""Checks of the optimizer-state flags: dtypes (--use-precision-aware-optimizer and its
--*-dtype flags) and host offload (--optimizer-cpu-offload); megatron/optimizer/precision.py
says what each changes."""

from __future__ import annotations

import argparse

from megatron.config.errors import ConfigError, flag_name


def check_optimizer_memory(args: argparse.Namespace) -> None:
    """The optimizer-state dtypes and offload (megatron/optimizer/precision.py)."""
    lowered = [
        name
        for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if getattr(args, name) != "fp32"
    ]
    if lowered and args.use_torch_fsdp2:
        # Not "add --use-precision-aware-optimizer": FSDP2 refuses that too.
        flag = flag_name(lowered[0])
        also = (
            "; to reduce the gradients in bf16, use --grad-reduce-in-bf16"
            if lowered[0] == "main_grads_dtype"
            else ""
        )
        raise ConfigError(
            f"{flag} {getattr(args, lowered[0])} lowers the distributed optimizer's state "
            "(--use-precision-aware-optimizer), and --use-torch-fsdp2 keeps its own fp32 "
            f"gradient and Adam shards: drop {flag}{also}"
        )
    if lowered and not args.use_precision_aware_optimizer:
        raise ConfigError(
            f"{flag_name(lowered[0])} {getattr(args, lowered[0])} needs "
            "--use-precision-aware-optimizer; add it, or leave the dtype at fp32"
        )
    if args.main_params_dtype != "fp32":
        raise ConfigError(
            f"--main-params-dtype {args.main_params_dtype} is not supported: the model's own "
            "parameters are its fp32 master weights here (mixed precision is autocast), so "
            "they stay fp32; lower --exp-avg-dtype, --exp-avg-sq-dtype and --main-grads-dtype "
            "instead, or offload with --optimizer-cpu-offload"
        )
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(args, name) == "fp16":
            raise ConfigError(
                f"{flag_name(name)} fp16 is not supported: Adam's second moment underflows fp16 "
                "without a per-tensor scale, which this framework does not keep; use bf16 "
                "(same bytes, fp32's range)"
            )
    if args.optimizer != "adam" and (
        args.use_precision_aware_optimizer or args.optimizer_cpu_offload
    ):
        flag = (
            "--use-precision-aware-optimizer"
            if args.use_precision_aware_optimizer
            else "--optimizer-cpu-offload"
        )
        raise ConfigError(f"{flag} works with --optimizer adam only, not {args.optimizer}")
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise ConfigError(
            f"--optimizer-offload-fraction must be in [0, 1], got {args.optimizer_offload_fraction}"
        )
