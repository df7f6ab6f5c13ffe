"""Session set-up and fixtures shared by every test."""

import os

import pytest
import torch

from tests import triton_interpreter
from tests.sample_data import CORPUS, copy_dataset, gpt2_preprocess_args

# Without a GPU, MoE kernel tests run their Triton kernels through the interpreter; this must
# happen before any test module imports triton.
if not torch.cuda.is_available():
    triton_interpreter.enable()

from megatron.kernels import dispatch  # noqa: E402  (after the interpreter is set up)


@pytest.fixture(scope="session")
def sample_prefix(tmp_path_factory):
    """The bundled corpus preprocessed once per session (GPT-2 BPE, --append-eod); tests must
    not change its files (copy them first; runs write index caches beside them)."""
    from tools import preprocess_data

    prefix = tmp_path_factory.mktemp("owt") / "owt"
    assert preprocess_data.main(gpt2_preprocess_args(CORPUS, prefix)) == 0
    return f"{prefix}_text_document"


@pytest.fixture(scope="module")
def data_prefix(sample_prefix, tmp_path_factory):
    """`sample_prefix`'s dataset in a directory of the test module's own: the index caches one
    module's runs write beside it are not there for another module's."""
    return copy_dataset(sample_prefix, str(tmp_path_factory.mktemp("owt") / "owt_text_document"))


@pytest.fixture
def triton_kernels(monkeypatch):
    """Run the public ops through their Triton kernels: the interpreter on CPU tensors, for the
    kernel-vs-reference tests (megatron/kernels, moe/kernels, bench/kernels)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these kernel-vs-reference tests use CPU tensors and Triton's CPU interpreter")
    force_kernel_mode(monkeypatch, "triton")


def force_kernel_mode(monkeypatch, mode: str) -> None:
    """Every op of this test in kernel `mode` (megatron.kernels.dispatch), in this process and
    in the processes it starts (MOE_KERNELS, which they read at their first op)."""
    monkeypatch.setattr(dispatch, "_mode", mode)
    monkeypatch.setenv("MOE_KERNELS", mode)


@pytest.fixture
def reference_kernels(monkeypatch):
    """The plain-PyTorch references of every kernel, here and in started processes."""
    force_kernel_mode(monkeypatch, "reference")
