"""Megatron-Core's model switches (megatron.arguments.megatron_core) read against the run: an
implementation choice this project has one of gets a note, a feature it lacks is refused in one
line naming what to use instead.
"""

from __future__ import annotations

import argparse
from typing import List

from megatron.arguments.megatron_core import NO_EFFECT_SWITCHES
from megatron.config.errors import ConfigError


def check_megatron_core_switches(args: argparse.Namespace, notes: List[str]) -> None:
    """ConfigError for a switch that asks for a missing feature; a note for each accepted one
    given. Reads the model's shape, so runs after it is resolved."""
    _refuse_missing_features(args)
    if getattr(args, "use_mcore_models", False):
        notes.append("--use-mcore-models: this project has one GPT model; no effect")
    impl = getattr(args, "transformer_impl", None)
    if impl is not None:
        notes.append(
            f"--transformer-impl {impl}: the layers are this project's PyTorch modules; no effect"
        )
    backend = getattr(args, "attention_backend", None)
    if backend is not None:
        notes.append(
            f"--attention-backend {backend}: attention runs through torch SDPA, which picks the "
            "device's kernel; no effect"
        )
    if not getattr(args, "add_position_embedding", True):
        if args.position_embedding_type != "rope":
            # Megatron-Core refuses it too: the flag is its deprecated spelling of rope.
            raise ConfigError(
                "--no-position-embedding with --position-embedding-type "
                f"{args.position_embedding_type}: a model without position embeddings is not "
                "implemented here; use --position-embedding-type rope"
            )
        notes.append(
            "--no-position-embedding: --position-embedding-type rope has no position table; "
            "no effect"
        )
    for flag, why in NO_EFFECT_SWITCHES.items():
        if getattr(args, flag[2:].replace("-", "_"), False):
            notes.append(f"{flag}: {why}; no effect")
    impl = getattr(args, "cross_entropy_fusion_impl", None)
    if impl in ("native", "te"):
        notes.append(
            f"--cross-entropy-fusion-impl {impl}: the loss is this project's own cross-entropy "
            "kernel; no effect"
        )
    if getattr(args, "log_throughput", False):
        notes.append(
            "--log-throughput: the iteration line always holds the throughput (TFLOP/s per GPU, "
            "tokens per second); no effect"
        )


def _refuse_missing_features(args: argparse.Namespace) -> None:
    tensor = getattr(args, "tensor_model_parallel_size", 1)
    if getattr(args, "cross_entropy_fusion_impl", None) == "linear" and tensor > 1:
        raise ConfigError(
            f"--cross-entropy-fusion-impl linear with --tensor-model-parallel-size {tensor}: the "
            "fused output layer and cross-entropy run on one rank's whole vocabulary here; drop "
            "the flag (the vocabulary-parallel loss keeps only this rank's share of the logits)"
        )
    head_width = args.hidden_size // args.num_attention_heads
    kv_channels = getattr(args, "kv_channels", None)
    if kv_channels is not None and kv_channels != head_width:
        raise ConfigError(
            f"--kv-channels {kv_channels}: attention heads of a width other than --hidden-size "
            f"{args.hidden_size} / --num-attention-heads {args.num_attention_heads} = "
            f"{head_width} are not implemented here; drop --kv-channels or give {head_width}"
        )
    if getattr(args, "qk_layernorm", False):
        raise ConfigError(
            "--qk-layernorm: normalizing the attention's queries and keys is not implemented "
            "here; drop the flag"
        )
    if getattr(args, "multi_latent_attention", False):
        raise ConfigError(
            "--multi-latent-attention: multi-latent attention is not implemented here; drop "
            "the flag (--group-query-attention --num-query-groups N shrinks the keys and values)"
        )
    context = getattr(args, "context_parallel_size", 1)
    if context != 1:
        raise ConfigError(
            f"--context-parallel-size {context}: context parallelism is not implemented here; "
            "use 1 (--tensor-model-parallel-size with --sequence-parallel splits long sequences' "
            "activations instead)"
        )
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp:
        raise ConfigError(
            f"--mtp-num-layers {mtp}: multi-token prediction is not implemented here; drop the flag"
        )
