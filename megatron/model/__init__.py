"""GPT model in plain PyTorch (batch-first); parallelism is applied to it separately."""

from megatron.model.flops import num_floating_point_operations
from megatron.model.gpt_model import GPTModel
from megatron.model.mlp import DENSE_MLP, MlpSpec
from megatron.model.parameters import count_parameters, param_groups_for_weight_decay

__all__ = [
    "DENSE_MLP",
    "GPTModel",
    "MlpSpec",
    "count_parameters",
    "num_floating_point_operations",
    "param_groups_for_weight_decay",
]
