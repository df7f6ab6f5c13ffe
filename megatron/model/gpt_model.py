"""GPT: embedding -> pre-LN transformer decoder -> logits (tied or separate output layer).

Tensors are batch-first: token ids [batch, seq], hidden states [batch, seq, hidden],
logits [batch, seq, vocab]. (Megatron keeps [seq, batch, hidden] internally for its
sequence-parallel layout; our sequence-parallel mappings split dim 1 instead.)

The model is plain PyTorch as built: torch layers, the weights of one process, no switch for
any parallelism. Parallelism is applied to it afterwards by megatron.parallelize.steps, which
swaps its parts for their parallel forms (megatron.parallelize.tensor_parallelism); here tensor
parallelism swaps the output head, so the logits stay split by vocabulary over TP ranks and the
loss is the vocabulary-parallel cross-entropy.

Built under ``torch.device("meta")`` the model holds no memory; `init_weights` draws its weights
once they have storage. The constructors' own draws (torch's default inits) never reach the
caller's generator, so the weights `init_weights` draws depend only on the seed, not on where or
in what layout the model was built.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron.kernels.cross_entropy import cross_entropy  # its reference without Triton
from megatron.kernels.linear_cross_entropy import linear_cross_entropy
from megatron.model.embeddings import LanguageModelEmbedding
from megatron.model.mlp import DENSE_MLP, MlpSpec
from megatron.model.norms import RMSNorm
from megatron.model.rotary import RotaryEmbedding
from megatron.model.transformer import TransformerBlock

if TYPE_CHECKING:
    from megatron.config import ModelConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")

# Linear layers whose output is added to the residual stream; Megatron scales their init
# by 1 / sqrt(2 * num_layers) so the residual variance does not grow with depth.
OUTPUT_PROJECTION_NAMES = ("linear_proj", "linear_fc2")


class OutputHead(nn.Module):
    """Final hidden states [b, s, h] and the [vocab, h] output weight -> logits [b, s, vocab],
    or with `labels` [b, s] the per-token fp32 losses [b, s]. It holds no parameter (the weight
    is the model's `output_weight()`); tensor parallelism swaps it for its vocabulary-parallel
    form (megatron.tensor_parallel.parts). `fused_linear` (--cross-entropy-fusion-impl linear):
    the losses without the logits ever stored (megatron.kernels.linear_cross_entropy)."""

    def __init__(self, fused_linear: bool = False) -> None:
        super().__init__()
        self.fused_linear = fused_linear

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if labels is not None and self.fused_linear:
            hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
            return linear_cross_entropy(hidden, weight, labels.reshape(-1)).view_as(labels)
        logits = F.linear(hidden_states, weight)
        if labels is None:
            return logits
        # fp32 math (a 50k-way log-softmax in bf16 is visibly inaccurate) on the bf16 logits:
        # the fused kernel reads them once forward and once backward, no fp32 copy.
        losses = cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
        return losses.view_as(labels)


class GPTModel(nn.Module):
    """Decoder-only language model built from a ModelConfig; see the module docstring for shapes.

    Parameter names follow Megatron-core's local layer spec (they are checkpoint keys):
    embedding.word_embeddings.weight, embedding.position_embeddings.weight,
    decoder.layers.<n>.{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
    pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2}.{weight, bias},
    decoder.final_layernorm.{weight, bias}, output_layer.weight (untied embeddings only).
    `mlp_spec` chooses each layer's feed-forward module (megatron.model.mlp.MlpSpec); MoE layers
    (moe.mlp_spec) hold mlp.router.layer.weight, mlp.experts.{w1, v1, w2}, mlp.bias and
    optionally mlp.shared_expert.{linear_fc1, linear_fc2}.

    A pipeline stage (megatron.pipeline.stages) is built with `pre_process` (it holds the
    embedding), `post_process` (the final norm and the output layer) and the global numbers of
    its layers, which sit at local indices 0, 1, ... With tied embeddings a last stage that is
    not also the first holds its own copy of the word embeddings as `output_layer.weight`,
    marked `shared_embedding` (Megatron's approach); the pipeline keeps it equal to the first
    stage's table. A stage after the first reads its input from `set_input_tensor`.
    """

    def __init__(
        self,
        config: ModelConfig,
        mlp_spec: MlpSpec = DENSE_MLP,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__()
        if config.padded_vocab_size <= 0:
            raise ValueError(
                f"padded_vocab_size={config.padded_vocab_size}: set it from the tokenizer's "
                "vocab size padded to a multiple of --make-vocab-size-divisible-by before "
                "building the model"
            )
        if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={config.position_embedding_type!r} is not supported; "
                f"use one of {POSITION_EMBEDDING_TYPES} (--position-embedding-type)"
            )
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor: Optional[torch.Tensor] = None
        self.mlp_spec = mlp_spec
        with torch.random.fork_rng(devices=[]):  # see the module docstring
            self._build_modules(config, layer_numbers)
        self.init_weights()

    def _build_modules(self, config: ModelConfig, layer_numbers: Optional[Sequence[int]]) -> None:
        self.embedding = LanguageModelEmbedding(config) if self.pre_process else None
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, config.rotary_percent, config.rotary_base
            )
        self.decoder = TransformerBlock(
            config, layer_numbers, final_norm=self.post_process, mlp_spec=self.mlp_spec
        )
        fused_linear = config.linear_cross_entropy_fusion
        self.output_head = OutputHead(fused_linear) if self.post_process else None
        self.output_layer = None
        if self.post_process and (
            config.untie_embeddings_and_output_weights or not self.pre_process
        ):
            # [vocab, hidden], no bias, as in Megatron; the tied case reuses the word embedding
            # table instead, or on a last stage without the embedding, its copy of it. Only its
            # weight is used (the logits are `F.linear` with `output_weight()`).
            self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
            if not config.untie_embeddings_and_output_weights:
                self.output_layer.weight.shared_embedding = True

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron's init: normal(0, std) weights, std / sqrt(2L) for output projections,
        zero biases, unit norm weights. Deterministic given torch.manual_seed. A module that
        draws its weights itself defines `init_own_weights(std, output_std)` and gets the std
        of its own weights (the scaled one for an output projection) and the scaled std for
        output projections inside it: an extension's module (MlpSpec), or a parallel layer
        swapped in by parallelism, which draws its full weight and keeps its shard, so every
        layout gets the single-process weights. On the meta device nothing is drawn."""
        std = self.config.init_method_std
        scaled_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, module in self.named_modules():
            is_output_projection = name.rsplit(".", 1)[-1] in OUTPUT_PROJECTION_NAMES
            layer_std = scaled_std if is_output_projection else std
            if callable(getattr(module, "init_own_weights", None)):
                module.init_own_weights(layer_std, scaled_std)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=layer_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The previous pipeline stage's output: this stage's input in the next forward."""
        self.input_tensor = input_tensor

    def output_weight(self) -> torch.Tensor:
        """The [vocab, hidden] matrix producing logits: the word embeddings unless untied
        (this rank's [vocab / tp, hidden] rows under tensor parallelism)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab], or with `labels` [b, s] the per-token fp32 losses [b, s].

        Losses are unreduced, as Megatron returns them: the caller applies the loss mask and
        averages. `position_ids` [b, s] default to 0..s-1 (used by learned and rotary
        position embeddings alike). Attention is always causal over the whole sequence.
        Under tensor parallelism the logits are this rank's vocabulary shard [b, s, vocab / tp]
        and the losses, identical on every TP rank, come from the vocab-parallel cross-entropy
        (the output head's parallel form).
        A pipeline stage before the last returns its hidden states [b, s, h] instead.
        """
        seq_length = input_ids.shape[1]
        if self.embedding is not None and self.embedding.position_embeddings is not None:
            max_positions = self.config.max_position_embeddings
            if seq_length > max_positions:
                raise ValueError(
                    f"sequence length {seq_length} exceeds max_position_embeddings="
                    f"{max_positions}; raise --max-position-embeddings or shorten --seq-length"
                )
        if self.embedding is not None:
            hidden_states = self.embedding(input_ids, position_ids)
        else:
            hidden_states = self.input_tensor
        rotary_cos_sin = None
        if self.rotary_pos_emb is not None:
            rotary_cos_sin = self.rotary_pos_emb(seq_length, position_ids, input_ids.device)
        hidden_states = self.decoder(hidden_states, rotary_cos_sin)
        if not self.post_process:
            return hidden_states
        return self.output_head(hidden_states, self.output_weight(), labels)
