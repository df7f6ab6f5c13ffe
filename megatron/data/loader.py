"""The training loop's data iterators: Megatron's pretraining sampler in a DataLoader."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

import torch

from megatron.data.samplers import MegatronPretrainingSampler
from megatron.parallel import parallel_state

if TYPE_CHECKING:
    from megatron.config import Config
    from megatron.initialize import DistributedContext


def build_data_iterator(
    dataset, consumed_samples: int, config: Config, context: DistributedContext
) -> Optional[Iterator]:
    """Micro-batches of this rank's data-parallel replica, starting `consumed_samples` into
    the dataset; the tensor-parallel ranks of a replica read the same micro-batches. None
    without samples: a split asked for none (--eval-iters 0) may have none of full length;
    the train split is checked to hold a global batch when the datasets are built."""
    if dataset is None or len(dataset) == 0:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=config.training.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
    )
    # A private generator: creating the loader must not draw from the global torch RNG,
    # or a resumed run's dropout stream would differ from an uninterrupted one.
    generator = torch.Generator().manual_seed(config.training.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=config.data.num_workers,
        pin_memory=context.device.type == "cuda",
        generator=generator,
        persistent_workers=config.data.num_workers > 0,
    )
    return iter(loader)
