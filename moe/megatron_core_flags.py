"""Megatron-Core's names for the MoE settings, beside MegaBlocks' (moe.arguments), converted to
the settings MoEConfig reads by their meaning, never by their name; and the one place where a
setting the command line leaves unset gets its default.

MoEConfig reads MegaBlocks' attributes (`moe_num_experts`, `moe_top_k`, `moe_loss_weight`, ...).
`resolve_moe_arguments` fills each from whichever of its spellings was given (both given: they
must agree after conversion, else one line refuses them), else from the defaults of the name
the experts were declared with (`MoEDefaults`): `--num-experts` (Megatron-Core's) takes
Megatron-Core's defaults (top-2, no load-balancing loss, the softmax over the chosen experts'
logits, the expert bias only when switched on); `--moe-num-experts` (MegaBlocks') keeps
MegaBlocks' and this project's (top-1, loss weight 0.1, the softmax over all experts, the expert
bias on with any --moe-router-bias-update-rate > 0). Megatron-Core's own attributes keep what
was typed (but for the drop policy, filled in, and a capacity factor that only made the MoE
dropless, cleared), so that resolving again (a checkpoint's saved arguments) decides the same.

The conversions:
- Megatron-Core adds each MoE layer's load-balancing loss times --moe-aux-loss-coeff (and its
  z-loss times --moe-z-loss-coeff); MegaBlocks weights the mean over the MoE layers
  (moe.auxiliary_losses). So --moe-loss-weight = coefficient x the MoE layers (--num-layers,
  --moe-layer-freq): 0.01 over 32 MoE layers is a weight of 0.32.
- Megatron-Core's sigmoid router divides the chosen experts' scores by their sum when top-k > 1,
  before the top-k scaling factor: MegaBlocks' --moe-normalize-expert-weights 1 there (applied
  before --moe-router-topk-scaling-factor too); none at top-1.
- --moe-expert-capacity-factor F > 0 is the capacity MoE (--no-moe-dropless
  --moe-capacity-factor F) with Megatron-Core's capacity ceil(F x top-k x tokens / experts)
  (`capacity_rounds_up`) and its default drop policy, `probs` (an expert past its capacity
  drops its lowest-weight assignments); F < 0 is dropless. MegaBlocks' capacity MoE drops the
  last ones, Megatron-Core's `position` policy.
- --moe-shared-expert-intermediate-size N is --moe-shared-expert
  --moe-shared-expert-ffn-hidden-size N (Megatron-Core's shared expert without its gate, which
  is what this project's is).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import List

from megatron.config.errors import ConfigError
from megatron.config.layer_pattern import marked_layers


@dataclass(frozen=True)
class MoEDefaults:
    """The value each MoE setting takes when the command line leaves it unset."""

    top_k: int
    loss_weight: float  # of the MoE layers' mean load-balancing loss
    zloss_weight: float
    router_pre_softmax: bool
    # Whether --moe-router-bias-update-rate > 0 alone turns the expert bias on (this project's
    # meaning from before Megatron-Core's --moe-router-enable-expert-bias was taken).
    rate_alone_enables_expert_bias: bool
    dropless: bool = True
    capacity_factor: float = 1.0
    router_score: str = "softmax"


MEGABLOCKS_DEFAULTS = MoEDefaults(
    top_k=1,
    loss_weight=0.1,
    zloss_weight=0.0,
    router_pre_softmax=True,
    rate_alone_enables_expert_bias=True,
)
MEGATRON_CORE_DEFAULTS = MoEDefaults(
    top_k=2,
    loss_weight=0.0,
    zloss_weight=0.0,
    router_pre_softmax=False,
    rate_alone_enables_expert_bias=False,
)
# Megatron-Core's default --moe-router-bias-update-rate (DeepSeek-V3's), for a bias switched on
# without a rate.
EXPERT_BIAS_UPDATE_RATE = 1e-3
# Megatron-Core's values of these flags; those it has and this project lacks are refused.
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")
TOKEN_DROP_POLICIES = ("probs", "position")
# Megatron-Core switches that choose its kernels or overlaps, no part of what is computed here.
_NO_EFFECT = {
    "moe_shared_expert_overlap": "the shared expert runs beside the routed experts anyway",
    "moe_permute_fusion": "the dMoE's permutations are its own gather kernels",
    "moe_router_fusion": "the router is plain PyTorch ops",
    "moe_use_legacy_grouped_gemm": "the dMoE's grouped GEMM is chosen per device "
    "(--moe-grouped-gemm-kernel)",
}


def add_megatron_core_moe_args(parser: argparse.ArgumentParser) -> None:
    """Register Megatron-Core's MoE flags, in a group of their own."""
    group = parser.add_argument_group(
        title="mixture of experts: Megatron-Core's names",
        description="Megatron-Core's flags with Megatron-Core's meanings, converted to the "
        "settings above (moe.megatron_core_flags); a setting given in both spellings must "
        "agree. Declaring the experts with --num-experts gives the settings left unset "
        "Megatron-Core's defaults; --moe-num-experts keeps MegaBlocks'.",
    )
    group.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="Experts per MoE layer (--moe-num-experts), with Megatron-Core's defaults: top-2, "
        "aux-loss coefficient 0, softmax over the chosen experts' logits.",
    )
    group.add_argument(
        "--moe-router-topk", type=int, default=None, help="Experts per token (--moe-top-k)."
    )
    group.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        default=None,
        help="Weight of EACH MoE layer's load-balancing loss, the layers' losses added: "
        "--moe-loss-weight (the weight of their mean) = this x the MoE layers.",
    )
    group.add_argument(
        "--moe-z-loss-coeff",
        type=float,
        default=None,
        help="Weight of each MoE layer's router z-loss, added: --moe-zloss-weight = this x the "
        "MoE layers.",
    )
    group.add_argument(
        "--moe-router-score-function",
        default=None,
        choices=SCORE_FUNCTIONS,
        help="softmax or sigmoid (--moe-router-score); sigmoid's chosen scores sum to 1 at "
        "top-k > 1 (--moe-normalize-expert-weights 1). sqrtsoftplus is not implemented.",
    )
    group.add_argument(
        "--moe-router-enable-expert-bias",
        action="store_true",
        default=None,
        help="Auxiliary-loss-free balancing: the expert bias, moved by "
        "--moe-router-bias-update-rate (default 1e-3).",
    )
    group.add_argument(
        "--moe-input-jitter-eps",
        type=float,
        default=None,
        help="Router input noise U(1-eps, 1+eps) in training (--moe-jitter-eps).",
    )
    group.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="F > 0: the capacity MoE (--no-moe-dropless --moe-capacity-factor F) with "
        "Megatron-Core's capacity ceil(F x top-k x tokens / experts); F < 0: dropless.",
    )
    group.add_argument(
        "--moe-token-drop-policy",
        default=None,
        choices=TOKEN_DROP_POLICIES,
        help="Which assignments past an expert's capacity are dropped: probs, the lowest-weight "
        "ones (the default with --moe-expert-capacity-factor), or position, the last ones (the "
        "default with --no-moe-dropless, MegaBlocks').",
    )
    group.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="Accepted: the capacity MoE always fills fixed capacity slots.",
    )
    group.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="A shared expert of this hidden size (--moe-shared-expert "
        "--moe-shared-expert-ffn-hidden-size N), without a gate.",
    )
    group.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="Accepted: the dMoE computes its experts as grouped GEMMs (--moe-impl grouped).",
    )
    group.add_argument(
        "--moe-token-dispatcher-type",
        default=None,
        choices=TOKEN_DISPATCHERS,
        help="alltoall or allgather, accepted: the expert-parallel exchange here is an "
        "all-to-all either way, the same math. flex (DeepEP) is not implemented.",
    )
    group.add_argument(
        "--moe-enable-deepep", action="store_true", help="DeepEP: not implemented; refused."
    )
    group.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Tensor-parallel ranks each expert is split over: accepted when it is "
        "--tensor-model-parallel-size (Megatron-Core's default, the only split here).",
    )
    group.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        # Not the attribute name: checkpoints saved before our chunked overlap had a name of
        # its own hold it under that one (moe.exchange_flags.exchange_chunks reads it).
        dest="megatron_core_overlap_moe_expert_parallel_comm",
        help="Megatron-Core's overlap of one micro-batch's all-to-all with another's compute "
        "in its 1F1B schedule: not implemented; refused (see "
        "--moe-expert-parallel-chunked-overlap).",
    )
    for name in _NO_EFFECT:
        group.add_argument(
            "--" + name.replace("_", "-"),
            action="store_true",
            help="Megatron-Core's kernel or overlap switch: accepted, no effect.",
        )


