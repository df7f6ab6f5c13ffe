"""megatron.kernels.aot's choice of builds for the test suite (`covering_builds`), on made-up
specializations: every kernel's argument types and constexpr values on every target, every
specialization on at least one, fewer builds than every pair. (tests/kernels/test_aot_compile.py
builds the real kernels' choice.)"""

from __future__ import annotations

import itertools

from megatron.kernels.aot import AotSpec, covering_builds

TARGETS = ["mi300x", "mi250x", "h100"]


def _scale_kernel(x_ptr, y_ptr, n, HAS_BIAS, BLOCK):
    pass


def _copy_kernel(x_ptr, n):
    pass


SPECS = [
    AotSpec(_scale_kernel, {"x_ptr": x, "y_ptr": y, "n": "i32"}, {"HAS_BIAS": bias, "BLOCK": 64})
    for x, y, bias in itertools.product(
        ["*bf16", "*fp16", "*fp32"], ["*fp32", "*bf16"], [True, False]
    )
] + [AotSpec(_copy_kernel, {"x_ptr": "*fp32", "n": "i32"})]


def test_every_feature_on_every_target_and_every_specialization_somewhere():
    builds = covering_builds(SPECS, TARGETS)
    assert len(builds) < len(SPECS) * len(TARGETS)
    assert {spec.name for spec, _ in builds} == {spec.name for spec in SPECS}
    for kernel in {spec.kernel_name for spec in SPECS}:
        specs = [spec for spec in SPECS if spec.kernel_name == kernel]
        wanted = set().union(*(spec.features() for spec in specs))
        for target in TARGETS:
            built = [
                spec for spec, where in builds if where == target and spec.kernel_name == kernel
            ]
            assert built and set().union(*(spec.features() for spec in built)) == wanted
    assert len({(spec.name, target) for spec, target in builds}) == len(builds)


def test_names_tell_apart_specializations_that_differ_in_one_argument():
    first = AotSpec(
        _scale_kernel, {"x_ptr": "*bf16", "y_ptr": "*fp32", "n": "i32"}, {"HAS_BIAS": 1, "BLOCK": 8}
    )
    second = AotSpec(
        _scale_kernel, {"y_ptr": "*bf16", "x_ptr": "*fp32", "n": "i32"}, {"HAS_BIAS": 1, "BLOCK": 8}
    )
    assert (
        first.name
        == "tests.kernels.test_aot_builds._scale_kernel[HAS_BIAS=1,BLOCK=8](*bf16,*fp32,i32)"
    )
    assert second.name != first.name
