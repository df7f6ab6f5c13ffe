"""Megatron-Core's per-layer flag form (megatron.config.layer_pattern): integers stay ints,
patterns read into one mark per layer without running code, and anything else is one
ConfigError line naming the flag."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError
from megatron.config.layer_pattern import (
    is_marked,
    layer_frequency,
    parse_pattern,
    pattern_text,
    same_marked_layers,
)

FLAG = "--moe-layer-freq"


def test_an_integer_stays_an_int_and_marks_every_nth_layer_from_zero():
    """Megatron-Core's int meaning (layer i when i % N == 0), as the flag always had; an int in
    the namespace equals an older checkpoint's saved int."""
    assert layer_frequency("2") == 2 and isinstance(layer_frequency("2"), int)
    assert [is_marked(3, layer) for layer in range(7)] == [1, 0, 0, 1, 0, 0, 1]
    assert layer_frequency(" [0,1] ") == "[0,1]"


@pytest.mark.parametrize(
    "text, marks",
    [
        ("([0]*1+[1]*3)", [0, 1, 1, 1]),
        ("[0]+[1]*3", [0, 1, 1, 1]),
        ("[1,0,1,1]", [1, 0, 1, 1]),
        ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0] * 2),  # Megatron-Core's docstring example
        ("[0] * (1 + 1) + [1]", [0, 0, 1]),
    ],
)
def test_megatron_core_patterns_read_as_python_would(text, marks):
    read = parse_pattern(FLAG, text)
    assert read == tuple(bool(mark) for mark in marks)
    assert parse_pattern(FLAG, pattern_text(read)) == read


@pytest.mark.parametrize(
    "text, detail",
    [
        ("__import__('os').system('true')", "is not a layer pattern"),
        ("[1,0]; import os", "is not a layer pattern"),
        ("[1]*2**4", "is not a layer pattern (unexpected"),
        ("[0,2,1]", "has entries [2]"),
        ("[[1],[0]]", "a list inside a list"),
        ("[1]+1", "a list added to a number"),
        ("[1]*[2]", "a list times a list"),
        ("([1],[0])", "unexpected tuple"),
        ("[1,0", "is not a layer pattern"),
        ("1*2", "is not a layer pattern"),
        ("[1]*100000000000", "more than 65536 entries"),
    ],
)
def test_anything_else_is_one_line_naming_the_flag(text, detail):
    with pytest.raises(ConfigError) as raised:
        parse_pattern(FLAG, text)
    message = str(raised.value)
    assert message.startswith(f"{FLAG} {text!r} ") and detail in message, message
    assert "\n" not in message


def test_a_checkpoints_integer_and_a_pattern_marking_the_same_layers_agree():
    assert same_marked_layers(1, 4, "[1,1,1,1]", 4)
    assert same_marked_layers("([1]+[0])*2", 4, 2, 4)
    assert same_marked_layers("[0,1]", 2, "([0]*1+[1]*1)", 2)
    assert not same_marked_layers(2, 4, "[1,1,0,0]", 4)
    assert not same_marked_layers(1, 4, "[1,1,1]", 3)  # each of its own model's layers
    assert not same_marked_layers(1, None, "[1]", 1)  # a checkpoint without --num-layers
    # Only a pattern is read by the layers it marks: two integers, or two other strings, are
    # the same only when equal (64 and 32 would both mark layer 0 of a 2-layer model).
    assert not same_marked_layers(64, 2, 32, 2)
    assert not same_marked_layers("rope", 2, "learned_absolute", 2)
    assert not same_marked_layers(True, 1, "[1]", 1)