def resolve_moe_arguments(args: argparse.Namespace) -> List[str]:
    """Fill, in place, every MoE setting MoEConfig reads from whichever spelling of it was
    given, else its default (module docstring); the notes to print. ConfigError, one line, for
    both spellings disagreeing or a Megatron-Core feature this project lacks. Applied again to
    its own result, it changes nothing."""
    _refuse_missing_features(args)
    megatron_core = _value(args, "num_experts") is not None
    defaults = MEGATRON_CORE_DEFAULTS if megatron_core else MEGABLOCKS_DEFAULTS
    if megatron_core and getattr(args, "add_bias_linear", False):
        raise ConfigError(
            "--num-experts declares Megatron-Core's MoE layers, whose experts each have linear "
            "biases unless --disable-bias-linear; this project's experts have none (one output "
            "bias per layer, MegaBlocks'): add --disable-bias-linear, or declare MegaBlocks' "
            "layers with --moe-num-experts"
        )
    notes: List[str] = []
    _rename(args, "moe_num_experts", "num_experts")
    _rename(args, "moe_top_k", "moe_router_topk", defaults.top_k)
    _rename(args, "moe_jitter_eps", "moe_input_jitter_eps")
    _rename(args, "moe_router_score", "moe_router_score_function", defaults.router_score)
    _resolve_losses(args, defaults)
    _resolve_routing_weights(args, defaults)
    notes += _resolve_expert_bias(args, defaults)
    notes += _resolve_capacity(args, defaults)
    shared = _value(args, "moe_shared_expert_intermediate_size")
    if shared is not None:
        _rename(args, "moe_shared_expert_ffn_hidden_size", "moe_shared_expert_intermediate_size")
        args.moe_shared_expert = True
    return notes + _accepted_notes(args)


