"""Triton kernels for MoE: each op's file holds its autograd wrapper and PyTorch reference, and its
kernels too, or, for the larger ops (grouped_gemm, permute), in a `*_kernels.py` file beside it."""
