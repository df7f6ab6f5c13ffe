"""What autograd keeps for backward, per token of a micro-batch, layer by layer.

Each term is a tensor the model's forward saves (tests/memory_plan/test_memory_plan.py checks the
sums against `torch.autograd.graph.saved_tensors_hooks` on CPU under bf16 autocast). `c` is the
compute dtype's size (2 under bf16/fp16 autocast, 4 in fp32); the residual stream stays fp32
(the parameters are fp32 and autocast leaves additions alone), so the norms save 4-byte inputs.

- LayerNorm (megatron.model.norms): its fp32 input and per-token mean and rstd: 4h + 8.
  RMSNorm: its fp32 input, the normalized product its weight multiplies, rstd: 8h + 4.
- Attention (megatron.model.attention): linear_qkv's input cast (c h); the fused QKV output
  that SDPA's q, k, v view (c (q + 2 kv)), or with grouped-query attention the query copy and
  the expanded keys and values (3 c q); with RoPE the rotated q and k are new tensors; SDPA's
  output, which linear_proj reads as a view (c q), and its fp32 log-sum-exp (4 per head). The
  flash and memory-efficient kernels keep no s x s scores.
- Dropout (nn.Dropout after attention and MLP, and on the embedding): a mask of `mask_bytes`
  per element (CUDA's native dropout keeps a bool mask).
- The MLP: what its spec reports (megatron.model.mlp.MlpSpec.activation_bytes_per_token).
Tensor parallelism divides the head and ffn terms by its size; sequence parallelism also the
norms' inputs and the masks (the linear layers' gathered inputs stay whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Tuple

from megatron.kernels.linear_cross_entropy import CHUNK_LOGITS_BYTES

if TYPE_CHECKING:
    from megatron.config import ModelConfig
    from megatron.model import MlpSpec

# CUDA's native dropout keeps its mask as bool; the CPU's keeps it in the input's dtype.
CUDA_MASK_BYTES = 1


def norm_bytes_per_token(model: ModelConfig) -> int:
    """Bytes a norm keeps per token for backward (its fp32 input and statistics)."""
    hidden = model.hidden_size
    if model.normalization == "RMSNorm":
        return 8 * hidden + 4
    return 4 * hidden + 8


def attention_bytes_per_token(model: ModelConfig, compute_bytes: int) -> int:
    """Bytes SelfAttention keeps per token (this tensor-parallel rank's heads)."""
    tensor = model.tensor_model_parallel_size
    heads = model.num_attention_heads // tensor
    groups = (model.num_query_groups or model.num_attention_heads) // tensor
    query, key_value = heads * model.kv_channels, groups * model.kv_channels
    rope = model.position_embedding_type == "rope"
    c = compute_bytes
    fused_qkv = c * (query + 2 * key_value)
    query_copied = rope or heads > groups  # RoPE, or GQA's reshape, makes q a new tensor
    if model.recompute_granularity == "selective":
        # The checkpoint keeps q, k, v; SDPA's output is recomputed, but linear_proj keeps it.
        core = fused_qkv + (c * query if query_copied else 0) + (c * key_value if rope else 0)
        return c * model.hidden_size + core + c * query
    if heads > groups:
        core = 3 * c * query  # the query copy and the keys and values expanded to every head
    else:
        core = fused_qkv + (c * (query + key_value) if rope else 0)
    log_sum_exp = 4 * heads
    return c * model.hidden_size + core + c * query + log_sum_exp


def _replicated_share(model: ModelConfig) -> float:
    """The fraction of a sequence-position tensor a rank keeps: 1/tp under sequence parallel."""
    return 1.0 / model.tensor_model_parallel_size if model.sequence_parallel else 1.0


def dropout_mask_bytes_per_token(model: ModelConfig, mask_bytes: int) -> float:
    """One hidden-dropout mask per token; none without dropout."""
    if model.hidden_dropout <= 0.0:
        return 0.0
    return mask_bytes * model.hidden_size * _replicated_share(model)


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per token one transformer layer keeps for backward: expected and worst case
    (they differ only where the MLP's work depends on the routing)."""

    expected: float
    worst_case: float
    mlp_expected: float


def layer_bytes_per_token(
    model: ModelConfig,
    mlp_spec: MlpSpec,
    layer_number: int,
    compute_bytes: int,
    mask_bytes: int = CUDA_MASK_BYTES,
) -> LayerBytes:
    """Bytes per token TransformerLayer `layer_number` keeps, without recomputation of whole
    layers (selective recomputation is in the attention term)."""
    share = _replicated_share(model)
    mask = dropout_mask_bytes_per_token(model, mask_bytes)
    shared = (
        2 * norm_bytes_per_token(model) * share
        + attention_bytes_per_token(model, compute_bytes)
        + 2 * mask
    )
    mlp_expected, mlp_worst = mlp_spec.activation_bytes_per_token(
        model, layer_number, compute_bytes
    )
    return LayerBytes(shared + mlp_expected, shared + mlp_worst, mlp_expected)


def embedding_bytes_per_token(model: ModelConfig, mask_bytes: int = CUDA_MASK_BYTES) -> float:
    """The embedding's token ids (int64, for the table's gradient) and its dropout mask."""
    return 8 + dropout_mask_bytes_per_token(model, mask_bytes)


def output_bytes_per_token(model: ModelConfig, compute_bytes: int) -> float:
    """The final norm's input and the output layer's input cast (gathered under sequence
    parallelism)."""
    return norm_bytes_per_token(model) * _replicated_share(model) + compute_bytes * (
        model.hidden_size
    )


def logits_bytes_per_token(model: ModelConfig, compute_bytes: int, fused: bool) -> float:
    """The logits and the cross-entropy's buffers at their peak, in the loss's backward.

    Fused kernel (megatron.kernels.cross_entropy; one rank's vocabulary): it keeps the logits
    in the compute dtype and an fp32 log-sum-exp, and writes the logits' gradient beside them.
    Vocabulary-parallel (megatron.tensor_parallel.cross_entropy): an fp32 softmax of the
    rank's shard, then its gradient cast to the compute dtype. The plain reference (no
    Triton): an fp32 log-softmax and fp32 gradients of it, then the cast.
    """
    vocab = model.padded_vocab_size // model.tensor_model_parallel_size
    if model.tensor_model_parallel_size > 1:
        return 4 * vocab + compute_bytes * vocab
    if fused:
        return 2 * compute_bytes * vocab + 4
    return 3 * 4 * vocab + compute_bytes * vocab


def fused_linear_loss_bytes(model: ModelConfig, tokens: int, compute_bytes: int) -> int:
    """--cross-entropy-fusion-impl linear (megatron.kernels.linear_cross_entropy): no logits are
    kept. At the peak, in the loss's backward: one chunk's logits and their gradient in the
    compute dtype, the fp32 sum of the output weight's gradient, and the fp32 losses and
    log-sum-exp of every token."""
    vocab = model.padded_vocab_size
    rows = min(tokens, max(1, CHUNK_LOGITS_BYTES // (vocab * compute_bytes)))
    return 2 * rows * vocab * compute_bytes + 4 * vocab * model.hidden_size + 8 * tokens


def backward_workspace_per_token(model: ModelConfig, layer: LayerBytes) -> float:
    """Gradients alive at once inside one layer's backward: the fp32 residual gradient and its
    partial sum, and about as much as the MLP keeps (the gradients of its saved tensors)."""
    return 8 * model.hidden_size * _replicated_share(model) + layer.mlp_expected


def in_flight_micro_batches(
    pipeline_size: int,
    pipeline_rank: int,
    num_micro_batches: int,
    virtual_size: int | None,
) -> Tuple[int, int]:
    """(micro-batch forwards whose activations a stage holds at once under 1F1B, in units of
    model chunks; chunks per micro-batch). Without a pipeline: one micro-batch at a time.
    Interleaved: Megatron's warm-up count plus one."""
    if pipeline_size == 1:
        return 1, 1
    if virtual_size is None:
        return min(pipeline_size - pipeline_rank, num_micro_batches), 1
    warmup = (pipeline_size - pipeline_rank - 1) * 2 + (virtual_size - 1) * pipeline_size
    return min(warmup + 1, num_micro_batches * virtual_size), virtual_size


def recompute_kept_fraction(model: ModelConfig, num_layers: int) -> Tuple[float, float, int]:
    """Full recomputation of `num_layers` stage layers: (the fraction of layers whose
    activations stay, checkpoints kept per micro-batch, layers re-run at once in backward)."""
    if model.recompute_granularity != "full" or num_layers == 0:
        return 1.0, 0, 0
    per_chunk = min(model.recompute_num_layers or 1, num_layers)
    if model.recompute_method == "uniform":
        return 0.0, -(-num_layers // per_chunk), per_chunk
    return (num_layers - per_chunk) / num_layers, per_chunk, 1
