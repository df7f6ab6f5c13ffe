"""Megatron's sequential pretraining sampler (megatron.data.loader builds the training loop's
DataLoader on it)."""

from __future__ import annotations

from typing import Iterator, List


class MegatronPretrainingSampler:
    """Yields this data-parallel rank's micro-batch of sample indices, in dataset order.

    Global batches of `micro_batch_size * data_parallel_size` consecutive indices start at
    `consumed_samples`, so a resumed run continues at exactly the next unseen sample; rank r
    takes the r-th `micro_batch_size` slice of each. A trailing partial batch is dropped
    unless `drop_last` is False.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(
                f"total_samples must be > 0, got {total_samples} (is the dataset empty?)"
            )
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be in [0, total_samples={total_samples}): "
                "the run has already consumed the whole dataset; ask for more samples"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be > 0, got {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} must be in [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _rank_slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            batch.append(index)
            if len(batch) == self.global_micro_batch_size:
                yield self._rank_slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._rank_slice(batch)
