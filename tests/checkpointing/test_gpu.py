"""A checkpoint saved on a GPU resumes the CUDA RNG there and loads on a CPU-only model."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing import checkpoint_file, load_checkpoint, save_checkpoint
from tests.checkpointing.helpers import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    build,
    checkpoint_config,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


def build_on_gpu(seed: int = 0):
    model, _, scheduler = build(seed)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler.optimizer = optimizer
    return model, optimizer, scheduler


def test_gpu_round_trip_restores_cuda_rng(tmp_path):
    model, optimizer, scheduler = build_on_gpu()
    tokens = torch.randint(0, 64, (2, 9), device="cuda")
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    torch.cuda.manual_seed(11)
    save_checkpoint(checkpoint_config(tmp_path), 1, model, optimizer, scheduler)
    expected = torch.rand(4, device="cuda")
    state = torch.load(checkpoint_file(str(tmp_path), 1), weights_only=False)
    assert "cuda_rng_state" in state["rng_state"][0]

    torch.cuda.manual_seed(12)
    resumed, resumed_optimizer, resumed_scheduler = build_on_gpu(seed=5)
    load_checkpoint(checkpoint_config(tmp_path), resumed, resumed_optimizer, resumed_scheduler)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    assert_state_dicts_equal(resumed.state_dict(), model.state_dict())
    assert_optimizer_states_equal(resumed_optimizer.state_dict(), optimizer.state_dict())
    assert resumed_optimizer.state_dict()["state"][0]["exp_avg"].is_cuda

    cpu_model, cpu_optimizer, cpu_scheduler = build(seed=6)  # map_location="cpu" at work
    load_checkpoint(checkpoint_config(tmp_path), cpu_model, cpu_optimizer, cpu_scheduler)
    assert_state_dicts_equal(
        cpu_model.state_dict(), {k: v.cpu() for k, v in model.state_dict().items()}
    )
