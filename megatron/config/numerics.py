"""The run's numerics, decided once from its flags (Megatron-Core's ModelParallelConfig carries
the same decisions): the dtype the forward and backward compute in, the dtype gradients are
kept and reduced in, the optimizer moments' dtypes, whether layers that keep per-step
low-precision copies of their weights (the dMoE's experts) do so, and how much optimizer state
lives on the host. `Config.numerics` derives it from the frozen sections, so every reader (the
trainer, the optimizers, parallelize, the MoE hooks, the memory planner) sees the same answer,
including for the changed configs the memory planner tries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.config.data_parallel_kind import DataParallelKind

# --main-grads-dtype, --exp-avg-dtype and --exp-avg-sq-dtype values.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Numerics:
    """compute_dtype: autocast's dtype (float32: no autocast; parameters stay fp32 unless the
    data-parallel mode holds them in it: weights_in_compute_dtype).
    main_grads_dtype: gradients kept in this dtype beside the parameters (megatron.main_grads),
    or None where the parameters' own fp32 `.grad` is used. weight_copies_dtype: the dtype of
    the per-step copies of weights whose layers accumulate their gradients themselves
    (--gradient-accumulation-fusion with bf16/fp16), or None where autocast casts the weights
    in every micro-batch. offload_fraction: the share of the optimizer state on the host.
    fp8_format, fp8_recipe: the FP8 products of the attention and MLP projections
    (megatron.kernels.fp8_linear), or None without them.
    weights_in_compute_dtype: whether the weights autocast would cast
    (megatron.parallelize.data_parallel's `autocast_cast_parameters`) are held in the compute
    dtype, with fp32 master weights beside them: the data-parallel mode's answer (`held_by`),
    which the mode (building the distributed optimizer) and the memory planner take.
    False from `of` alone, which reads only the precision and optimizer flags."""

    compute_dtype: torch.dtype
    main_grads_dtype: Optional[torch.dtype]
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    weight_copies_dtype: Optional[torch.dtype]
    offload_fraction: float
    fp8_format: Optional[str] = None
    fp8_recipe: Optional[str] = None
    weights_in_compute_dtype: bool = False

    @property
    def autocast(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled (fp16: its gradients underflow otherwise; bf16 keeps
        fp32's exponent range and needs none)."""
        return self.compute_dtype == torch.float16

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return self.compute_dtype.itemsize

    @classmethod
    def of(cls, training, optimizer) -> Numerics:
        """From a TrainingConfig and an OptimizerConfig (megatron.config.sections)."""
        compute = (
            torch.float16 if training.fp16 else torch.bfloat16 if training.bf16 else torch.float32
        )
        precision_aware = optimizer.use_precision_aware_optimizer
        main_grads = DTYPES[optimizer.main_grads_dtype] if precision_aware else torch.float32
        return cls(
            compute_dtype=compute,
            main_grads_dtype=None if main_grads == torch.float32 else main_grads,
            exp_avg_dtype=DTYPES[optimizer.exp_avg_dtype],
            exp_avg_sq_dtype=DTYPES[optimizer.exp_avg_sq_dtype],
            weight_copies_dtype=(
                compute
                if training.gradient_accumulation_fusion and compute != torch.float32
                else None
            ),
            offload_fraction=(
                optimizer.optimizer_offload_fraction if optimizer.optimizer_cpu_offload else 0.0
            ),
            fp8_format=training.fp8_format,
            fp8_recipe=training.fp8_recipe if training.fp8_format is not None else None,
        )

    def held_by(self, data_parallel: DataParallelKind) -> Numerics:
        """These numerics as the data-parallel mode `data_parallel` holds the weights."""
        held = data_parallel.holds_weights_in_compute_dtype and self.autocast
        return dataclasses.replace(self, weights_in_compute_dtype=held)
