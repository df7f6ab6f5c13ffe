"""Megatron-LM's flags that shape the model: network size, regularization, initialization,
mixed precision.
"""

from __future__ import annotations

import argparse


def add_network_size_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Transformer feed-forward hidden size. Defaults to 4*hidden-size, or with --swiglu "
        "to 2/3 of that rounded down to a multiple of 64.",
    )
    group.add_argument(
        "--num-attention-heads", type=int, default=None, help="Number of attention heads."
    )
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention (see --num-query-groups).",
    )
    group.add_argument(
        "--num-query-groups",
        type=int,
        default=1,
        help="Number of key/value head groups with --group-query-attention.",
    )
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Size of the learned position embedding table; must be >= --seq-length.",
    )
    group.add_argument(
        "--position-embedding-type",
        type=str,
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
        help="Position embedding type.",
    )
    group.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="Fraction of each head's channels that rotary embeddings rotate.",
    )
    group.add_argument(
        "--rotary-base", type=int, default=10000, help="Base period of rotary embeddings."
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocab size to a multiple of this value (times the tensor-parallel size).",
    )
    group.add_argument(
        "--normalization",
        default="LayerNorm",
        choices=["LayerNorm", "RMSNorm"],
        help="Normalization layer.",
    )
    group.add_argument(
        "--layernorm-epsilon",
        "--norm-epsilon",
        dest="layernorm_epsilon",
        type=float,
        default=1e-5,
        help="Epsilon of LayerNorm / RMSNorm (--norm-epsilon is the newer Megatron name).",
    )
    group.add_argument(
        "--swiglu", action="store_true", help="Use a SwiGLU MLP (SiLU-gated) instead of GeLU."
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Give the output layer its own weights instead of sharing the input embedding.",
    )
    group.add_argument(
        "--disable-bias-linear",
        action="store_false",
        dest="add_bias_linear",
        help="Drop the bias of every linear layer in the transformer.",
    )


def add_regularization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="regularization")
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Post-attention dropout probability."
    )
    group.add_argument(
        "--hidden-dropout", type=float, default=0.1, help="Hidden-state dropout probability."
    )
    group.add_argument(
        "--weight-decay", type=float, default=0.01, help="Decoupled weight decay coefficient."
    )
    group.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Clip gradients to this global L2 norm; 0 disables clipping.",
    )
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")


def add_initialization_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="initialization")
    group.add_argument(
        "--seed", type=int, default=1234, help="Random seed for python, numpy and torch."
    )
    group.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Standard deviation of the zero-mean normal weight initialization.",
    )


def add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="Train in float16 with loss scaling.")
    group.add_argument("--bf16", action="store_true", help="Train in bfloat16.")
    group.add_argument(
        "--fp8-format",
        choices=["e4m3", "hybrid"],
        default=None,
        help="Multiply the attention and MLP projections in FP8 (with --bf16; never the "
        "embedding, output layer, norms or loss): e4m3 everywhere, or hybrid (e5m2 gradients).",
    )
    group.add_argument(
        "--fp8-recipe",
        choices=["tensorwise", "rowwise"],
        default="tensorwise",
        help="FP8 scaling: one dynamic scale per tensor, or per row (more accurate, slower).",
    )
    group.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="Static fp16 loss scale (a positive power of 2 is best); dynamic if unset.",
    )
    group.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2**32,
        help="Starting dynamic loss scale.",
    )
    group.add_argument(
        "--min-loss-scale", type=float, default=1.0, help="Smallest dynamic loss scale."
    )
    group.add_argument(
        "--loss-scale-window",
        type=float,
        default=1000,
        help="Overflow-free iterations before the dynamic loss scale grows.",
    )
    group.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="Overflows tolerated before the dynamic loss scale shrinks.",
    )
    group.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Accumulate and all-reduce gradients in fp32 (always on with --bf16 and local DDP).",
    )
