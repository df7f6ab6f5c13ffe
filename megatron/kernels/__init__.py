"""Triton kernels for the dense GPT model, each file holding the kernel, its autograd op and a PyTorch reference."""
