"""A stand-in for quack.gemm_interface (quack-kernels 0.6.5) on the CPU, without QuACK: its `gemm`
computes the varlen grouped products that QuACK documents, in plain PyTorch, and asserts the
operand layouts its kernels assert. `install_stand_in` puts it in sys.modules (the
`stand_in_quack` fixture of tests/conftest.py does, for a test).

What QuACK leaves unwritten the stand-in fills with NaN, so that a test sees anything that reads
it: the output rows past the last group of a varlen M (QuACK reads cu_seqlens on the device and
checks no total against it). A varlen-K group with no rows gets zeros, as QuACK's kernels write
(moe.kernels.quack_grouped_gemm relies on them; the GPU test checks QuACK itself).
"""

import sys
import types

import torch


def varlen_gemm(
    A,
    B,
    out=None,
    *,
    cu_seqlens_m=None,
    cu_seqlens_k=None,
    A_idx=None,
    tuned=True,
):
    """QuACK's gemm for a varlen M (A [total_M, K], or rows of it by A_idx; B [L, K, N]) or a
    varlen K (A [M, total_K], B [total_K, N]), with QuACK's layout asserts."""
    assert (cu_seqlens_m is None) != (cu_seqlens_k is None)
    cu_seqlens = cu_seqlens_m if cu_seqlens_k is None else cu_seqlens_k
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens[0] == 0
    bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    if cu_seqlens_m is not None:
        rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
        result = torch.full((rows, B.shape[-1]), torch.nan, dtype=A.dtype)
    else:
        result = torch.full((len(bounds), A.shape[0], B.shape[-1]), torch.nan, dtype=A.dtype)
    # QuACK returns before any layout check where there is nothing to multiply: an empty output
    # as it is, an empty reduction as zeros.
    if result.numel() == 0 or A.numel() == 0:
        return _written(result.zero_(), out)
    if cu_seqlens_m is not None:
        assert A.stride(-1) == 1, "varlen_m requires A to be k-major"
        assert 1 in B.stride()[-2:] and B.shape[0] == len(bounds)
        if A_idx is not None:
            assert A_idx.dtype == torch.int32 and A_idx.shape == (cu_seqlens[-1],)
            A = A[A_idx.long()]
        assert A.shape[0] >= cu_seqlens[-1]
        for expert, (start, end) in enumerate(bounds):
            result[start:end] = (A[start:end].float() @ B[expert].float()).to(A.dtype)
    else:
        assert A.stride(-2) == 1, "varlen_k requires A to be m-major"
        assert B.stride(-1) == 1, "varlen_k requires B to be n-major"
        assert A.shape[1] == B.shape[0] >= cu_seqlens[-1]
        for expert, (start, end) in enumerate(bounds):
            product = A[:, start:end].float() @ B[start:end].float()  # zeros where empty
            result[expert] = product.to(A.dtype)
    return _written(result, out)


def _written(result, out):
    if out is None:
        return result
    assert out.shape == result.shape and out.dtype == result.dtype
    return out.copy_(result)


def install_stand_in(monkeypatch) -> None:
    """Make `import quack.gemm_interface` give the stand-in, for one test."""
    package = types.ModuleType("quack")
    package.__version__ = "stand-in"
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm = varlen_gemm
    package.gemm_interface = interface
    monkeypatch.setitem(sys.modules, "quack", package)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)
