"""Triton kernels for MoE, each file holding the kernel, its autograd wrapper and a PyTorch reference."""
