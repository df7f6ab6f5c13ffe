"""The padded permute kernels (Triton interpreter on CPU) against their PyTorch references and brute-force loops."""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_kernels")

from moe.kernels import permute  # noqa: E402

# (tokens, top_k, experts, hidden): tiny, because the interpreter runs each program in Python.
CASES = [(1, 1, 1, 16), (7, 2, 4, 48), (7, 4, 8, 16), (64, 2, 8, 16), (64, 1, 4, 48), (1, 4, 4, 48)]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(permute, "POISON_OUTPUTS", True)


@pytest.fixture
def launches(monkeypatch):
    """Counts launches of each kernel, proving the interpreter (not a reference) ran them."""
    counts = {}
    kernels = {
        "gather": permute._gather_kernel,
        "scatter": permute._scatter_kernel,
        "invert": permute._invert_permutation_kernel,
    }
    for name, kernel in kernels.items():
        original = kernel.run

        def run(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return counts


def _routing(tokens, top_k, experts, seed):
    """Random expert choices that leave the last expert empty whenever there is more than one."""
    generator = torch.Generator().manual_seed(seed)
    used = max(experts - 1, 1)
    expert_indices = torch.randint(0, used, (tokens * top_k,), generator=generator)
    tokens_per_expert = torch.bincount(expert_indices, minlength=experts).int()
    _, indices = torch.sort(expert_indices, stable=True)
    return (
        expert_indices,
        tokens_per_expert,
        indices.int(),
        torch.cumsum(tokens_per_expert, 0).int(),
    )


def test_kernels_run_in_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(permute._gather_kernel, InterpretedFunction), (
        "moe.kernels was imported before this module set TRITON_INTERPRET=1; "
        "run with TRITON_INTERPRET=1 in the environment"
    )


def test_padded_bins():
    counts = torch.tensor([0, 5, 8, 1], dtype=torch.int32)
    assert permute.padded_bins(counts, 4).tolist() == [0, 8, 16, 20]


def _padded_rows(tokens_per_expert, block_size=4):
    """Brute force: the buffer row of each sorted slot and the buffer size."""
    rows, start = [], 0
    for count in tokens_per_expert.tolist():
        rows.extend(start + rank for rank in range(count))
        start += -(-count // block_size) * block_size
    return rows, start


def _ops(bins, tokens_per_expert, top_k, reference=False, block_size=4):
    """(gather(x, indices), scatter(y, indices, weights)), kernel or reference."""
    suffix = "_reference" if reference else ""
    padded = permute.padded_bins(tokens_per_expert, block_size)
    gather = getattr(permute, "padded_gather" + suffix)
    scatter = getattr(permute, "padded_scatter" + suffix)
    return (
        lambda x, i: gather(x, i, bins, padded, top_k),
        lambda y, i, w: scatter(y, i, w, bins, padded, top_k),
    )


@pytest.mark.parametrize("tokens,top_k,experts,hidden", CASES[:3])
def test_semantics_match_brute_force(tokens, top_k, experts, hidden):
    _, tokens_per_expert, indices, bins = _routing(tokens, top_k, experts, seed=1)
    x = torch.randn(tokens, hidden)
    rows, size = _padded_rows(tokens_per_expert)
    y = torch.randn(size, hidden)
    weights = torch.rand(tokens * top_k)
    for reference in (False, True):
        gather, scatter = _ops(bins, tokens_per_expert, top_k, reference)
        expected = torch.zeros(size, hidden)
        for slot, row in enumerate(rows):
            expected[row] = x[int(indices[slot]) // top_k]
        torch.testing.assert_close(gather(x, indices), expected, rtol=0, atol=0)
        expected = torch.zeros(tokens, hidden)
        for slot, row in enumerate(rows):
            assignment = int(indices[slot])
            expected[assignment // top_k] += weights[assignment] * y[row]
        torch.testing.assert_close(scatter(y, indices, weights), expected)
        torch.testing.assert_close(
            scatter(y, indices, None), scatter(y, indices, torch.ones_like(weights))
        )


@pytest.mark.parametrize("tokens,top_k,experts,hidden", CASES)
def test_kernel_matches_reference_with_gradients(tokens, top_k, experts, hidden, launches):
    _, tokens_per_expert, indices, bins = _routing(tokens, top_k, experts, seed=tokens * top_k)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=generator)
    weights = torch.rand(tokens, top_k, generator=generator)
    results = []
    for reference in (False, True):
        gather, scatter = _ops(bins, tokens_per_expert, top_k, reference)
        x_leaf = x.clone().requires_grad_()
        weights_leaf = weights.clone().requires_grad_()
        permuted = gather(x_leaf, indices)
        # A nonlinearity between the two makes scatter's input gradient depend on its own input.
        out = scatter(permuted * permuted.detach().sin(), indices, weights_leaf)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        out.backward(grad_out)
        results.append((permuted, out, x_leaf.grad, weights_leaf.grad))
    for kernel_value, reference_value in zip(*results):
        assert not kernel_value.isnan().any()
        torch.testing.assert_close(kernel_value, reference_value, rtol=1e-5, atol=1e-5)
    assert launches["gather"] == 2 and launches["scatter"] == 2


def test_bf16_accumulates_in_fp32():
    """bf16 in and out, sums in fp32: never further from the fp64 result than PyTorch's bf16 path."""
    _, tokens_per_expert, indices, bins = _routing(7, 4, 4, seed=5)
    x = torch.randn(7, 48).bfloat16()
    weights = torch.rand(7 * 4).bfloat16()
    grad_out = torch.randn(7, 48).bfloat16()
    runs = {}
    for name, dtype, reference in (
        ("kernel", torch.bfloat16, False),
        ("torch_bf16", torch.bfloat16, True),
        ("exact", torch.float64, True),
    ):
        x_leaf = x.detach().to(dtype).clone().requires_grad_()
        weights_leaf = weights.detach().to(dtype).clone().requires_grad_()
        gather, scatter = _ops(bins, tokens_per_expert, 4, reference)
        out = scatter(gather(x_leaf, indices), indices, weights_leaf)
        out.backward(grad_out.to(dtype))
        runs[name] = (out, x_leaf.grad, weights_leaf.grad)
    for kernel_value, torch_value, exact in zip(runs["kernel"], runs["torch_bf16"], runs["exact"]):
        assert kernel_value.dtype == torch.bfloat16
        kernel_error = (kernel_value.double() - exact).abs().max().item()
        torch_error = (torch_value.double() - exact).abs().max().item()
        half_ulp = exact.abs().max().item() * 2**-9
        assert kernel_error <= max(torch_error, half_ulp) * 1.01, (kernel_error, torch_error)
