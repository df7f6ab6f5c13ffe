"""Tensor-parallel building blocks: region mappings, parallel layers, vocabulary-parallel
cross-entropy and the RNG tracker. Process groups come from `megatron.parallel.parallel_state`."""

from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    default_init_method,
    gather_tensor_model_parallel_weight,
    set_sequence_parallel_attribute,
    set_tensor_model_parallel_attributes,
    shard_tensor_model_parallel_weight,
)
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.tensor_parallel.parts import (
    PerRankRandom,
    PerRankRandomScope,
    SequenceShard,
    VocabParallelOutputHead,
)
from megatron.tensor_parallel.random import (
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    checkpoint_rng_contexts,
    model_parallel_manual_seed,
    model_parallel_rng_tracker,
    sharded_dropout_rng,
)

__all__ = [
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "PerRankRandom",
    "PerRankRandomScope",
    "RNGStatesTracker",
    "RowParallelLinear",
    "SequenceShard",
    "VocabParallelEmbedding",
    "VocabParallelOutputHead",
    "all_reduce_sequence_parallel_grads",
    "checkpoint",
    "checkpoint_rng_contexts",
    "copy_to_tensor_model_parallel_region",
    "default_init_method",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_tensor_model_parallel_weight",
    "model_parallel_manual_seed",
    "model_parallel_rng_tracker",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_sequence_parallel_attribute",
    "set_tensor_model_parallel_attributes",
    "shard_tensor_model_parallel_weight",
    "sharded_dropout_rng",
    "vocab_parallel_cross_entropy",
]
