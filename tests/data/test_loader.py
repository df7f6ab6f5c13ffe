"""megatron.data.loader.build_data_iterator, the loader pretraining reads its micro-batches from:
the sampler's batches for this rank, and a private generator that leaves the global RNG alone."""

import numpy as np
import pytest
import torch

from megatron.config.sections import parse_config
from megatron.data import loader as data_loader
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.initialize import DistributedContext
from tests.tiny_gpt import tiny_gpt_args

CPU_CONTEXT = DistributedContext(0, 1, 0, torch.device("cpu"), None)


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, index):
        return {"text": np.full(3, index, dtype=np.int64)}


@pytest.fixture
def second_of_two_replicas(monkeypatch):
    """The Config of micro-batch 2 on two data-parallel ranks, read as the second of them."""
    argv = tiny_gpt_args("unread-prefix", micro_batch=2, global_batch=4)
    monkeypatch.setattr(data_loader.parallel_state, "get_data_parallel_rank", lambda: 1)
    monkeypatch.setattr(data_loader.parallel_state, "get_data_parallel_world_size", lambda: 2)
    return parse_config(argv, world_size=2)


def test_batches_follow_the_sampler_from_the_consumed_samples(second_of_two_replicas):
    iterator = data_loader.build_data_iterator(Numbers(), 8, second_of_two_replicas, CPU_CONTEXT)
    batches = [batch["text"][:, 0].tolist() for batch in iterator]
    assert batches == list(MegatronPretrainingSampler(40, 8, 2, 1, 2))
    assert batches[0] == [10, 11]


def test_the_loader_draws_nothing_from_the_global_rng(second_of_two_replicas):
    # A DataLoader without its own generator draws its base seed from the global RNG when an
    # iterator starts; a resumed run would then see another dropout stream than an
    # uninterrupted one.
    before = torch.get_rng_state()
    iterator = data_loader.build_data_iterator(Numbers(), 0, second_of_two_replicas, CPU_CONTEXT)
    next(iterator)
    assert torch.equal(torch.get_rng_state(), before)


def test_no_iterator_without_samples(second_of_two_replicas):
    assert data_loader.build_data_iterator(None, 0, second_of_two_replicas, CPU_CONTEXT) is None
    assert data_loader.build_data_iterator([], 0, second_of_two_replicas, CPU_CONTEXT) is None
