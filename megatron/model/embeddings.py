"""Input embedding: word embeddings, learned absolute position embeddings, embedding dropout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from megatron.config import ModelConfig


class LanguageModelEmbedding(nn.Module):
    """token ids [b, s] -> hidden states [b, s, h], or this rank's sequence shard
    [b, s / tp, h] with sequence parallelism.

    Position embeddings exist only for `position_embedding_type == "learned_absolute"`; with
    RoPE, positions enter inside attention instead. Under tensor parallelism
    (megatron.parallelize.tensor_parallelism) the word embedding table is split by vocabulary rows;
    the position table stays whole on every rank; with sequence parallelism the dropout becomes
    "keep this rank's sequence shard, then drop out with this rank's stream".
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size
            )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum of word and (if learned) position embeddings, then dropout."""
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            embeddings = embeddings + self.position_embeddings(position_ids)
        return self.embedding_dropout(embeddings)
