"""The GPT run's train, validation and test datasets, with Megatron's sample counts."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron.config import Config
from megatron.data.dataset_splits import get_train_valid_test_num_samples
from megatron.data.errors import check_datasets_serve_run
from megatron.data.gpt_dataset import SPLIT_NAMES, build_train_valid_test_datasets
from megatron.data.mock_dataset import MockGPTDataset
from megatron.initialize import print_rank_0
from megatron.tokenizer import MegatronTokenizer


def build_datasets(
    config: Config, tokenizer: MegatronTokenizer
) -> Dict[str, Optional[torch.utils.data.Dataset]]:
    """Train/valid/test GPT datasets with Megatron's sample counts; with --mock-data synthetic
    ones (megatron/data/mock_dataset.py) over `tokenizer`'s vocabulary and end-of-document id.

    Raises `DatasetError` (a UserError, one line) when they cannot serve the run: no train
    samples, a split without tokens, token ids at or above the padded vocabulary size.
    """
    training, data = config.training, config.data
    num_samples = get_train_valid_test_num_samples(
        global_batch_size=training.global_batch_size,
        eval_interval=training.eval_interval,
        eval_iters=training.eval_iters,
        train_iters=training.train_iters,
        train_samples=training.train_samples,
    )
    print_rank_0("> building train, validation, and test datasets ...")
    if data.mock_data:
        datasets = tuple(
            MockGPTDataset(
                name, index, count, data.seq_length, training.seed, tokenizer.vocab_size,
                tokenizer.eod,
            )
            if count > 0
            else None
            for index, (name, count) in enumerate(zip(SPLIT_NAMES, num_samples))
        )  # fmt: skip
        print_rank_0("    synthetic tokens (--mock-data), no dataset files read")
    else:
        datasets = build_train_valid_test_datasets(
            data.data_path,
            data.split,
            num_samples,
            data.seq_length,
            training.seed,
            train_data_path=data.train_data_path,
            valid_data_path=data.valid_data_path,
            test_data_path=data.test_data_path,
            vocab_size=config.model.padded_vocab_size or None,
            cache_path=data.data_cache_path,
        )
    for name, dataset, requested in zip(SPLIT_NAMES, datasets, num_samples):
        size = len(dataset) if dataset is not None else 0
        print_rank_0(f"    {name}: {size} samples (requested {requested})")
    check_datasets_serve_run(datasets, data.data_path, data.split, training.global_batch_size)
    return dict(zip(SPLIT_NAMES, datasets))
