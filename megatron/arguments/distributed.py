"""Megatron-LM's flags of the distributed layout: parallel degrees, the backend, data
parallelism's implementation and its gradient reduction."""

from __future__ import annotations

import argparse


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="distributed")
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor model-parallel degree: attention heads, MLP channels and the vocabulary "
        "are split over this many adjacent ranks.",
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline model-parallel degree: the layers are split into this many stages, "
        "run with the 1F1B schedule.",
    )
    group.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Expert model-parallel degree (Megatron-core's flag): each MoE layer's experts are "
        "split over this many adjacent data-parallel ranks, tokens exchanged by all-to-all; "
        "must divide the data-parallel size and the number of experts.",
    )
    group.add_argument(
        "--moe-expert-model-parallelism",
        action="store_true",
        help="MegaBlocks' switch for --expert-model-parallel-size = the data-parallel size.",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual stage: each pipeline rank holds several chunks of this many "
        "layers and runs the interleaved 1F1B schedule.",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="With tensor parallelism, also split the norms, dropouts and residual stream "
        "along the sequence (all-gather before and reduce-scatter after the parallel layers).",
    )
    group.add_argument(
        "--distributed-backend",
        default="nccl",
        choices=["nccl", "gloo"],
        help="torch.distributed backend.",
    )
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="How long a collective waits for the other ranks before the run stops, naming the "
        "ranks that never arrived (Megatron's flag; fractions of a minute are accepted).",
    )
    group.add_argument(
        "--DDP-impl",
        default=None,
        choices=["local", "torch"],
        help="Megatron-LM's data-parallel engine (its default: local). Accepted with a note and "
        "no effect: here the data-parallel mode reduces the gradients (torch DDP, or "
        "--use-distributed-optimizer's or --use-torch-fsdp2's reduce-scatter).",
    )
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the fp32 master weights and optimizer state over the data-parallel ranks "
        "(ZeRO-1; expert-parallel parameters over the expert-data-parallel ranks): gradients "
        "are reduce-scattered and parameters all-gathered instead of DDP's all-reduce. With "
        "--bf16 or --fp16 the weights the products read are held in that dtype and gathered "
        "in it; checkpoints still hold fp32 weights.",
    )
    group.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="With --use-distributed-optimizer: reduce-scatter each bucket of gradients while "
        "the last micro-batch's backward still runs, instead of all of them after it (torch "
        "DDP, used without the distributed optimizer, always overlaps its all-reduce).",
    )
    group.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="Parameters per gradient bucket of --overlap-grad-reduce (a bucket closes once it "
        "holds at least this many); default max(40M, 1M x the data-parallel size), as Megatron.",
    )
    group.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="Shard weights, gradients and optimizer state over the data-parallel ranks with "
        "torch's fully_shard (FSDP2), one unit per transformer layer, each unit's weights "
        "gathered for its forward and backward (Megatron-Core's flag; torch 2.6 or newer). "
        "Experts shard over the expert-data-parallel ranks.",
    )
    group.add_argument(
        "--data-parallel-replicate-degree",
        type=int,
        default=1,
        help="With --use-torch-fsdp2: hybrid sharding (HSDP). The data-parallel ranks split into "
        "this many replicas, each a group of consecutive ranks (e.g. one per node); weights, "
        "gradients and optimizer state shard within a replica and are replicated across them, "
        "whose gradients are all-reduced (torchtitan's name). 1: shard over every data-parallel "
        "rank.",
    )
    group.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="Megatron-Core's partial distributed optimizer (several instances, each sharding "
        "over a subset of the data-parallel ranks): not implemented; refused above 1 (see "
        "--data-parallel-replicate-degree).",
    )
    group.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="With --use-torch-fsdp2 and --bf16: reduce-scatter gradients in bf16 (half the "
        "bytes) instead of fp32 (Megatron-Core's flag).",
    )
    group.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="With --overlap-grad-reduce: leave the distributed optimizer's parameter all-gather "
        "in flight after the step, each transformer layer waiting for its own parameters just "
        "before its forward.",
    )
