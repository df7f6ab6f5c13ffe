"""The optional-Triton policy of megatron.kernels.dispatch: every module of both kernel packages
imports without Triton, lists no AOT_SPECS, and its ops run their references even when
MEGATRON_KERNELS=triton asks for kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# In a child process: `sys.modules["triton"] = None` makes `import triton` fail and
# importlib.util.find_spec("triton") answer None, as on a machine without Triton.
WITHOUT_TRITON = """
import importlib, os, pkgutil, sys
sys.modules["triton"] = None
os.environ["MEGATRON_KERNELS"] = "triton"
import torch
from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton
assert not TRITON_AVAILABLE and not use_triton(torch.zeros(1))
for package_name in ("megatron.kernels", "moe.kernels"):
    package = importlib.import_module(package_name)
    for info in pkgutil.walk_packages(package.__path__, prefix=package_name + "."):
        module = importlib.import_module(info.name)
        assert getattr(module, "AOT_SPECS", []) == [], info.name

from megatron.kernels import accumulate, cross_entropy
from moe.kernels import grouped_gemm, permute, router_topk, scaled_activation, token_rows

expert_indices = torch.tensor([[2, 0], [1, 0], [2, 1]])
order, slot_of, counts = token_rows.sort_assignments(expert_indices, 3)
x = torch.randn(3, 4)
rows = token_rows.gather_rows(x, order, slot_of, 2)
assert torch.equal(rows, token_rows.gather_rows_reference(x, order, 2))
bins = torch.cumsum(counts, 0).int()
padded = permute.padded_gather(x, order.int(), bins, permute.padded_bins(counts, 4), 2)
assert torch.equal(
    padded, permute.padded_gather_reference(x, order.int(), bins, permute.padded_bins(counts, 4), 2)
)
weight = torch.randn(3, 4, 5)
counts = torch.tensor([2, 2, 2])
assert torch.equal(
    grouped_gemm.grouped_mm(rows, weight, counts),
    grouped_gemm.grouped_mm_reference(rows, weight, counts),
)
logits, labels = torch.randn(4, 7), torch.tensor([0, 3, 6, 1])
assert torch.equal(
    cross_entropy.cross_entropy(logits, labels),
    cross_entropy.cross_entropy_reference(logits, labels),
)
assert router_topk.topk_indices(torch.rand(5, 4), 2).shape == (5, 2)
assert scaled_activation.scaled_activation(torch.randn(3, 4), torch.rand(3), "gelu").shape == (3, 4)
total = torch.zeros(6)
accumulate.accumulate_(total, torch.ones(6, dtype=torch.bfloat16))
assert torch.equal(total, torch.ones(6))
assert sys.modules["triton"] is None
print("ok")
"""


def test_kernel_packages_import_and_run_their_references_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
