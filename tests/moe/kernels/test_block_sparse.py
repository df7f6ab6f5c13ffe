"""Block-sparse dMoE products: Triton kernels (through Triton's CPU interpreter) and PyTorch
references against masked dense matmuls in fp64."""

import pytest
import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE  # noqa: E402
from moe.kernels.block_sparse import Topology, dds_t, dsd, dsd_t, sdd, sparse_mlp  # noqa: E402
from moe.kernels.block_sparse import ops as block_sparse_ops  # noqa: E402
from tests.conftest import force_kernel_mode

pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")

BLOCK = 16
HIDDEN = 32
FFN = 32
NUM_EXPERTS = 3
REFERENCES = ("sdd_reference", "dsd_reference", "dsd_t_reference", "dds_t_reference")


@pytest.fixture(params=["triton", "reference"])
def kernel_path(request, monkeypatch):
    """Runs a test once through the Triton kernels (references made to fail) and once through
    the PyTorch references."""
    if request.param == "triton":
        request.getfixturevalue("triton_kernels")
        from triton.runtime.interpreter import InterpretedFunction

        from moe.kernels.block_sparse import kernels

        if not isinstance(kernels._sdd_kernel, InterpretedFunction):
            pytest.fail(
                "moe.kernels.block_sparse.kernels was imported before this module set "
                "TRITON_INTERPRET=1, so its kernels cannot run on the CPU; run this file alone."
            )
        for name in REFERENCES:

            def refuse(*args, _name=name, **kwargs):
                raise AssertionError(f"{_name} ran instead of the Triton kernel")

            monkeypatch.setattr(block_sparse_ops.reference, name, refuse)
    else:
        force_kernel_mode(monkeypatch, "reference")
    return request.param


def _random_padded_bins(generator: torch.Generator, empty_expert: int) -> torch.Tensor:
    tokens = torch.randint(1, 2 * BLOCK + 1, (NUM_EXPERTS,), generator=generator)
    tokens[empty_expert] = 0
    padded = (tokens + BLOCK - 1) // BLOCK * BLOCK
    return padded.cumsum(0).to(torch.int32)


def _expert_mask(padded_bins: torch.Tensor) -> torch.Tensor:
    """[M, E*F] fp64: 1 where row and column belong to the same expert (built independently
    of Topology)."""
    ends = padded_bins.tolist()
    mask = torch.zeros(ends[-1], NUM_EXPERTS * FFN, dtype=torch.float64)
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        mask[start:end, expert * FFN : (expert + 1) * FFN] = 1
    return mask


def _to_dense(data: torch.Tensor, topology: Topology) -> torch.Tensor:
    dense = torch.zeros(topology.num_rows, topology.num_columns, dtype=torch.float64)
    for block, (row, column) in enumerate(
        zip(topology.row_indices.tolist(), topology.column_indices.tolist())
    ):
        dense[row * BLOCK : (row + 1) * BLOCK, column * BLOCK : (column + 1) * BLOCK] = data[block]
    return dense


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    # Relative to the tensor's scale: per-element relative error is meaningless near zero.
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual.double() - expected.double()).abs().max() / scale
    assert error <= rtol, f"relative error {error:.2e} > {rtol:.0e}"


def test_topology_row_and_column_major_orders_agree():
    padded_bins = torch.tensor([32, 32, 48], dtype=torch.int32)
    topology = Topology.from_padded_bins(padded_bins, FFN, BLOCK)
    assert (topology.nnz, topology.num_rows, topology.num_columns) == (6, 48, 96)
    assert topology.row_indices.tolist() == [0, 0, 1, 1, 2, 2]
    assert topology.column_indices.tolist() == [0, 1, 0, 1, 4, 5]
    assert topology.offsets.tolist() == [0, 2, 4, 6]
    # The empty expert 1 owns columns 2 and 3, which hold no blocks.
    assert topology.column_offsets.tolist() == [0, 2, 4, 4, 4, 5, 6]
    assert topology.row_indices_t.tolist() == [0, 1, 0, 1, 2, 2]
    assert topology.block_permutation_t.tolist() == [0, 2, 1, 3, 4, 5]
    for tensor in (topology.row_indices, topology.offsets, topology.block_permutation_t):
        assert tensor.dtype == torch.int32


