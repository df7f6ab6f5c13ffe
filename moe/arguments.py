"""The `--moe-*` flags, MegaBlocks' names (and Megatron-Core's, moe.megatron_core_flags); pass
`add_moe_args` to `build_parser`.

namespace = parse_arguments(argv, extra_groups=[add_moe_args])

A setting with a Megatron-Core spelling too, or whose default depends on which name declared
the experts, parses to None when not given; moe.megatron_core_flags.resolve_moe_arguments fills
it, the one place its default is decided (MEGABLOCKS_DEFAULTS for --moe-num-experts).
"""

from __future__ import annotations

import argparse

from megatron.config.layer_pattern import layer_frequency
from moe.config import (
    GROUPED_GEMM_KERNELS,
    LOAD_BALANCING_TYPES,
    MLP_IMPLS,
    MLP_TYPES,
    ROUTER_DTYPES,
    ROUTER_SCORES,
)
from moe.exchange_flags import DEFAULT_EXCHANGE_CHUNKS
from moe.megatron_core_flags import add_megatron_core_moe_args

# The flags (namespace attributes) that define an MoE model, which a checkpoint's saved
# arguments are compared on when it is loaded (megatron.checkpointing.model_arguments).
MOE_MODEL_ARGUMENTS = (
    "moe_num_experts",
    "moe_top_k",
    "moe_dropless",
    "moe_capacity_factor",
    "moe_normalize_expert_weights",
    "moe_layer_freq",
    "mlp_type",
    "moe_router_score",
    "moe_router_bias_update_rate",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_shared_expert",
    "moe_shared_expert_ffn_hidden_size",
    "moe_ffn_hidden_size",
    # Megatron-Core's capacity rounds up (moe.megatron_core_flags.capacity_rounds_up), and
    # its default policy drops by weight.
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
)

