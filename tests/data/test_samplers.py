"""MegatronPretrainingSampler: micro-batch layout across data-parallel ranks and exact resume."""

import pytest

from megatron.data.samplers import MegatronPretrainingSampler


def rank_batches(total, consumed, micro, rank, size, drop_last=True):
    return list(MegatronPretrainingSampler(total, consumed, micro, rank, size, drop_last))


def test_ranks_take_consecutive_slices_of_each_global_micro_batch():
    assert rank_batches(13, 0, 2, 0, 3) == [[0, 1], [6, 7]]
    assert rank_batches(13, 0, 2, 1, 3) == [[2, 3], [8, 9]]
    assert rank_batches(13, 0, 2, 2, 3) == [[4, 5], [10, 11]]
    # The trailing partial global batch [12] only appears without drop_last.
    assert rank_batches(13, 0, 2, 0, 3, drop_last=False) == [[0, 1], [6, 7], [12]]
    assert rank_batches(13, 0, 2, 1, 3, drop_last=False) == [[2, 3], [8, 9], []]


@pytest.mark.parametrize("consumed", [0, 6, 24, 30])
def test_resume_continues_at_the_exact_sample(consumed):
    total, micro, size = 100, 3, 2
    for rank in range(size):
        full = rank_batches(total, 0, micro, rank, size)
        skipped = consumed // (micro * size)
        assert rank_batches(total, consumed, micro, rank, size) == full[skipped:]
    # Together the ranks cover every sample from `consumed` on, each exactly once.
    seen = sorted(
        i
        for rank in range(size)
        for batch in rank_batches(total, consumed, micro, rank, size)
        for i in batch
    )
    assert seen == list(range(consumed, consumed + len(seen)))


def test_sampler_errors_name_the_value():
    with pytest.raises(ValueError, match="consumed_samples=10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="total_samples must be > 0, got 0"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="micro_batch_size must be > 0, got 0"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)