@pytest.mark.parametrize(
    "padded_bins,ffn,block,message",
    [
        ([16, 40], FFN, BLOCK, "padded_bins\\[1\\]=40"),
        ([32, 16], FFN, BLOCK, "nondecreasing"),
        ([16], 24, BLOCK, "ffn_per_expert=24"),
        ([24], 24, 24, "block_size=24"),
    ],
)
def test_topology_rejects_bad_shapes(padded_bins, ffn, block, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_padded_bins(torch.tensor(padded_bins), ffn, block)


@pytest.mark.parametrize("seed,empty_expert,hidden", [(0, 1, HIDDEN), (1, 0, 40), (2, 2, 24)])
def test_products_match_masked_dense(kernel_path, seed, empty_expert, hidden):
    generator = torch.Generator().manual_seed(seed)
    padded_bins = _random_padded_bins(generator, empty_expert)
    topology = Topology.from_padded_bins(padded_bins, FFN, BLOCK)
    mask = _expert_mask(padded_bins)
    rows, columns = mask.shape
    x = torch.randn(rows, hidden, generator=generator)
    w = torch.randn(hidden, columns, generator=generator)
    w_t = torch.randn(columns, hidden, generator=generator).t()  # a transposed view, not a copy
    dense_out = torch.randn(columns, hidden, generator=generator)
    data = torch.randn(topology.nnz, BLOCK, BLOCK, generator=generator)
    sparse = _to_dense(data, topology)
    assert torch.equal(sparse != 0, mask != 0)

    _assert_close(_to_dense(sdd(x, w, topology), topology), (x.double() @ w.double()) * mask, 1e-4)
    _assert_close(
        _to_dense(sdd(x, w_t, topology), topology), (x.double() @ w_t.double()) * mask, 1e-4
    )
    _assert_close(dsd(data, topology, dense_out), sparse @ dense_out.double(), 1e-4)
    _assert_close(dsd(data, topology, w.t()), sparse @ w.t().double(), 1e-4)
    _assert_close(dsd_t(data, topology, x), sparse.t() @ x.double(), 1e-4)
    _assert_close(dds_t(x, data, topology), x.double().t() @ sparse, 1e-4)


def _dense_mlp_grads(x, w1, w2, mask, grad_out):
    x, w1, w2 = (tensor.detach().double().requires_grad_() for tensor in (x, w1, w2))
    hidden = torch.nn.functional.gelu((x @ w1) * mask, approximate="tanh")
    out = hidden @ w2
    out.backward(grad_out.double())
    return out.detach(), x.grad, w1.grad, w2.grad


def _sparse_mlp_grads(x, w1, w2, topology, grad_out):
    x, w1, w2 = (tensor.detach().clone().requires_grad_() for tensor in (x, w1, w2))
    out = sparse_mlp(x, w1, w2, topology)
    out.backward(grad_out)
    return out.detach(), x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("seed,empty_expert", [(3, 1), (4, 2)])
def test_sparse_mlp_forward_and_backward_match_dense(kernel_path, seed, empty_expert):
    generator = torch.Generator().manual_seed(seed)
    padded_bins = _random_padded_bins(generator, empty_expert)
    topology = Topology.from_padded_bins(padded_bins, FFN, BLOCK)
    mask = _expert_mask(padded_bins)
    rows, columns = mask.shape
    x = torch.randn(rows, HIDDEN, generator=generator)
    w1 = torch.randn(HIDDEN, columns, generator=generator) / HIDDEN**0.5
    w2 = torch.randn(columns, HIDDEN, generator=generator) / FFN**0.5
    grad_out = torch.randn(rows, HIDDEN, generator=generator)

    actual = _sparse_mlp_grads(x, w1, w2, topology, grad_out)
    expected = _dense_mlp_grads(x, w1, w2, mask, grad_out)
    for name, got, want in zip(("out", "dx", "dw1", "dw2"), actual, expected):
        assert got.dtype == torch.float32, name
        _assert_close(got, want, 1e-4)
    # The empty expert's weights see no tokens, so their gradients are exactly zero.
    experts = slice(empty_expert * FFN, (empty_expert + 1) * FFN)
    assert not actual[2][:, experts].any() and not actual[3][experts].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_mlp_low_precision_matches_dense(kernel_path, dtype):
    generator = torch.Generator().manual_seed(5)
    padded_bins = _random_padded_bins(generator, empty_expert=0)
    topology = Topology.from_padded_bins(padded_bins, FFN, BLOCK)
    mask = _expert_mask(padded_bins)
    rows, columns = mask.shape
    x = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    w1 = (torch.randn(HIDDEN, columns, generator=generator) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(columns, HIDDEN, generator=generator) / FFN**0.5).to(dtype)
    grad_out = torch.randn(rows, HIDDEN, generator=generator).to(dtype)

    actual = _sparse_mlp_grads(x, w1, w2, topology, grad_out)
    expected = _dense_mlp_grads(x, w1, w2, mask, grad_out)
    for name, got, want in zip(("out", "dx", "dw1", "dw2"), actual, expected):
        assert got.dtype == dtype, name
        _assert_close(got, want, 3e-2)


def test_ops_reject_mismatched_operands():
    topology = Topology.from_padded_bins(torch.tensor([16, 32]), FFN, BLOCK)
    with pytest.raises(TypeError, match="one dtype"):
        sdd(torch.randn(32, 8), torch.randn(8, 64, dtype=torch.float64), topology)
    with pytest.raises(ValueError, match="does not match"):
        sdd(torch.randn(48, 8), torch.randn(8, 64), topology)
    with pytest.raises(ValueError, match="data has shape"):
        dsd(torch.randn(3, BLOCK, BLOCK), topology, torch.randn(64, 8))
    with pytest.raises(ValueError, match="activation='relu'"):
        sparse_mlp(torch.randn(32, 8), torch.randn(8, 64), torch.randn(64, 8), topology, "relu")
