"""The MLP spec of a GPT model with MoE layers: what the entry point hands `GPTModel`.

The layers `MoEConfig.is_moe_layer` names (every `--moe-layer-freq`-th from 0, or those its
pattern marks) get an MoE layer (dMoE or MoE with capacity, per `MoEConfig.dropless`,
moe.layers), whose experts have --moe-ffn-hidden-size channels; the others keep the dense MLP
of --ffn-hidden-size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Mapping, Sequence, Tuple

from torch import nn

from megatron.config import Config, ConfigError, ModelConfig
from megatron.model.mlp import MlpMemory, MlpSpec, dense_mlp_flops_per_token
from moe.config import MoEConfig
from moe.experts import Experts
from moe.fp8_experts import capacity_moe_fp8, dropless_fp8
from moe.layers import DroplessMoE, MoE, MoELayer, build_moe_layer
from moe.memory_plan import moe_activation_bytes_per_token, moe_memory
from moe.tensor_parallel import experts_style, moe_layer_style


@dataclass(frozen=True)
class MoEMlpSpec(MlpSpec):
    """MoE layers where `moe.is_moe_layer`, the dense MLP elsewhere. `expert_parallel_size`
    (the run's ParallelConfig.expert_model_parallel_size) is what the memory plan counts per
    rank; the layers themselves are built whole and split by megatron.parallelize.steps."""

    moe: MoEConfig
    expert_parallel_size: int = 1

    def build(self, config: ModelConfig, layer_number: int) -> nn.Module:
        if self.moe.is_moe_layer(layer_number):
            return build_moe_layer(config, self.moe)
        return super().build(config, layer_number)

    def tensor_parallel_styles(self) -> Mapping[type, Callable]:
        """The MoE layer's tokens enter and leave its experts over the tensor-parallel group,
        and the experts keep their share of every expert's ffn channels (moe.tensor_parallel)."""
        return {MoELayer: moe_layer_style, Experts: experts_style}

    def fp8_styles(self) -> Mapping[type, Callable]:
        """The dMoE's grouped expert GEMMs take FP8 where they can (moe.fp8_experts)."""
        return {DroplessMoE: dropless_fp8, MoE: capacity_moe_fp8}

    def forward_flops_per_token(self, config: ModelConfig, layer_number: int) -> int:
        """The top-k expert MLPs (gated when mlp_type is glu), the router and the optional
        shared expert (gated with --swiglu), in place of the dense MLP."""
        if not self.moe.is_moe_layer(layer_number):
            return super().forward_flops_per_token(config, layer_number)
        hidden = config.hidden_size
        experts = self.moe.top_k * dense_mlp_flops_per_token(
            hidden, self.moe.expert_ffn_hidden_size(config), self.moe.mlp_type == "glu"
        )
        router = 2 * hidden * self.moe.num_experts
        shared = 0
        if self.moe.shared_expert:
            shared_ffn = self.moe.shared_expert_ffn_hidden_size or config.ffn_hidden_size
            shared = dense_mlp_flops_per_token(hidden, shared_ffn, config.swiglu)
        return experts + router + shared

    def activation_bytes_per_token(
        self, config: ModelConfig, layer_number: int, compute_bytes: int
    ) -> Tuple[float, float]:
        """The MoE layer's routed activations, balanced and at the worst imbalance
        (moe.memory_plan), in place of the dense MLP's."""
        if not self.moe.is_moe_layer(layer_number):
            return super().activation_bytes_per_token(config, layer_number, compute_bytes)
        return moe_activation_bytes_per_token(
            config, self.moe, compute_bytes, self.expert_parallel_size
        )

    def memory(self, config: Config, layer_numbers: Sequence[int]) -> MlpMemory:
        """The expert weights' compute copies and held gradients, or their casts per
        micro-batch (moe.memory_plan)."""
        return moe_memory(config, self.moe, layer_numbers)

    def expert_parallel_sizes(self, data_parallel_size: int) -> List[int]:
        """The expert-parallel sizes up to `data_parallel_size` whose split of the experts the
        MoE layers support (moe.config.MoEConfig.check_expert_parallelism)."""
        sizes = []
        for size in range(1, data_parallel_size + 1):
            if data_parallel_size % size != 0:
                continue
            try:
                self.moe.check_expert_parallelism(size)
            except ConfigError:
                continue
            sizes.append(size)
        return sizes
