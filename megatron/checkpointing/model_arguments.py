"""The saved arguments that describe a model, and how a run's differ from a checkpoint's.

A checkpoint keeps its run's argument namespace (`args`, as Megatron's do). When a checkpoint's
tensors do not fit the model, the flags whose values differ explain why in terms the user
typed (`--hidden-size 64 in the checkpoint, 32 now`); when they fit but such a flag changed
(say `--moe-top-k`), the model computes something else than what was trained, which loading
reports as a warning. A flag in Megatron-Core's per-layer form (megatron.config.layer_pattern,
such as --moe-layer-freq) compares by the layers it marks: a checkpoint saved with an integer
matches a run giving the pattern that marks the same layers.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

from megatron.config.layer_pattern import same_marked_layers

# Namespace attributes that define the GPT model. Extensions with model flags of their own
# (the MoE layers) pass theirs besides these.
MODEL_ARGUMENTS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "normalization",
    "layernorm_epsilon",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "add_bias_linear",
    "padded_vocab_size",
)

# Compared only when the named boolean is on in both runs (its value means nothing otherwise).
_ONLY_WITH = {"num_query_groups": "group_query_attention"}
# store_false flags: the attribute is True unless the flag was given.
_INVERTED_FLAGS = {"add_bias_linear": "--disable-bias-linear"}


def model_argument_differences(
    saved: Optional[argparse.Namespace],
    current: argparse.Namespace,
    names: Sequence[str] = MODEL_ARGUMENTS,
) -> List[str]:
    """One phrase per attribute of `names` whose value differs between the checkpoint's saved
    namespace and this run's, e.g. `--hidden-size 64 in the checkpoint, 32 now`. Attributes
    missing from either side (a checkpoint from another framework or version) are skipped."""
    if saved is None:
        return []
    differences = []
    for name in names:
        if not (hasattr(saved, name) and hasattr(current, name)):
            continue
        condition = _ONLY_WITH.get(name)
        if condition and not (getattr(saved, condition, False) and getattr(current, condition)):
            continue
        saved_value, current_value = getattr(saved, name), getattr(current, name)
        if saved_value != current_value and not same_marked_layers(
            saved_value,
            getattr(saved, "num_layers", None),
            current_value,
            getattr(current, "num_layers", None),
        ):
            differences.append(_describe(name, saved_value, current_value))
    return differences


def _describe(name: str, saved_value, current_value) -> str:
    if name == "padded_vocab_size":
        return (
            f"padded vocabulary size {saved_value} in the checkpoint, {current_value} now (the "
            "tokenizer's vocabulary, padded to a multiple of --make-vocab-size-divisible-by x "
            "--tensor-model-parallel-size)"
        )
    if name in _INVERTED_FLAGS:
        flag = _INVERTED_FLAGS[name]
        return f"{flag} {_on(not saved_value)} in the checkpoint, {_on(not current_value)} now"
    flag = "--" + name.replace("_", "-")
    if isinstance(saved_value, bool) or isinstance(current_value, bool):
        return f"{flag} {_on(saved_value)} in the checkpoint, {_on(current_value)} now"
    return f"{flag} {saved_value} in the checkpoint, {current_value} now"


def _on(value) -> str:
    return "on" if value else "off"