# Flags that choose the saving run's kernels, which a checkpoint's saved config does not keep
# (megatron.composition.extension.RunExtension.kernel_arguments).
MOE_KERNEL_ARGUMENTS = ("moe_grouped_gemm_kernel",)


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """Register the mixture-of-experts argument groups on `parser`: MegaBlocks' and this
    project's names, then Megatron-Core's."""
    group = parser.add_argument_group(
        title="mixture of experts",
        description="MegaBlocks' names (--moe-num-experts, --moe-top-k, --moe-loss-weight, ...), "
        "Megatron-Core's where marked, and this project's. Defaults below are those of "
        "--moe-num-experts; --num-experts takes Megatron-Core's (its group, further down).",
    )
    group.add_argument(
        "--moe-num-experts",
        type=int,
        default=None,
        help="Experts per MoE layer, with MegaBlocks' defaults; unset (and no --num-experts): "
        "every layer keeps its dense MLP.",
    )
    group.add_argument(
        "--moe-top-k", type=int, default=None, help="Experts each token is routed to (1)."
    )
    group.add_argument(
        "--moe-dropless",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Dropless dMoE (default). --no-moe-dropless builds MegaBlocks' MoE, whose "
        "experts drop assignments beyond --moe-capacity-factor.",
    )
    group.add_argument(
        "--moe-capacity-factor",
        type=float,
        default=None,
        help="With --no-moe-dropless: expert capacity is int(factor * top_k * tokens / "
        "experts) assignments (1.0); 0 means no limit. Unused by the dropless dMoE.",
    )
    group.add_argument(
        "--moe-loss-weight",
        type=float,
        default=None,
        help="Weight of the MEAN of the MoE layers' load-balancing losses (0.1); Megatron-Core's "
        "--moe-aux-loss-coeff weights each layer's, so this is it times the MoE layers.",
    )
    group.add_argument(
        "--moe-zloss-weight",
        type=float,
        default=None,
        help="Weight of the mean of the MoE layers' router z-losses mean(logsumexp(logits)^2) "
        "(1e-3 is typical); 0 (default): off.",
    )
    group.add_argument(
        "--moe-jitter-eps",
        type=float,
        default=None,
        help="In training, multiply router inputs by U(1-eps, 1+eps) noise.",
    )
    group.add_argument(
        "--moe-normalize-expert-weights",
        type=float,
        default=None,
        help="Divide each token's top-k weights by their p-norm with this p (1: sum to 1).",
    )
    group.add_argument(
        "--moe-layer-freq",
        type=layer_frequency,
        default=1,
        help="Which layers are MoE layers (Megatron-core's flag and meanings): an integer N "
        "makes every N-th layer one, starting with layer 0 (layer i when i %% N == 0); or a "
        'list expression with one 0 (dense MLP) or 1 (MoE) per layer, e.g. "([0]*1+[1]*11)" '
        "for a dense first layer and 11 MoE layers.",
    )
    group.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        default=None,
        help="(Megatron-core's flag) Each expert's FFN hidden size, e.g. small fine-grained "
        "experts; the dense MLPs of the other layers keep --ffn-hidden-size. Unset: the "
        "experts take --ffn-hidden-size.",
    )
    group.add_argument(
        "--moe-impl",
        "--mlp-impl",
        dest="mlp_impl",
        default="grouped",
        choices=MLP_IMPLS,
        help="Expert computation: grouped GEMM (default), block-sparse (dropless only), or "
        "a per-expert loop (reference, for testing).",
    )
    group.add_argument(
        "--moe-grouped-gemm-kernel",
        default="auto",
        choices=GROUPED_GEMM_KERNELS,
        help="The dMoE's grouped GEMM. auto (default): torch._grouped_mm on Hopper in bf16, else "
        "the project's Triton kernels. quack: QuACK's varlen grouped GEMM (the optional "
        "quack-kernels package: NVIDIA Hopper or Blackwell, bf16), compiled with the model; "
        "refused at start-up where it cannot run.",
    )
    group.add_argument(
        "--mlp-type",
        default=None,
        choices=MLP_TYPES,
        help="Expert MLP: mlp (GELU) or glu (gated; SwiGLU with --swiglu, else GeGLU). "
        "Defaults to glu with --swiglu, mlp otherwise.",
    )
    group.add_argument(
        "--moe-router-score",
        default=None,
        choices=ROUTER_SCORES,
        help="Router score function: softmax over experts (default), or per-expert sigmoid, "
        "its chosen scores the weights as they are (Megatron-Core's "
        "--moe-router-score-function sigmoid normalizes them).",
    )
    group.add_argument(
        "--moe-router-bias-update-rate",
        type=float,
        default=None,
        help="(Megatron-Core's flag) DeepSeek-V3 auxiliary-loss-free balancing: a per-expert "
        "bias added to the scores for expert selection only, moved by this rate toward balance "
        "after each micro-batch. With --moe-num-experts a rate > 0 turns it on; with "
        "--num-experts only --moe-router-enable-expert-bias does (rate 1e-3 unless given).",
    )
    group.add_argument(
        "--moe-router-load-balancing-type",
        default="aux_loss",
        help="(Megatron-Core's flag) What the load-balancing loss balances: aux_loss, each "
        "micro-batch's assignments (MegaBlocks'; default); seq_aux_loss, each sequence's "
        "(DeepSeek-V2's); global_aux_loss, the step's over all micro-batches and data-parallel "
        f"ranks (Qwen's global-batch balancing); none, no loss. One of {LOAD_BALANCING_TYPES} "
        "(Megatron-Core's sinkhorn and quantile_balancing are not implemented).",
    )
    group.add_argument(
        "--moe-router-dtype",
        default=None,
        help=f"(Megatron-Core's flag) Compute the gate's logits and the routing weights in this "
        f"precision, one of {tuple(ROUTER_DTYPES)}; default: the run's compute dtype (MegaBlocks').",
    )
    group.add_argument(
        "--moe-router-pre-softmax",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="(Megatron-Core's flag) Weight each chosen expert by its softmax score over all "
        "experts (MegaBlocks' and Switch's rule; the default with --moe-num-experts). "
        "--no-moe-router-pre-softmax takes the softmax over the chosen experts' logits alone "
        "(the default with --num-experts, Megatron-Core's, Mixtral's weights; at top-1 every "
        "weight is 1).",
    )
    group.add_argument(
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help="(Megatron-Core's flag) Multiply the routing weights by this factor (after "
        "--moe-normalize-expert-weights); default: no scaling.",
    )
    group.add_argument(
        "--moe-router-force-load-balancing",
        action="store_true",
        help="For benchmarks (Megatron-core's flag): each token goes to experts drawn uniformly "
        "at random instead of the router's top-k, weighted by the router's scores for them, so "
        "that every expert and expert-parallel rank gets about the same load. Not for training "
        "a model.",
    )
    group.add_argument(
        "--moe-expert-parallel-buffer-factor",
        type=float,
        default=None,
        help="Under expert parallelism, exchange the dMoE's rows in fixed-size blocks of this "
        "many times the balanced share (no host sync per layer) instead of exact splits; a step "
        "whose routing needs larger blocks runs again with them (still dropless), and the "
        "factor stays grown.",
    )
    group.add_argument(
        "--moe-expert-parallel-chunked-overlap",
        action="store_true",
        help="(This project's flag) Hide one micro-batch's expert-parallel all-to-alls behind "
        "its own experts: the fixed-size blocks (--moe-expert-parallel-buffer-factor) are cut "
        "into --moe-expert-parallel-comm-chunks chunks whose exchanges run while the other "
        "chunks' experts compute, forward and backward.",
    )
    group.add_argument(
        "--moe-expert-parallel-comm-chunks",
        type=int,
        default=DEFAULT_EXCHANGE_CHUNKS,
        help="Chunks per layer under --moe-expert-parallel-chunked-overlap: about 1/K of the "
        "exchange stays exposed, at K times the launches (docs/moe.md).",
    )
    group.add_argument(
        "--moe-shared-expert",
        action="store_true",
        help="Add a dense MLP every token goes through to the experts' output.",
    )
    group.add_argument(
        "--moe-shared-expert-ffn-hidden-size",
        type=int,
        default=None,
        help="Hidden size of the shared expert; defaults to --ffn-hidden-size (the dense "
        "MLP's, not --moe-ffn-hidden-size: the shared expert is a dense MLP beside the experts; "
        "Megatron-core's --moe-shared-expert-intermediate-size has no default).",
    )
    group.add_argument(
        "--moe-per-layer-logging",
        action="store_true",
        help="(Megatron-Core's flag) Write each MoE layer's unweighted auxiliary losses, their "
        "mean over the --log-interval window, to TensorBoard and W&B; and after each iteration "
        "line, log each MoE layer's expert load (max and min tokens per expert over the mean; "
        "TensorBoard and W&B get it whenever --tensorboard-dir or --wandb-project is set).",
    )
    group.add_argument(
        "--moe-memory-optimized-mlp",
        action="store_true",
        help="Recompute the expert activation (and second projection) in backward instead "
        "of storing them.",
    )
    add_megatron_core_moe_args(parser)
