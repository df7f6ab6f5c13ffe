"""Grow a trained dense checkpoint into a dMoE checkpoint whose experts start as copies of each
layer's dense MLP (Megatron-Core's `--moe-use-upcycling` idea).

The library of tools/checkpoint/upcycle.py (its entry, `main`). Every MoE layer (all, or every
--moe-layer-freq-th) gets E copies of the dense MLP: fc1 -> w1 (and v1 for SwiGLU), fc2 -> w2,
fc2's bias -> the layer's output bias. The router starts at zero, so every token sees equal
probabilities 1/E and the router's weights of its k experts add up to a known s (k/E, or 1 when
normalized); each copy's w2 is divided by s. The upcycled model therefore computes the dense
model's function exactly (to rounding) at its first step, and the router learns to tell the
copies apart from there. The result is a `release` checkpoint of the weights, trained on with
`pretrain_gpt.py --load DIR --finetune` and the printed flags.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from typing import Callable, Dict, List, Optional

import torch

from gpt_pretraining import GPT_RUN
from gpt_pretraining.checkpoint_model import read_checkpoint_model
from megatron.checkpointing.layout import RELEASE, read_tracker
from megatron.checkpointing.save import CHECKPOINT_VERSION, write_torch_checkpoint
from megatron.config import ConfigError
from megatron.errors import UserError
from moe.arguments import add_moe_args
from moe.config import MoEConfig
from moe.router import Router


def router_weight_sum(moe: MoEConfig, hidden_size: int) -> float:
    """What a zero router's top-k weights add up to: the scale each expert copy undoes."""
    router = Router(hidden_size, moe)
    routing = router.route(torch.zeros(1, moe.num_experts))
    return float(routing.expert_weights.double().sum())


def upcycled_state(
    dense: Dict[str, torch.Tensor], moe: MoEConfig, num_layers: int, hidden_size: int
) -> Dict[str, torch.Tensor]:
    """The dMoE state dict of the dense `dense`: MoE layers' MLPs replaced by expert copies."""
    scale = 1.0 / router_weight_sum(moe, hidden_size)
    state = dict(dense)
    for index in range(num_layers):
        if not moe.is_moe_layer(index):
            continue
        prefix = f"decoder.layers.{index}.mlp."
        fc1 = state.pop(prefix + "linear_fc1.weight")  # [f or 2f, h]
        fc2 = state.pop(prefix + "linear_fc2.weight")  # [h, f]
        fc1_bias = state.pop(prefix + "linear_fc1.bias", None)
        fc2_bias = state.pop(prefix + "linear_fc2.bias", None)
        if fc1_bias is not None and fc1_bias.any():
            raise UserError(
                f"layer {index}'s dense linear_fc1 has a bias, which MegaBlocks' experts do not "
                "have: upcycling copies the MLP exactly only for models trained with "
                "--disable-bias-linear"
            )
        experts = moe.num_experts
        if moe.mlp_type == "glu":
            gate, up = fc1.chunk(2, dim=0)
            state[prefix + "experts.w1"] = gate.t().expand(experts, -1, -1).clone()
            state[prefix + "experts.v1"] = up.t().expand(experts, -1, -1).clone()
        else:
            state[prefix + "experts.w1"] = fc1.t().expand(experts, -1, -1).clone()
        state[prefix + "experts.w2"] = (
            (fc2.t() * scale).to(fc2.dtype).expand(experts, -1, -1).clone()
        )
        state[prefix + "router.layer.weight"] = fc2.new_zeros(experts, hidden_size)
        if fc2_bias is not None:
            state[prefix + "bias"] = fc2_bias
    return state


