"""The GPT pretraining run of this project: megatron composed with its extensions (the MoE
layers). The one place that knows both packages; `pretrain_gpt.py`, the tools and the benches
build their runs through GPT_RUN (megatron.composition.run.RunComposition)."""

from megatron.composition.run import RunComposition
from moe.extension import MOE_EXTENSION

GPT_RUN = RunComposition((MOE_EXTENSION,))

__all__ = ["GPT_RUN"]