def capacity_rounds_up(args: argparse.Namespace) -> bool:
    """Whether the capacity MoE takes Megatron-Core's ceil(F x top-k x tokens / experts) (its
    --moe-expert-capacity-factor F > 0) rather than MegaBlocks' int()."""
    factor = _value(args, "moe_expert_capacity_factor")
    return factor is not None and factor > 0


def _refuse_missing_features(args: argparse.Namespace) -> None:
    expert_split = _value(args, "expert_tensor_parallel_size")
    tensor_parallel = getattr(args, "tensor_model_parallel_size", 1)
    if expert_split is not None and expert_split != tensor_parallel:
        raise ConfigError(
            f"--expert-tensor-parallel-size {expert_split}: the experts here are split over the "
            f"--tensor-model-parallel-size {tensor_parallel} ranks as the dense MLP is "
            "(Megatron-Core's default); another split of the experts is not implemented: drop "
            f"the flag or give {tensor_parallel}"
        )
    if _value(args, "moe_token_dispatcher_type") == "flex":
        raise ConfigError(
            "--moe-token-dispatcher-type flex (DeepEP's or HybridEP's dispatch) is not "
            "implemented here; use alltoall (the expert-parallel exchange here is an all-to-all, "
            "which --moe-expert-parallel-chunked-overlap hides behind the experts)"
        )
    if _value(args, "moe_enable_deepep"):
        raise ConfigError(
            "--moe-enable-deepep: DeepEP is not implemented here; drop it (the expert-parallel "
            "exchange here is an all-to-all, which --moe-expert-parallel-chunked-overlap hides "
            "behind the experts)"
        )
    if _value(args, "megatron_core_overlap_moe_expert_parallel_comm"):
        raise ConfigError(
            "--overlap-moe-expert-parallel-comm is Megatron-Core's overlap of one micro-batch's "
            "expert-parallel all-to-all with another micro-batch's compute in its 1F1B "
            "schedule, which this project does not have; drop it, or hide the exchange under "
            "the same micro-batch's experts with --moe-expert-parallel-chunked-overlap"
        )
    if _value(args, "moe_router_score_function") == "sqrtsoftplus":
        raise ConfigError(
            "--moe-router-score-function sqrtsoftplus is not implemented here; use softmax or "
            "sigmoid"
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = _value(args, name)
        if value is not None and value < 0:
            raise ConfigError(f"{_flag(name)} must be >= 0, got {value}")


def _resolve_losses(args: argparse.Namespace, defaults: MoEDefaults) -> None:
    """The loss weights, from Megatron-Core's per-layer coefficients where given: their sum
    over the MoE layers is this weight times the layers' mean."""
    for ours, theirs, default in (
        ("moe_loss_weight", "moe_aux_loss_coeff", defaults.loss_weight),
        ("moe_zloss_weight", "moe_z_loss_coeff", defaults.zloss_weight),
    ):
        coefficient = _value(args, theirs)
        if coefficient is None:
            _settle(args, ours, None, "", default)
            continue
        layers = _moe_layer_count(args, theirs)
        weight = coefficient * layers
        given = (
            f"{_flag(theirs)} {coefficient} (each of the {layers} MoE layers' loss: "
            f"{_flag(ours)} {weight:g}, the weight of their mean)"
        )
        _settle(args, ours, weight, given, default)


def _resolve_routing_weights(args: argparse.Namespace, defaults: MoEDefaults) -> None:
    """Pre-softmax, and Megatron-Core's sigmoid normalization (module docstring)."""
    if _value(args, "moe_router_pre_softmax") is None:
        # A sigmoid router has no softmax to place: the chosen experts' scores are their
        # weights, which MoEConfig spells pre-softmax.
        sigmoid = args.moe_router_score == "sigmoid"
        args.moe_router_pre_softmax = True if sigmoid else defaults.router_pre_softmax
    if _value(args, "moe_router_score_function") == "sigmoid" and args.moe_top_k > 1:
        given = (
            f"--moe-router-score-function sigmoid at top-k {args.moe_top_k} (the chosen "
            "scores divided by their sum: --moe-normalize-expert-weights 1)"
        )
        _settle(args, "moe_normalize_expert_weights", 1.0, given)


def _resolve_expert_bias(args: argparse.Namespace, defaults: MoEDefaults) -> List[str]:
    """The expert bias's rate, 0 when the bias is off: MoEConfig's one setting for both."""
    enabled = _value(args, "moe_router_enable_expert_bias")
    rate = _value(args, "moe_router_bias_update_rate")
    notes = []
    if enabled is None:
        enabled = defaults.rate_alone_enables_expert_bias and rate is not None and rate > 0
        if not enabled and rate:
            notes.append(
                f"--moe-router-bias-update-rate {rate} without --moe-router-enable-expert-bias: "
                "no expert bias (Megatron-Core's meaning, as --num-experts asks); add the switch"
            )
    if not enabled:
        args.moe_router_bias_update_rate = 0.0
    elif rate is None:
        args.moe_router_bias_update_rate = EXPERT_BIAS_UPDATE_RATE
    return notes


def _resolve_capacity(args: argparse.Namespace, defaults: MoEDefaults) -> List[str]:
    """Dropless or the capacity MoE, its factor and its drop policy, from
    --moe-expert-capacity-factor where given; the padding checked against it."""
    factor = _value(args, "moe_expert_capacity_factor")
    policy = _value(args, "moe_token_drop_policy")
    notes = []
    dropless, capacity = None, None
    if factor is None:
        if _value(args, "moe_pad_expert_input_to_capacity"):
            # Megatron-Core refuses it too.
            raise ConfigError(
                "--moe-pad-expert-input-to-capacity pads to the capacity "
                "--moe-expert-capacity-factor sets; add it or drop the flag"
            )
    elif factor == 0:
        raise ConfigError(
            "--moe-expert-capacity-factor 0 gives every expert a capacity of 0 (every token "
            "dropped, in Megatron-Core too); give a factor > 0, or a negative one for dropless"
        )
    else:
        # Megatron-Core's negative factor means no capacity.
        dropless, capacity = factor < 0, (factor if factor > 0 else None)
    given = f"--moe-expert-capacity-factor {factor}"
    _settle(args, "moe_dropless", dropless, given, defaults.dropless)
    _settle(args, "moe_capacity_factor", capacity, given, defaults.capacity_factor)
    if args.moe_dropless:
        if policy is not None:
            notes.append(f"--moe-token-drop-policy {policy}: the dropless MoE drops nothing")
        # Said by --moe-dropless now: kept, the factor and the policy would tell a checkpoint's
        # comparison of model flags (MOE_MODEL_ARGUMENTS) of drops that do not happen.
        args.moe_expert_capacity_factor = args.moe_token_drop_policy = None
        return notes
    args.moe_token_drop_policy = policy or ("probs" if capacity is not None else "position")
    if policy == "position" and (args.micro_batch_size or 1) > 1:
        notes.append(
            "--moe-token-drop-policy position: the capacity MoE drops the last assignments in "
            "token order, sequence after sequence, and Megatron-Core position after position "
            "over the micro-batch's sequences (the same at --micro-batch-size 1)"
        )
    if _value(args, "moe_pad_expert_input_to_capacity"):
        notes.append(
            "--moe-pad-expert-input-to-capacity: the capacity MoE always fills fixed capacity "
            "slots; no effect"
        )
    return notes


def _accepted_notes(args: argparse.Namespace) -> List[str]:
    """One line for each Megatron-Core switch given that changes nothing here (ConfigError for
    --moe-grouped-gemm beside another expert computation)."""
    notes = []
    if _value(args, "moe_grouped_gemm"):
        if args.mlp_impl != "grouped":
            raise ConfigError(
                f"--moe-grouped-gemm asks for grouped GEMMs and --moe-impl {args.mlp_impl} for "
                "another expert computation; drop one of them"
            )
        notes.append("--moe-grouped-gemm: the experts run as grouped GEMMs by default; no effect")
    if _value(args, "moe_token_dispatcher_type") == "allgather":
        notes.append(
            "--moe-token-dispatcher-type allgather: the expert-parallel exchange here is an "
            "all-to-all, which sends each expert the same tokens; no effect"
        )
    for name, why in _NO_EFFECT.items():
        if _value(args, name):
            notes.append(f"{_flag(name)}: {why}; no effect")
    return notes


def _rename(args: argparse.Namespace, ours: str, theirs: str, default: object = None) -> None:
    """`_settle` of a setting whose Megatron-Core spelling means the same."""
    value = _value(args, theirs)
    _settle(args, ours, value, f"{_flag(theirs)} {value}", default)


def _settle(
    args: argparse.Namespace, ours: str, theirs: object, given: str, default: object = None
) -> None:
    """Set `ours` to its given value, else to `theirs` (Megatron-Core's spelling's value in our
    meaning; None when not given), else to `default`; ConfigError when both were given and
    disagree, `given` saying what Megatron-Core's spelling was."""
    mine = _value(args, ours)
    if mine is not None and theirs is not None and not _agree(mine, theirs):
        raise ConfigError(
            f"{given} and {_typed(ours, mine)} set one setting differently (Megatron-Core's "
            "and MegaBlocks' names for it); give one of them"
        )
    for value in (mine, theirs, default):
        if value is not None:
            setattr(args, ours, value)
            return
    setattr(args, ours, None)


def _agree(first: object, second: object) -> bool:
    if isinstance(first, float) or isinstance(second, float):
        # A converted coefficient may differ from the weight typed in the last bits.
        return math.isclose(first, second, rel_tol=1e-9)
    return first == second


def _moe_layer_count(args: argparse.Namespace, flag_attribute: str) -> int:
    """The MoE layers the loss coefficients are converted with (--num-layers, --moe-layer-freq)."""
    num_layers = getattr(args, "num_layers", None)
    marks = marked_layers(args.moe_layer_freq, num_layers) if num_layers else None
    if marks is None:
        raise ConfigError(
            f"{_flag(flag_attribute)} weights each MoE layer's loss, and --moe-layer-freq "
            f"{args.moe_layer_freq} does not mark layers of --num-layers {num_layers}; give an "
            "integer from 1 to --num-layers, or one 0 or 1 per layer"
        )
    return sum(marks)


def _value(args: argparse.Namespace, name: str):
    """A flag's value, None when unset or absent (saved arguments from before it existed)."""
    return getattr(args, name, None)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(name: str, value: object) -> str:
    """A flag as typed: `--moe-top-k 1`, or `--moe-dropless` / `--no-moe-dropless`."""
    if isinstance(value, bool):
        return _flag(name) if value else "--no-" + _flag(name)[2:]
    return f"{_flag(name)} {value}"
