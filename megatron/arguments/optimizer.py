"""Megatron-Core's flags for the optimizer state's dtypes and its offload to the host."""

from __future__ import annotations

import argparse


def add_optimizer_memory_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-Core's flags for the dtypes of the optimizer's state and its host offload."""
    group = parser.add_argument_group(title="optimizer state precision and offload")
    group.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="Keep the main gradients and Adam's moments in the dtypes below (the update is "
        "still computed in fp32, tensor by tensor); needed for any dtype but fp32.",
    )
    group.add_argument(
        "--main-grads-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="Dtype the gradients are accumulated and reduced in (with "
        "--use-precision-aware-optimizer).",
    )
    group.add_argument(
        "--main-params-dtype",
        default="fp32",
        choices=["fp32", "fp16"],
        help="Dtype of the master weights (with --use-precision-aware-optimizer); only fp32 "
        "here, where the model's own parameters are the fp32 master weights.",
    )
    for name, moment in (("exp-avg", "first"), ("exp-avg-sq", "second")):
        group.add_argument(
            f"--{name}-dtype",
            default="fp32",
            choices=["fp32", "fp16", "bf16"],
            help=f"Dtype of Adam's {moment} moment (with --use-precision-aware-optimizer); "
            "fp16 moments carry a power-of-two scale per tensor.",
        )
    group.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="Keep --optimizer-offload-fraction of the optimizer's state (Adam's moments and an "
        "fp32 copy of the weights) in pinned host memory and update those parameters there.",
    )
    group.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="Share of the parameters (by element count) whose optimizer state is offloaded "
        "with --optimizer-cpu-offload, in [0, 1].",
    )
