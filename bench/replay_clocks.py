"""One step of a layer replayed as a CUDA graph, timed cold and hot: the GPU's SM clock and power
next to each timing, and the time of each kernel in the two modes.

    python -m bench.replay_clocks [CONFIG_INDEX]   (default 2, the third of bench/moe_layer.CONFIGS)

For the dense layer of the same FLOPs and the compiled dMoE layer it prints, in this order:
replays timed one at a time (the first one cold), 10 and 40 replays back to back, replays one
at a time again, and one at a time after the host slept 5 ms; then the per-kernel GPU time per
step of 10 replays timed alone and 10 back to back, largest differences first. Written to
explain why the dMoE layer measured slower back to back than alone: the clock falls under the
GPU's power limit (docs/benchmark-log.md).
"""

import sys
from collections import defaultdict

import torch

from bench.moe_layer import CONFIGS, DenseSameFlops, build_layer, prepare_step
from bench.timing import median_step_ms


def clocks() -> str:
    """The SM clock and the power draw now (through pynvml, where torch finds it)."""
    try:
        return f"SM {torch.cuda.clock_rate()} MHz, {torch.cuda.power_draw() / 1000:.0f} W"
    except Exception as error:  # report without clocks rather than fail the timing
        return f"(no clocks: {type(error).__name__})"


def kernel_us_per_step(run, steps, alone):
    """{kernel name: µs of GPU time per step} over `steps` calls of `run`, each followed by a
    host synchronization when `alone`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(steps):
            run()
            if alone:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    totals = defaultdict(float)
    for event in profile.events():
        if event.device_type == cuda:
            totals[event.name[:90]] += event.time_range.elapsed_us() / steps
    return totals


def main() -> None:
    index = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    hidden, ffn, experts, top_k, tokens = CONFIGS[index]
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in ["dense same-FLOPs", "grouped+compile"]:
        if name == "dense same-FLOPs":
            module = DenseSameFlops(hidden, top_k * ffn).cuda().to(torch.bfloat16)
        else:
            module = build_layer(hidden, ffn, experts, top_k, name)
        run = prepare_step(module, x, grad, graphed=True)
        print(f"\n== {name}, config {CONFIGS[index]}, CUDA graph replays", flush=True)
        for label, steps in [
            ("one at a time", 1),
            ("10 back to back", 10),
            ("one at a time", 1),
            ("10 back to back", 10),
            ("40 back to back", 40),
        ]:
            ms = median_step_ms(run, steps=steps, rounds=7)
            print(f"{label}: {ms:.3f} ms per step; then {clocks()}", flush=True)
        print(
            f"one at a time, the host sleeping 5 ms before each: {median_step_ms(run, 1, 7, idle_s=0.005):.3f} ms"
        )
        alone = kernel_us_per_step(run, 10, alone=True)
        back_to_back = kernel_us_per_step(run, 10, alone=False)
        print(
            f"kernel time per step: {sum(alone.values()) / 1e3:.3f} ms one at a time, "
            f"{sum(back_to_back.values()) / 1e3:.3f} ms back to back; largest differences:"
        )
        names = sorted(
            set(alone) | set(back_to_back),
            key=lambda key: -abs(back_to_back.get(key, 0) - alone.get(key, 0)),
        )
        for key in names[:8]:
            print(f"  {alone.get(key, 0):8.1f} µs | {back_to_back.get(key, 0):8.1f} µs | {key}")
        del module, run


if __name__ == "__main__":
    main()