def upcycle(
    load_dir: str,
    save_dir: str,
    moe_flags: List[str],
    print_fn: Callable[[str], None] = print,
) -> List[str]:
    """Write the upcycled checkpoint of `load_dir` to `save_dir`; returns the MoE flags."""
    if read_tracker(save_dir) is not None:
        raise UserError(f"--save-dir {save_dir} already holds a checkpoint; choose a new directory")
    dense = read_checkpoint_model(load_dir, print_fn=print_fn)
    if dense.moe is not None:
        raise UserError(f"{load_dir} already has MoE layers: upcycling starts from a dense model")
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_moe_args(parser)
    try:
        parsed = parser.parse_args(moe_flags)
    except (argparse.ArgumentError, SystemExit) as error:
        raise UserError(f"upcycling flags {shlex.join(moe_flags)}: {error}") from None
    if parsed.moe_num_experts is None and parsed.num_experts is None:
        raise UserError("give --moe-num-experts N: the experts each MoE layer gets")
    args = copy.deepcopy(dense.args)
    for name, value in vars(parsed).items():
        setattr(args, name, value)
    try:
        # Saved as a run saves its arguments: every MoE setting resolved.
        GPT_RUN.resolve_extension_arguments(args)
        config = GPT_RUN.config_from_saved(args)
    except ConfigError as error:
        raise UserError(str(error)) from None
    moe, model = config.extension(MoEConfig), config.model
    dense_type = "glu" if model.swiglu else "mlp"
    if moe.mlp_type != dense_type:
        raise UserError(
            f"--mlp-type {moe.mlp_type}: the dense MLP is {dense_type}; experts copy it only as "
            f"--mlp-type {dense_type}"
        )
    expert_ffn = moe.expert_ffn_hidden_size(model)
    if expert_ffn != model.ffn_hidden_size:
        raise UserError(
            f"--moe-ffn-hidden-size {expert_ffn}: the dense checkpoint's MLPs have "
            f"--ffn-hidden-size {model.ffn_hidden_size}, and upcycling copies them into the "
            f"experts whole; drop --moe-ffn-hidden-size (or give {model.ffn_hidden_size})"
        )
    if moe.shared_expert:
        raise UserError(
            "--moe-shared-expert: upcycling copies the dense MLP into the routed experts; a "
            "shared expert beside them would count it twice"
        )
    state = upcycled_state(dense.state_dict, moe, model.num_layers, model.hidden_size)
    with torch.device("meta"):
        expected = GPT_RUN.model(config).state_dict()
    if expected.keys() != state.keys() or any(
        tuple(expected[name].shape) != tuple(tensor.shape) for name, tensor in state.items()
    ):
        raise UserError("the upcycled tensors do not match the dMoE model: a bug in upcycle.py")
    args.consumed_train_samples = args.consumed_valid_samples = 0
    write_torch_checkpoint(
        save_dir,
        RELEASE,
        {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": 0,
            "consumed_train_samples": 0,
            "consumed_valid_samples": 0,
            "model": state,
        },
    )
    flags = [
        flag
        for name, value in vars(parsed).items()
        for flag in _flag(name, value, parser.get_default(name))
    ]
    print_fn(
        f"upcycled iteration {dense.iteration} of {load_dir} into {save_dir}/release: "
        f"{moe.num_moe_layers(model.num_layers)} MoE layers of {moe.num_experts} copies of "
        "the dense MLP, router at zero"
    )
    print_fn(
        f"train it with your dense model's flags and: --load {shlex.quote(save_dir)} "
        f"--finetune {shlex.join(flags)}"
    )
    return flags


def _flag(name: str, value, default) -> List[str]:
    if value == default:
        return []
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:  # a flag on by default, or unset until resolved: its --no- form
        return ["--no-" + flag[2:]]
    return [flag, str(value)]


def main(argv: Optional[List[str]] = None) -> int:
    """tools/checkpoint/upcycle.py: 0, or 1 after one `error:` line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flags are the --moe-* flags of the dMoE to build (pretrain_gpt.py's).",
    )
    parser.add_argument("--load-dir", required=True, help="the dense checkpoint")
    parser.add_argument("--save-dir", required=True, help="the new dMoE checkpoint directory")
    args, moe_flags = parser.parse_known_args(argv)
    try:
        upcycle(args.load_dir, args.save_dir, moe_flags)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
