"""Megatron-Core's per-layer flag form (its `moe_freq_type`): which layers of the model get
something, given as an integer or as a pattern.

- An integer N marks every N-th layer from layer 0 (layer i when i % N == 0), Megatron-Core's
  meaning and the one flags like --moe-layer-freq always had here.
- A pattern is a Python list expression with one 0 or 1 per layer, such as "([0]*1+[1]*11)"
  (a first layer unmarked, then 11 marked) or "[1,0,1,1]": Megatron-Core evaluates it with
  `eval`; here only digits, brackets, parentheses, commas, `+`, `*` and spaces are read, into
  lists and integers combined by list concatenation, repetition and integer arithmetic, so that
  a flag cannot run code.

The argument parser keeps an integer an int (what older checkpoints saved, so that they compare
equal) and a pattern its text, which `parse_pattern` reads into one mark per layer; whoever
owns the flag checks the marks against the number of layers.
"""

from __future__ import annotations

import ast
import re
from typing import Optional, Sequence, Tuple, Union

from megatron.config.errors import ConfigError

LayerFrequency = Union[int, str]

_INTEGER = re.compile(r"\s*[+-]?\d+\s*")
_PATTERN_CHARACTERS = re.compile(r"[\d\s\[\]\(\),+*]+")
# More entries than any model has layers: a pattern past it is a typo, not a model, and is
# refused before the list is built.
_MOST_ENTRIES = 1 << 16


def layer_frequency(text: str) -> LayerFrequency:
    """The argparse type of such a flag: an int for an integer, else the pattern's text (read
    by `parse_pattern` once the config is built, so that a bad one is a ConfigError)."""
    return int(text) if _INTEGER.fullmatch(text) else text.strip()


def is_pattern(value: object) -> bool:
    """Whether a flag's value is a pattern (Megatron-Core's test: it holds a bracket)."""
    return isinstance(value, str) and "[" in value


def is_marked(frequency_or_marks: Union[int, Tuple[bool, ...]], layer: int) -> bool:
    """Whether layer `layer` (0-based) is marked by an integer N (layer % N == 0) or by the
    marks `parse_pattern` read."""
    if isinstance(frequency_or_marks, int):
        return layer % frequency_or_marks == 0
    return frequency_or_marks[layer]


def parse_pattern(flag: str, text: str) -> Tuple[bool, ...]:
    """The marks of a pattern, one per layer; ConfigError, naming `flag`, for anything but a
    list expression of 0s and 1s."""
    usage = 'give an integer or a list expression of 0s and 1s such as "([0]*1+[1]*11)"'
    if not _PATTERN_CHARACTERS.fullmatch(text) or "[" not in text:
        raise ConfigError(f"{flag} {text!r} is not a layer pattern; {usage}")
    try:
        value = _evaluate(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError) as error:
        raise ConfigError(f"{flag} {text!r} is not a layer pattern ({error}); {usage}") from None
    if not isinstance(value, list):
        raise ConfigError(f"{flag} {text!r} is a number, not a list of 0s and 1s; {usage}")
    others = sorted({entry for entry in value if entry not in (0, 1)})
    if others:
        raise ConfigError(
            f"{flag} {text!r} has entries {others}; a pattern holds 1 (marked layer) or 0 only"
        )
    return tuple(entry == 1 for entry in value)


def pattern_text(marks: Sequence[bool]) -> str:
    """The pattern of `marks` as a flag value, e.g. "[0,1,1]"."""
    return "[" + ",".join(str(int(mark)) for mark in marks) + "]"


def same_marked_layers(
    first: object,
    first_num_layers: Optional[int],
    second: object,
    second_num_layers: Optional[int],
) -> bool:
    """Whether two values of such a flag, at least one of them a pattern, mark the same layers
    (each of its own model's layers): a checkpoint's integer and this run's pattern that marks
    the same layers agree. False for anything that is not such a value."""
    if not (is_pattern(first) or is_pattern(second)):
        return False
    first_marks = marked_layers(first, first_num_layers)
    return first_marks is not None and first_marks == marked_layers(second, second_num_layers)


def marked_layers(value: object, num_layers: Optional[int]) -> Optional[Tuple[bool, ...]]:
    """The marks of a valid value (an integer or a pattern) for `num_layers` layers, else None
    (None too where the number of layers is unknown)."""
    if num_layers is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= num_layers:
            return None
        return tuple(is_marked(value, layer) for layer in range(num_layers))
    if not is_pattern(value):
        return None
    try:
        marks = parse_pattern("", value)
    except ConfigError:
        return None
    return marks if len(marks) == num_layers else None


def _evaluate(node: ast.AST) -> Union[int, list]:
    """A list expression's value, from the nodes `parse_pattern`'s characters can make: int
    constants, lists of them, + and * (ValueError for the rest, tuples included)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        entries = [_evaluate(element) for element in node.elts]
        if any(isinstance(entry, list) for entry in entries):
            raise ValueError("a list inside a list")
        return entries
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult))):
        raise ValueError(f"unexpected {type(node).__name__.lower()}")
    left, right = _evaluate(node.left), _evaluate(node.right)
    lists = isinstance(left, list) + isinstance(right, list)
    if isinstance(node.op, ast.Add):
        if lists == 1:
            raise ValueError("a list added to a number")
        result = left + right
    else:
        if lists == 2:
            raise ValueError("a list times a list")
        # Sized before it is built: the characters allow no minus sign, so counts are >= 0.
        if lists == 1:
            entries, count = (left, right) if isinstance(left, list) else (right, left)
            size = len(entries) * count
        else:
            size = left * right
        if size > _MOST_ENTRIES:
            raise ValueError(f"more than {_MOST_ENTRIES} entries")
        result = left * right
    if isinstance(result, list) and len(result) > _MOST_ENTRIES:
        raise ValueError(f"more than {_MOST_ENTRIES} entries")
    return result
