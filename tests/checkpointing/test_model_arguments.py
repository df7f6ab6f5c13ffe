"""How a checkpoint's saved model arguments differ from a run's
(megatron.checkpointing.model_arguments): a per-layer pattern compares by the layers it marks."""

from __future__ import annotations

import argparse

from megatron.checkpointing.model_arguments import model_argument_differences

NAMES = ("num_layers", "ffn_hidden_size", "moe_layer_freq")


def namespace(**values) -> argparse.Namespace:
    return argparse.Namespace(**{"num_layers": 4, "ffn_hidden_size": 64, **values})


def test_an_older_checkpoints_integer_equals_the_pattern_of_the_same_layers():
    """Checkpoints saved before the pattern form hold an int; a run that writes the same
    layers as a pattern loads them without a warning, and one that moves an MoE layer is
    told which flag changed."""
    saved, pattern_saved = namespace(moe_layer_freq=2), namespace(moe_layer_freq="([1]+[0])*2")
    for same in (2, "[1,0,1,0]"):
        assert model_argument_differences(saved, namespace(moe_layer_freq=same), NAMES) == []
    assert model_argument_differences(pattern_saved, namespace(moe_layer_freq=2), NAMES) == []
    assert model_argument_differences(saved, namespace(moe_layer_freq="[0,1,1,1]"), NAMES) == [
        "--moe-layer-freq 2 in the checkpoint, [0,1,1,1] now"
    ]
