"""Session set-up and fixtures shared by every test."""

import os
import sys

import pytest
import torch

from tests import triton_interpreter
from tests.quack_stand_in import install_stand_in
from tests.sample_data import CORPUS, copy_dataset, gpt2_preprocess_args

# Under pytest-xdist each worker takes its share of the cores, for torch here and for the
# processes its tests start: torch's threads spin while they wait, so workers that each ran a
# thread per core would keep every core busy waiting for the others.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (_cores or 1) // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, MoE kernel tests run their Triton kernels through the interpreter; this must
# happen before any test module imports triton.
if not torch.cuda.is_available():
    triton_interpreter.enable()

from megatron.kernels import dispatch  # noqa: E402  (after the interpreter is set up)


@pytest.fixture(scope="session")
def sample_prefix(tmp_path_factory):
    """The bundled corpus preprocessed once per session (GPT-2 BPE, --append-eod); tests must
    not change its files (copy them first; runs write index caches beside them)."""
    from megatron.data import preprocess

    prefix = tmp_path_factory.mktemp("owt") / "owt"
    assert preprocess.main(gpt2_preprocess_args(CORPUS, prefix)) == 0
    return f"{prefix}_text_document"


@pytest.fixture(scope="module")
def data_prefix(sample_prefix, tmp_path_factory):
    """`sample_prefix`'s dataset in a directory of the test module's own: the index caches one
    module's runs write beside it are not there for another module's."""
    return copy_dataset(sample_prefix, str(tmp_path_factory.mktemp("owt") / "owt_text_document"))


@pytest.fixture
def triton_kernels(monkeypatch):
    """Run the public ops through their Triton kernels: the interpreter on CPU tensors, for the
    kernel-vs-reference tests (megatron/kernels, moe/kernels)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these kernel-vs-reference tests use CPU tensors and Triton's CPU interpreter")
    force_kernel_mode(monkeypatch, "triton")


def force_kernel_mode(monkeypatch, mode: str) -> None:
    """Every op of this test in kernel `mode` (megatron.kernels.dispatch), in this process and
    in the processes it starts (MEGATRON_KERNELS, which they read at their first op)."""
    monkeypatch.setattr(dispatch, "_mode", mode)
    monkeypatch.setenv("MEGATRON_KERNELS", mode)


def why_quack_cannot_run_here() -> str:
    """Why QuACK's real kernels (moe.kernels.quack_grouped_gemm) cannot run here; "" where they
    can: an sm90+ NVIDIA GPU with quack-kernels installed."""
    from moe.kernels.quack_grouped_gemm import quack_missing, quack_runs_on

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not quack_runs_on(torch.device("cuda")):
        return "QuACK's kernels need an NVIDIA GPU of sm90 or newer"
    missing = quack_missing()
    return f"quack.gemm_interface does not import ({missing})" if missing else ""


@pytest.fixture
def reference_kernels(monkeypatch):
    """The plain-PyTorch references of every kernel, here and in started processes."""
    force_kernel_mode(monkeypatch, "reference")


@pytest.fixture
def stand_in_quack(monkeypatch):
    """quack.gemm_interface as the CPU stand-in of tests/quack_stand_in.py, for one test."""
    install_stand_in(monkeypatch)


@pytest.fixture(scope="module")
def auto_model(tmp_path_factory):
    """transformers' AutoModelForCausalLM, its remote-code module cache (HF_HOME,
    HF_MODULES_CACHE) in a directory of this module's instead of ~/.cache."""
    home = tmp_path_factory.mktemp("hf_home")
    modules = str(home / "modules")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(home))
        patch.setenv("HF_MODULES_CACHE", modules)
        patch.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, dynamic_module_utils

        # Read when transformers is first imported, which may have been before this fixture.
        patch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", modules)
        patch.setattr(sys, "path", list(sys.path))  # init_hf_modules appends the cache to it
        # Remote-code modules another test imported from another cache: set aside meanwhile.
        for name in [name for name in sys.modules if name.startswith("transformers_modules")]:
            patch.delitem(sys.modules, name)
        yield AutoModelForCausalLM
        for name in [name for name in sys.modules if name.startswith("transformers_modules")]:
            del sys.modules[name]
