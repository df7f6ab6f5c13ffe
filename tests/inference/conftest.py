"""Fixtures of the inference tests."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """The tiny models' ops are microseconds long: waking a second intra-op thread for each
    costs more than it saves, and far more on a machine whose other cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
