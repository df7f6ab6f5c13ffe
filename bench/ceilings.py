"""The GPU's two ceilings, measured (the device README's METHOD.md): device-memory bandwidth from a
1 GiB device-to-device copy (bytes read plus written) and bf16 matmul rate through cuBLAS.

    python -m bench.ceilings
"""

from __future__ import annotations

import functools

import torch

from bench.timing import median_ms


def main() -> None:
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(functools.partial(target.copy_, source))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, median of 20")
    print(f"copy 1 GiB: {ms:.3f} ms, {2 * 2**30 / ms / 1e9:.2f} TB/s (read + write)")
    del source, target  # 2 GiB back before the matmuls
    for m, k, n in ((8192, 8192, 8192), (16384, 768, 3072), (16384, 1024, 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ms = median_ms(functools.partial(torch.matmul, a, b))
        print(f"matmul {m} x {k} x {n} bf16: {ms:.3f} ms, {2 * m * k * n / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
