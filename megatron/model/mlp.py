"""Dense feed-forward block, and `MlpSpec`, the one place a layer gets its MLP from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Mapping, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from megatron.config import Config, ModelConfig


class MLP(nn.Module):
    """h -> ffn -> h: GELU (tanh approximation), or SwiGLU when `config.swiglu`.

    With SwiGLU, linear_fc1 produces 2 * ffn channels [a, b] and the activation is
    silu(a) * b, the layout of Megatron's fused fc1 (a checkpoint's fc1 rows load unchanged).
    Under tensor parallelism (megatron.parallelize.tensor_parallelism) each rank holds ffn / tp
    channels: fc1 is split by output rows (with SwiGLU in strided blocks, so a rank's rows are
    [its a rows; its b rows], Megatron's layout) and fc2 by input columns.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_size = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        bias = config.add_bias_linear
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_size, bias=bias)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        intermediate = self.linear_fc1(hidden_states)
        if self.swiglu:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up
        else:
            # tanh approximation: what Megatron's default fused bias-GELU kernel computes.
            intermediate = F.gelu(intermediate, approximate="tanh")
        return self.linear_fc2(intermediate)


class MlpSpec:
    """Which feed-forward module each layer of a GPT model gets, and its FLOPs: here the dense
    MLP in every layer.

    An extension subclasses it to give some layers another module (moe.mlp_spec: MoE layers),
    and the entry point hands that spec to `GPTModel`; the model never imports the extension.
    Such a module maps hidden states [b, s, h] -> [b, s, h]. Its plain torch layers are
    initialized and parallelized like the model's. What it owns beyond them: its weights and
    buffers it initializes by `init_own_weights(std, output_std)` (Megatron's init; the model
    calls it on any submodule defining it); its tensor-parallel form comes from the styles this
    spec names (`tensor_parallel_styles`), applied by the same step as the model's own
    (megatron.parallelize.tensor_parallelism), and likewise its FP8 form (`fp8_styles`); its
    expert-parallel share it keeps by
    `place_experts(size, rank)` (megatron.parallelize.steps).
    """

    def build(self, config: ModelConfig, layer_number: int) -> nn.Module:
        """The feed-forward module of layer `layer_number` (0-based, as in `decoder.layers.<n>`)."""
        return MLP(config)

    def tensor_parallel_styles(self) -> Mapping[type, Callable]:
        """{module type: style} for the modules this spec builds that tensor parallelism must
        treat beyond their torch layers (megatron.parallelize.tensor_parallelism.TensorParallelStyle);
        the dense MLP is one of the framework's own styles."""
        return {}

    def fp8_styles(self) -> Mapping[type, Callable]:
        """{module type: style(module, recipe) -> None, or why the module stays as it is} for
        the modules this spec builds whose products take FP8 beyond their torch and parallel
        linear layers (megatron.parallelize.fp8_projections); the dense MLP has none."""
        return {}

    def forward_flops_per_token(self, config: ModelConfig, layer_number: int) -> int:
        """Matmul FLOPs of one token's forward through that module (megatron.model.flops)."""
        return dense_mlp_flops_per_token(config.hidden_size, config.ffn_hidden_size, config.swiglu)

    def activation_bytes_per_token(
        self, config: ModelConfig, layer_number: int, compute_bytes: int
    ) -> Tuple[float, float]:
        """Bytes that module keeps for backward per token of a training forward, from its
        input on (megatron.memory_plan): (expected, worst case). They differ for modules whose
        work per token depends on the data, such as routed experts."""
        per_token = dense_mlp_activation_bytes_per_token(
            config.hidden_size,
            config.ffn_hidden_size // config.tensor_model_parallel_size,
            config.swiglu,
            compute_bytes,
        )
        return per_token, per_token

    def expert_parallel_sizes(self, data_parallel_size: int) -> List[int]:
        """The expert-parallel sizes (ParallelConfig.expert_model_parallel_size, dividing
        `data_parallel_size`) its modules can be split over; the dense MLP has no experts."""
        return [1]

    def memory(self, config: Config, layer_numbers: Sequence[int]) -> MlpMemory:
        """What the modules of layers `layer_numbers` (a rank's pipeline stage) hold beyond
        their parameters, gradients and the activations of `activation_bytes_per_token`
        (megatron.memory_plan); the dense MLP holds nothing more."""
        return MlpMemory()


@dataclass(frozen=True)
class MlpMemory:
    """Bytes per rank an MlpSpec's modules add to the memory planner's parts: persistent
    compute-dtype copies of weights, gradients held from one micro-batch to the next, weight
    casts each in-flight micro-batch saves for its backward, and how many weight elements get
    their gradients from the modules themselves rather than as autograd's fp32 `.grad`."""

    weight_copies: int = 0
    held_gradients: int = 0
    casts_per_micro_batch: int = 0
    self_accumulated_weights: int = 0


def dense_mlp_activation_bytes_per_token(
    hidden_size: int, local_ffn_hidden_size: int, gated: bool, compute_bytes: int
) -> int:
    """Bytes `MLP.forward` keeps per token for backward under autocast (`compute_bytes` 2 for
    bf16/fp16, 4 in fp32): fc1's input cast to the compute dtype, fc1's output (which the
    activation saves; SwiGLU's two halves), the activation's output (fc2's input), and with
    SwiGLU silu(gate) too (the product saves it and `up`)."""
    ffn = local_ffn_hidden_size
    fc1_output = 2 * ffn if gated else ffn
    gate_activation = ffn if gated else 0
    return compute_bytes * (hidden_size + fc1_output + gate_activation + ffn)


def dense_mlp_flops_per_token(hidden_size: int, ffn_hidden_size: int, gated: bool) -> int:
    """Forward matmul FLOPs per token of h -> ffn (2 ffn when gated) -> h."""
    fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
    return 2 * hidden_size * fc1_out + 2 * ffn_hidden_size * hidden_size


DENSE_MLP = MlpSpec()
