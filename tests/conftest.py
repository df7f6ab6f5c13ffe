"""Session set-up shared by every test."""

import torch

from tests import triton_interpreter

# Without a GPU, MoE kernel tests run their Triton kernels through the interpreter; this must
# happen before any test module imports triton.
if not torch.cuda.is_available():
    triton_interpreter.enable()
