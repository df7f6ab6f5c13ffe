"""Compile every Triton kernel of the project ahead of time for MI300X, MI250X and H100.

    python tools/compile_kernels.py            # one line per (kernel, target): artifact sizes or the error
    python tools/compile_kernels.py --json     # the same report as JSON
    python tools/compile_kernels.py --list     # the kernel specializations, as JSON
    python tools/compile_kernels.py --covering # fewer builds that cover every kernel's argument
                                               # types and constexpr values on every target

Runs on any machine, GPU or not (megatron.kernels.aot says what it builds and how); exits 1 when a
kernel fails to build for a target. Run it without TRITON_INTERPRET set. The library is
megatron.kernels.aot; this tool names the packages whose kernels it builds.
"""

import sys

from megatron.kernels.aot import main

# Every package whose modules list AOT_SPECS: the dense model's kernels and the MoE kernels.
KERNEL_PACKAGES = ("megatron.kernels", "moe.kernels")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], KERNEL_PACKAGES))
