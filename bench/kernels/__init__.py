"""Experimental Triton kernels that only the benchmarks use; the product's are in moe.kernels."""
