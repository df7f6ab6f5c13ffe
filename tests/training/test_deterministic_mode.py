"""--deterministic-mode: torch's deterministic algorithms during the run (and only then), the
same results on the CPU, and on a GPU (compiled, bf16) repeatable runs and bit-exact resumes."""

import os

import pytest
import torch

import pretrain_gpt
from gpt_pretraining import pretrain as training_run
from tests.tiny_gpt import MOE_ARGS, tiny_gpt_args


def _losses(result):
    return [step["lm loss"] for step in result.losses]


def test_on_during_the_run_then_restored(data_prefix, monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    seen = []
    real_pretrain = training_run.pretrain

    def recording_pretrain(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real_pretrain(*args, **kwargs)

    monkeypatch.setattr(training_run, "pretrain", recording_pretrain)
    args = tiny_gpt_args(data_prefix, *MOE_ARGS, train_iters=3)
    plain = pretrain_gpt.main(args)
    deterministic = pretrain_gpt.main([*args, "--deterministic-mode"])
    assert seen == [False, True]
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NCCL_ALGO"] == "Ring"
    # The CPU kernels are deterministic already: the same run.
    assert _losses(deterministic) == _losses(plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_runs_repeat_and_resume_bit_exact(data_prefix, tmp_path, monkeypatch):
    """A compiled bf16 dMoE GPT on the GPU: two runs give the same losses at every iteration,
    and 6 iterations, a save, and 6 more from it give those of the 12 straight."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = tiny_gpt_args(data_prefix, *MOE_ARGS, "--bf16", "--deterministic-mode", train_iters=12)
    first = pretrain_gpt.main(args)
    again = pretrain_gpt.main(args)
    assert _losses(first) == _losses(again)
    save = ["--save", str(tmp_path), "--save-interval", "6"]
    stopped = pretrain_gpt.main([*args, *save, "--exit-interval", "6"])
    resumed = pretrain_gpt.main([*args, *save, "--load", str(tmp_path)])
    assert stopped.iteration == 6
    assert _losses(stopped) + _losses(resumed) == _losses(first)
