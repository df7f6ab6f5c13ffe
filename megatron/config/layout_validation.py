"""The distributed layout's flags checked and resolved (part of megatron.config.validation):
the parallel degrees against the world size and the model's shapes, and how gradients and
parameters are synchronized."""

from __future__ import annotations

import argparse
from typing import List

import torch

from megatron import torch_floors
from megatron.config.errors import ConfigError


def resolve_parallelism(args: argparse.Namespace, world_size: int) -> None:
    tensor, pipeline = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    model_parallel = tensor * pipeline
    if world_size % model_parallel != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"{tensor} x --pipeline-model-parallel-size {pipeline} (= {model_parallel}); "
            "launch a multiple of that many processes or lower the parallel sizes"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel
    _resolve_expert_parallelism(args)


def _resolve_expert_parallelism(args: argparse.Namespace) -> None:
    """Expert parallelism is a degree of the layout, carved out of data parallelism (as in
    Megatron-core): MegaBlocks' switch asks for all of it, and any size must divide it. Whether
    the model has experts to split, and how many, its MoE extension checks."""
    size = args.expert_model_parallel_size
    if args.moe_expert_model_parallelism:
        if size != 1:
            raise ConfigError(
                "--moe-expert-model-parallelism (expert parallel size = data-parallel size) "
                f"and --expert-model-parallel-size {size} both set it; pass one of them"
            )
        size = args.data_parallel_size
    if size < 1:
        raise ConfigError(f"--expert-model-parallel-size must be >= 1, got {size}")
    if args.data_parallel_size % size != 0:
        raise ConfigError(
            f"--expert-model-parallel-size {size} does not divide the data-parallel size "
            f"{args.data_parallel_size} (world size / (--tensor-model-parallel-size x "
            "--pipeline-model-parallel-size)): experts are sharded over data-parallel ranks; "
            f"choose an expert parallel size that divides {args.data_parallel_size}, or launch "
            f"a multiple of {size} data-parallel ranks"
        )
    args.expert_model_parallel_size = size


def check_tensor_parallel(args: argparse.Namespace, notes: List[str]) -> None:
    """Every split tensor-parallel layers make must come out even (the padded vocabulary is
    made divisible when the tokenizer is built, as in Megatron)."""
    tensor = args.tensor_model_parallel_size
    if args.sequence_parallel and tensor == 1:
        # Megatron turns it off silently; say so.
        args.sequence_parallel = False
        notes.append(
            "--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled"
        )
    if tensor == 1:
        return
    world_size = args.world_size
    splits = [
        ("--num-attention-heads", args.num_attention_heads, "attention heads"),
        ("--hidden-size", args.hidden_size, "the hidden size"),
        ("--ffn-hidden-size", args.ffn_hidden_size, "MLP channels"),
    ]
    if args.group_query_attention:
        splits.append(("--num-query-groups", args.num_query_groups, "key/value heads"))
    if args.sequence_parallel:
        splits.append(("--seq-length", args.seq_length, "the sequence (--sequence-parallel)"))
    for flag, value, what in splits:
        if value % tensor != 0:
            raise ConfigError(
                f"{flag} {value} is not divisible by --tensor-model-parallel-size {tensor}: "
                f"{what} are split evenly over the tensor-parallel ranks (world size "
                f"{world_size}); choose sizes that {tensor} divides, or a smaller "
                "--tensor-model-parallel-size"
            )


def check_pipeline_parallel(args: argparse.Namespace) -> None:
    """Megatron's pipeline split: equal layers per stage (and per virtual stage), micro-batches
    a multiple of the stages for the interleaved schedule; sets the virtual pipeline size."""
    pipeline = args.pipeline_model_parallel_size
    per_virtual_stage = args.num_layers_per_virtual_pipeline_stage
    args.virtual_pipeline_model_parallel_size = None
    if pipeline == 1:
        if per_virtual_stage is not None:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual_stage} needs "
                "--pipeline-model-parallel-size above 1 (it interleaves pipeline stages)"
            )
        return
    if args.num_layers % pipeline != 0:
        raise ConfigError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pipeline}: every stage holds the same number of layers"
        )
    if per_virtual_stage is None:
        return
    per_stage = args.num_layers // pipeline
    if per_virtual_stage < 1 or per_stage % per_virtual_stage != 0:
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage {per_virtual_stage} does not divide the "
            f"{per_stage} layers of each stage (--num-layers {args.num_layers} / "
            f"--pipeline-model-parallel-size {pipeline})"
        )
    num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if num_micro_batches % pipeline != 0:
        raise ConfigError(
            f"the interleaved pipeline schedule needs the number of micro-batches "
            f"({num_micro_batches} = --global-batch-size {args.global_batch_size} / "
            f"(--micro-batch-size {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size})) to be divisible by --pipeline-model-parallel-size "
            f"{pipeline}"
        )
    args.virtual_pipeline_model_parallel_size = per_stage // per_virtual_stage


