"""Megatron-Core's model-level switches, parsed so that its command lines run here unchanged:
those that choose an implementation this project has one of are accepted (a note says so), and
those that ask for a feature it lacks are refused, in one line naming what to use instead
(megatron.config.megatron_core_switches reads them).
"""

from __future__ import annotations

import argparse

# Megatron-Core's values of these flags (its TransformerConfig's transformer_impl and its
# AttnBackend enum).
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# Megatron-Core's switches of a fusion, a kernel or a host-side habit, where this project has one
# way of its own: accepted, a note each (megatron.config.megatron_core_switches), as the
# --no-*-fusion flags Megatron-LM had are. The value is why it has no effect here.
NO_EFFECT_SWITCHES = {
    "--no-rope-fusion": "the rotary embedding is plain PyTorch ops (megatron.model.rotary), "
    "which torch.compile fuses on GPUs",
    "--no-bias-swiglu-fusion": "the SwiGLU is plain PyTorch ops, which torch.compile fuses on GPUs",
    "--cross-entropy-loss-fusion": "the loss is this project's own cross-entropy kernel",
    "--no-persist-layer-norm": "the norms are this project's (megatron.model.norms)",
    "--attention-softmax-in-fp32": "torch SDPA's kernels keep the softmax in fp32",
    "--no-create-attention-mask-in-dataloader": "the data loader makes no attention mask "
    "(the attention is causal)",
    "--manual-gc": "Python's garbage collector is left to run as it does",
}
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te", "linear")


def add_megatron_core_model_args(parser: argparse.ArgumentParser) -> None:
    """Register Megatron-Core's model switches (group "Megatron-Core's model switches")."""
    group = parser.add_argument_group(
        title="Megatron-Core's model switches",
        description="Megatron-Core's names; an implementation choice is accepted with a note "
        "(this project has one implementation), a feature it lacks is refused.",
    )
    group.add_argument(
        "--use-mcore-models",
        action="store_true",
        help="Megatron-Core's (deprecated) switch to its GPT model: this project has one GPT "
        "model (megatron.model); accepted, no effect.",
    )
    group.add_argument(
        "--transformer-impl",
        default=None,
        choices=TRANSFORMER_IMPLS,
        help="Megatron-Core's layer implementation (Transformer Engine or its own): the layers "
        "here are this project's PyTorch modules whatever the choice; accepted, no effect.",
    )
    group.add_argument(
        "--attention-backend",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="Megatron-Core's attention kernel: attention here runs through torch SDPA, which "
        "picks the flash or memory-efficient kernel the device has; accepted, no effect.",
    )
    group.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="Megatron-Core's (deprecated) switch off of the learned position table: accepted "
        "with --position-embedding-type rope, which has none; refused otherwise.",
    )
    group.add_argument(
        "--log-throughput",
        action="store_true",
        help="Megatron-Core's switch for throughput in the iteration line: the line here always "
        "holds the TFLOP/s per GPU and the tokens per second; accepted, no effect.",
    )
    for flag, why in NO_EFFECT_SWITCHES.items():
        group.add_argument(flag, action="store_true", help=f"Accepted, no effect: {why}.")
    group.add_argument(
        "--cross-entropy-fusion-impl",
        default=None,
        choices=CROSS_ENTROPY_FUSION_IMPLS,
        help="Megatron-Core's cross-entropy kernel. linear: the output layer and the "
        "cross-entropy fused, so that the [tokens x vocabulary] logits are never stored (one "
        "more output-layer product in the backward; tensor-parallel size 1); native, te: "
        "accepted, no effect (the loss is this project's own cross-entropy kernel).",
    )
    group.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="Channels per attention head: accepted when it is --hidden-size / "
        "--num-attention-heads (Megatron-Core's default); heads of another width are not "
        "implemented here.",
    )
    group.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Megatron-Core's normalization of queries and keys: not implemented here; refused.",
    )
    group.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="Megatron-Core's multi-latent attention (DeepSeek's MLA): not implemented here; "
        "refused.",
    )
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Megatron-Core's context parallelism: not implemented here, so only 1 is accepted.",
    )
    group.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="Megatron-Core's multi-token prediction layers: not implemented here; refused.",
    )
