"""The MoE layers' terms of the memory planner (megatron.memory_plan), which moe.mlp_spec's
`MoEMlpSpec` reports through megatron.model.mlp.MlpSpec's `activation_bytes_per_token` and
`memory`.

Activations per token of a dMoE layer (moe.layers, moe.router, moe.experts; `c` the compute
dtype's size, k = top_k, E experts, f the rank's ffn channels of an expert: the experts' FFN
size, MoEConfig.expert_ffn_hidden_size, over the tensor-parallel size):
- the tokens cast to the compute dtype, which the router and the row gather read: c h;
- the router: its logits (c E), the fp32 scores (4 E), the chosen experts, their weights and
  the sort's order and inverse (int64 and fp32 per assignment): 28 k;
- per routed row: the gathered row (c h) and the experts' MLP. Plain MLP: the first product's
  output and the scaled activation (2 c f) and the row's scale (c). GLU: the two first
  products, the activation, its fp32 product scaled by the router weight and its cast
  (4 c f + 4 f) and the fp32 scale (4). With --moe-memory-optimized-mlp only the first
  products and the scale stay.
The dropless layer computes exactly T k rows on one rank whatever the routing; under expert
parallelism a rank's experts receive T k rows when balanced and, at worst, every row of its
expert-parallel group (P T k). The MoE with capacity computes capacity slots for every
expert: capacity_factor k rows per token (with factor 0, no limit: up to E k at worst).
The shared expert is a dense MLP reading the same cast tokens.

Weights (megatron.config.numerics.Numerics.weight_copies_dtype, moe.experts.refresh_compute_weights,
moe.weight_copies): a bf16/fp16 run with gradient-accumulation fusion keeps a compute-dtype copy
of every expert weight (2 bytes each) and, where the copies add their gradients in place (fp32
`.grad` or bf16 main gradients alike), one micro-batch's gradient of them held for the next
(2 bytes each);
otherwise autocast casts the expert weights in every forward, and each in-flight micro-batch
keeps those casts for its backward. Where the distributed optimizer holds the weights in the
compute dtype (megatron.parallelize.data_parallel) there are neither copies nor casts. With --fp8-format the dMoE's grouped GEMMs keep those copies
quantized too (moe.kernels.fp8_grouped_gemm.QuantizedExpertWeight: the forward's and the input
gradient's layouts, 1 byte each) and refresh them with the copies; the scales are negligible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Tuple

from megatron.model.mlp import MlpMemory, dense_mlp_activation_bytes_per_token
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from moe.config import MoEConfig

if TYPE_CHECKING:
    from megatron.config import Config, ModelConfig


def expert_row_bytes(model: ModelConfig, moe: MoEConfig, compute_bytes: int) -> float:
    """Bytes one routed row keeps in the experts (its gathered input included)."""
    c = compute_bytes
    ffn = moe.expert_ffn_hidden_size(model) // model.tensor_model_parallel_size
    glu = moe.mlp_type == "glu"
    if moe.memory_optimized_mlp:
        experts = (2 * c * ffn if glu else c * ffn) + 4
    elif glu:
        experts = 4 * c * ffn + 4 * ffn + 4
    else:
        experts = 2 * c * ffn + c
    return c * model.hidden_size + experts


def routed_rows_per_token(moe: MoEConfig, expert_parallel_size: int) -> Tuple[float, float]:
    """(expected, worst-case) rows a rank's experts compute per token of its micro-batch, with
    the experts split over `expert_parallel_size` ranks."""
    k = moe.top_k
    if not moe.dropless:
        if moe.capacity_factor > 0:
            rows = moe.capacity_factor * k
            return rows, rows
        return float(k), float(moe.num_experts * k)
    factor = moe.expert_parallel_buffer_factor
    if expert_parallel_size > 1 and factor is not None:
        # Fixed-size blocks (moe.exchange.fixed_blocks): factor x the balanced share, padding rows
        # included, whatever the routing (a step that needs more runs again with more).
        return factor * k, factor * k
    return float(k), float(expert_parallel_size * k)


def moe_activation_bytes_per_token(
    model: ModelConfig, moe: MoEConfig, compute_bytes: int, expert_parallel_size: int
) -> Tuple[float, float]:
    """(expected, worst-case) bytes an MoE layer keeps per token (module docstring)."""
    c = compute_bytes
    fixed = c * model.hidden_size + (c + 4) * moe.num_experts + 28 * moe.top_k
    if moe.shared_expert:
        shared_ffn = moe.shared_expert_ffn_hidden_size or model.ffn_hidden_size
        fixed += (
            dense_mlp_activation_bytes_per_token(
                model.hidden_size,
                shared_ffn // model.tensor_model_parallel_size,
                model.swiglu,
                compute_bytes,
            )
            - c * model.hidden_size
        )  # its input is the cast tokens, counted above
    expected_rows, worst_rows = routed_rows_per_token(moe, expert_parallel_size)
    row = expert_row_bytes(model, moe, compute_bytes)
    return fixed + expected_rows * row, fixed + worst_rows * row


def expert_parameters(
    model: ModelConfig, moe: MoEConfig, layer_numbers: Sequence[int], expert_parallel_size: int
) -> int:
    """Expert weight elements a rank holds in layers `layer_numbers`: E / P experts of
    (2, or 3 with GLU) h x f / tp matrices in each MoE layer."""
    matrices = 3 if moe.mlp_type == "glu" else 2
    per_layer = (
        moe.num_experts
        // expert_parallel_size
        * matrices
        * model.hidden_size
        * (moe.expert_ffn_hidden_size(model) // model.tensor_model_parallel_size)
    )
    return per_layer * sum(moe.is_moe_layer(n) for n in layer_numbers)


def moe_memory(config: Config, moe: MoEConfig, layer_numbers: Sequence[int]) -> MlpMemory:
    """The expert weights' copies, held gradients or per-micro-batch casts (module docstring)."""
    parallel = config.parallel
    expert_parallel_size = parallel.expert_model_parallel_size
    weights = expert_parameters(config.model, moe, layer_numbers, expert_parallel_size)
    numerics = config.numerics
    # FP8 grouped GEMMs keep the copies quantized, in two layouts of a byte each.
    fp8_copies = numerics.fp8_format is not None and moe.dropless and moe.mlp_impl == "grouped"
    data_parallel = data_parallel_mode(config)
    if numerics.weights_in_compute_dtype:
        # The expert weights themselves are in the compute dtype: no copies, no held gradients
        # and no casts (autograd adds each micro-batch's gradient into the main gradient).
        return MlpMemory(weight_copies=2 * weights if fp8_copies else 0)
    if numerics.weight_copies_dtype is None:
        return MlpMemory(casts_per_micro_batch=2 * weights if numerics.autocast else 0)
    # moe.training_hooks._expert_grads_in_place: not when torch DDP reduces the experts.
    in_place = not (data_parallel.in_ddp and expert_parallel_size == 1)
    return MlpMemory(
        weight_copies=(4 if fp8_copies else 2) * weights,
        held_gradients=2 * weights if in_place else 0,
        self_accumulated_weights=weights if in_place else 0,
    )
