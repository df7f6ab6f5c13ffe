"""The expert-parallel exchange's flags, read and checked against the run's layout:
--moe-expert-parallel-buffer-factor, --moe-expert-parallel-chunked-overlap and
--moe-expert-parallel-comm-chunks (moe.exchange runs the exchanges they choose).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megatron.config import Config, ConfigError
from moe.exchange.fixed_blocks import block_capacity

if TYPE_CHECKING:
    from moe.config import MoEConfig

DEFAULT_EXCHANGE_CHUNKS = 2  # --moe-expert-parallel-comm-chunks


def exchange_chunks(args: argparse.Namespace) -> int:
    """The chunks each layer's fixed-size exchange is cut into: the flag's under
    --moe-expert-parallel-chunked-overlap, else one; ConfigError for a count that overlaps nothing
    or that the overlap flag's absence leaves unused."""
    chunks = args.moe_expert_parallel_comm_chunks
    # Checkpoints saved before the flag had a name of its own hold the chunked overlap under
    # the attribute of Megatron-Core's spelling, which no parser here sets any more.
    overlap = args.moe_expert_parallel_chunked_overlap or getattr(
        args, "overlap_moe_expert_parallel_comm", False
    )
    if not overlap:
        # The default is in every saved namespace, so only another value says it was asked for.
        if chunks != DEFAULT_EXCHANGE_CHUNKS:
            raise ConfigError(
                f"--moe-expert-parallel-comm-chunks {chunks} takes effect only under "
                "--moe-expert-parallel-chunked-overlap; add it or drop the flag"
            )
        return 1
    if chunks < 2:
        raise ConfigError(
            f"--moe-expert-parallel-comm-chunks {chunks} under --moe-expert-parallel-chunked-overlap: "
            "it needs 2 or more (one chunk leaves nothing to overlap); raise it or drop the "
            "overlap flag"
        )
    return chunks


def routed_rows_per_rank(moe: MoEConfig, config: Config) -> int:
    """The rows a rank's MoE layer routes per micro-batch: its tokens (the sequence split over
    the tensor-parallel ranks under --sequence-parallel) times top-k."""
    model = config.model
    tokens = config.training.micro_batch_size * model.seq_length
    if model.sequence_parallel:
        tokens //= model.tensor_model_parallel_size
    return tokens * moe.top_k


def check_exchange(moe: MoEConfig, expert_parallel_size: int, rows_per_rank: int) -> None:
    """The expert-parallel exchange's flags (--moe-expert-parallel-buffer-factor,
    --moe-expert-parallel-chunked-overlap and its chunks) against the layout: refused
    (ConfigError, one line) where they would do nothing or only slow the run.
    `rows_per_rank`: the rows a rank's MoE layer routes per micro-batch (tokens x top-k)."""
    factor = moe.expert_parallel_buffer_factor
    if factor is not None:
        if expert_parallel_size == 1:
            raise ConfigError(
                f"--moe-expert-parallel-buffer-factor {factor} sizes the blocks of the "
                "expert-parallel exchange, and there is none at expert parallel size 1; set "
                "--expert-model-parallel-size > 1 or drop the flag"
            )
        if not moe.dropless:
            raise ConfigError(
                f"--moe-expert-parallel-buffer-factor {factor} sizes the dropless MoE's "
                "exchange; the capacity MoE (--no-moe-dropless) exchanges its fixed slots "
                "already: drop the flag"
            )
    if moe.expert_parallel_chunks == 1:
        return
    if expert_parallel_size == 1:
        raise ConfigError(
            "--moe-expert-parallel-chunked-overlap overlaps the expert-parallel all-to-all, "
            "and there is none at expert parallel size 1; set "
            "--expert-model-parallel-size > 1 or drop the flag"
        )
    if not moe.dropless:
        raise ConfigError(
            "--moe-expert-parallel-chunked-overlap pipelines the dropless MoE's exchange; the "
            "capacity MoE (--no-moe-dropless) exchanges its slots in one all-to-all: drop "
            "the flag"
        )
    if factor is None:
        raise ConfigError(
            "--moe-expert-parallel-chunked-overlap cuts the fixed-size blocks exchange into "
            "chunks; add --moe-expert-parallel-buffer-factor (e.g. 1.5) (the exact exchange "
            "already overlaps its all-to-alls with the rank's own rows)"
        )
    chunks = moe.expert_parallel_chunks
    # Each chunk's slice of a block holds at least 8 rows (block_capacity): past this many
    # chunks the slices are padded beyond the factor's block, and every chunk adds its
    # launches and all-to-alls for rows that are not there.
    share = block_capacity(rows_per_rank, expert_parallel_size, factor)
    most = max(2, share // 8)
    if chunks > most:
        padded = block_capacity(rows_per_rank, expert_parallel_size, factor, chunks)
        raise ConfigError(
            f"--moe-expert-parallel-comm-chunks {chunks} cuts each expert-parallel block of "
            f"{share} rows (--moe-expert-parallel-buffer-factor {factor} x the balanced share "
            f"of the {rows_per_rank} rows a rank routes per micro-batch) into slices of at "
            f"least 8 rows, padding it to {padded}; use at most {most} chunks"
        )