def check_gradient_sync(args: argparse.Namespace, notes: List[str]) -> None:
    """The distributed optimizer's overlaps build on each other, as in Megatron; FSDP2 takes
    the place of both data-parallel modes, composes with none of what it cannot, and says which
    of their flags it does without."""
    if args.num_distributed_optimizer_instances != 1:
        count = args.num_distributed_optimizer_instances
        raise ConfigError(
            f"--num-distributed-optimizer-instances {count} is Megatron-Core's partial "
            "distributed optimizer (instances each sharding the optimizer state over a subset "
            "of the data-parallel ranks), which this project does not have; drop it, or shard "
            f"within replicas with --use-torch-fsdp2 --data-parallel-replicate-degree {count}"
        )
    replicas = args.data_parallel_replicate_degree
    if args.use_torch_fsdp2:
        _check_fully_shard(args)
        _drop_what_fully_shard_does_itself(args, notes)
    elif replicas != 1 or args.grad_reduce_in_bf16:
        flag = "--grad-reduce-in-bf16" if replicas == 1 else "--data-parallel-replicate-degree"
        raise ConfigError(f"{flag} needs --use-torch-fsdp2 here; add it or drop {flag}")
    if args.overlap_param_gather and not (
        args.use_distributed_optimizer and args.overlap_grad_reduce
    ):
        raise ConfigError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
            "(it gathers the parameters in the buckets the overlapped reduce-scatter makes); "
            "add them or drop --overlap-param-gather"
        )


def _drop_what_fully_shard_does_itself(args: argparse.Namespace, notes: List[str]) -> None:
    """The other modes' flags for what FSDP2 always does, or does not use: a note each, and
    the flag reset so that nothing downstream reads it."""
    ignored = [
        (
            "overlap_grad_reduce",
            False,
            "--overlap-grad-reduce has no effect under --use-torch-fsdp2: FSDP2 reduce-scatters "
            "each layer's gradients during the backward anyway",
        ),
        (
            "overlap_param_gather",
            False,
            "--overlap-param-gather has no effect under --use-torch-fsdp2: FSDP2 gathers each "
            "layer's weights just before its forward, prefetching the next layer's, anyway",
        ),
    ]
    for name, unused, note in ignored:
        if getattr(args, name) != unused:
            setattr(args, name, unused)
            notes.append(f"{note}; drop the flag")


def _check_fully_shard(args: argparse.Namespace) -> None:
    """--use-torch-fsdp2's refusals: what it does not compose with, and hybrid groups that do
    not divide the data-parallel ranks."""
    floor = torch_floors.FULLY_SHARD
    if torch_floors.running_torch() < floor:
        raise ConfigError(
            f"--use-torch-fsdp2 needs torch {torch_floors.spelled(floor)} or newer "
            f"(torch.distributed.fsdp.fully_shard); this is torch {torch.__version__}: upgrade "
            f"torch or use --use-distributed-optimizer"
        )
    replicas = args.data_parallel_replicate_degree
    refused = [
        (
            args.use_distributed_optimizer,
            "--use-distributed-optimizer (FSDP2 shards the optimizer state itself)",
        ),
        (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1"),
        (args.fp8_format is not None, "--fp8-format"),
        (args.use_precision_aware_optimizer, "--use-precision-aware-optimizer"),
        (args.optimizer_cpu_offload, "--optimizer-cpu-offload"),
        (
            replicas > 1 and args.expert_model_parallel_size > 1,
            "--data-parallel-replicate-degree > 1 with --expert-model-parallel-size > 1",
        ),
        (args.grad_reduce_in_bf16 and not args.bf16, "--grad-reduce-in-bf16 without --bf16"),
        (
            args.ckpt_format == "torch",
            "--ckpt-format torch (it gathers every tensor on one rank; use torch_dist)",
        ),
    ]
    for bad, flag in refused:
        if bad:
            raise ConfigError(f"--use-torch-fsdp2 does not compose with {flag}; drop one")
    if replicas < 1 or args.data_parallel_size % replicas != 0:
        raise ConfigError(
            f"--data-parallel-replicate-degree {replicas} does not divide the "
            f"{args.data_parallel_size} data-parallel ranks into equal groups; choose a divisor "
            f"of {args.data_parallel_size}"
        )
