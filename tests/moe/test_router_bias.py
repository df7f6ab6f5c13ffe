"""DeepSeek-V3's expert-bias update under data parallelism: counts are summed over ranks first,
so every rank moves its bias the same way (docs/moe.md)."""

import torch

from moe.router import update_expert_bias
from tests.launch import run_distributed


def _update_on_rank(rank: int, world_size: int) -> list:
    # Rank 0 overloads expert 0, rank 1 overloads expert 3: alone, each would push its own
    # expert down; summed, experts 0 and 3 are equally loaded.
    local_counts = (
        torch.tensor([9.0, 1.0, 1.0, 1.0]) if rank == 0 else torch.tensor([1.0, 1.0, 1.0, 9.0])
    )
    bias = torch.zeros(4)
    update_expert_bias(bias, local_counts, rate=0.5)
    return bias.tolist()


def test_every_rank_applies_the_update_of_the_summed_counts():
    biases = run_distributed(_update_on_rank, 2)
    assert biases[0] == biases[1]
    summed = torch.tensor([10.0, 2.0, 2.0, 10.0])
    expected = 0.5 * torch.sign(summed.mean() - summed)
    assert biases[0] == expected.tolist()
