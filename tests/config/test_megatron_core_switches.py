"""Megatron-Core's model switches (megatron.arguments.megatron_core): an implementation choice
is accepted with one note, a feature this project lacks is refused in one line."""

from __future__ import annotations

import pytest

from megatron.config import build_parser
from tests.config.command_lines import config, error_message

ROPE = ("--position-embedding-type", "rope")


def test_implementation_choices_are_accepted_with_one_note_each():
    built = config(
        "--use-mcore-models", "--transformer-impl", "transformer_engine",
        "--attention-backend", "flash", "--no-position-embedding", *ROPE, "--log-throughput",
        "--kv-channels", "16", "--context-parallel-size", "1",
    )  # fmt: skip
    notes = [note for note in built.notes if note.endswith("no effect")]
    assert [note.split(":")[0] for note in notes] == [
        "--use-mcore-models",
        "--transformer-impl transformer_engine",
        "--attention-backend flash",
        "--no-position-embedding",
        "--log-throughput",
    ]
    assert built.model == config(*ROPE).model
    assert not any(note.endswith("no effect") for note in config().notes)


def test_megatron_cores_fusion_and_kernel_switches_are_accepted_with_one_note_each():
    from megatron.arguments.megatron_core import NO_EFFECT_SWITCHES

    built = config(*NO_EFFECT_SWITCHES, "--cross-entropy-fusion-impl", "te")
    noted = [note.split(":")[0] for note in built.notes if note.endswith("no effect")]
    assert noted == [*NO_EFFECT_SWITCHES, "--cross-entropy-fusion-impl te"]
    assert built.model == config().model and built.training == config().training


def test_linear_cross_entropy_fusion_is_megatron_cores_linear_impl():
    """--cross-entropy-fusion-impl linear (Megatron-Core's name) fuses the output layer and the
    loss, with no note; at tensor-parallel size > 1 it is refused in one line."""
    built = config("--cross-entropy-fusion-impl", "linear")
    assert built.model.linear_cross_entropy_fusion
    assert not config("--cross-entropy-fusion-impl", "native").model.linear_cross_entropy_fusion
    assert not any("cross-entropy" in note for note in built.notes)
    message = error_message(
        "--cross-entropy-fusion-impl", "linear", "--tensor-model-parallel-size", "2", world_size=2
    )
    assert message.startswith(
        "--cross-entropy-fusion-impl linear with --tensor-model-parallel-size 2:"
    )


@pytest.mark.parametrize(
    "extra, line",
    [
        (("--no-position-embedding",),
         "--no-position-embedding with --position-embedding-type learned_absolute: a model "
         "without position embeddings is not implemented here; use --position-embedding-type "
         "rope"),
        (("--kv-channels", "8"),
         "--kv-channels 8: attention heads of a width other than --hidden-size 64 / "
         "--num-attention-heads 4 = 16 are not implemented here; drop --kv-channels or give 16"),
        (("--qk-layernorm",),
         "--qk-layernorm: normalizing the attention's queries and keys is not implemented here"),
        (("--multi-latent-attention",),
         "--multi-latent-attention: multi-latent attention is not implemented here"),
        (("--context-parallel-size", "2"),
         "--context-parallel-size 2: context parallelism is not implemented here; use 1"),
        (("--mtp-num-layers", "1"),
         "--mtp-num-layers 1: multi-token prediction is not implemented here; drop the flag"),
    ],
)  # fmt: skip
def test_missing_features_are_refused_in_one_line(extra, line):
    message = error_message(*extra)
    assert line in message and "\n" not in message


def test_help_names_them_megatron_cores():
    assert "Megatron-Core's model switches:" in build_parser().format_help()
