"""Ahead-of-time compilation of every Triton kernel for AMD and NVIDIA GPUs, on a machine with none.

Each kernel file lists what to build in a module-level list:

    from megatron.kernels.aot import AotSpec

    AOT_SPECS = [
        AotSpec(kernel=_my_kernel, signature={"x_ptr": "*bf16", "n": "i32"}, constexprs={"BLOCK": 128}),
    ]

`signature` names every runtime argument with a Triton type ("*bf16", "*fp32", "*i32", "i32", ...);
`constexprs` gives every `tl.constexpr` argument a value (they need not be repeated in `signature`).

What `compile_for` reaches with triton 3.6 on a CPU-only machine (checked by tests/kernels/test_aot_compile.py):
- MI300X (hip gfx942, wave 64) and MI250X (hip gfx90a, wave 64): ttir -> ttgir -> llir -> amdgcn
  assembly -> hsaco, the final code object. LLVM's AMDGPU backend and lld are linked into
  libtriton, so no ROCm install or external ld.lld is needed.
- H100 (cuda sm_90, warp 32): ttir -> ttgir -> llir -> ptx -> cubin, the final binary. The cubin is
  assembled by the ptxas that ships in the triton wheel (`triton.knobs.nvidia.ptxas`); no CUDA
  toolkit is needed.
Nothing is launched, so this proves the kernels build, not that they are correct on those GPUs;
correctness is what the interpreter tests and the GPU tests are for.

`python tools/compile_kernels.py` compiles every spec of every kernel package (this one and
moe.kernels) for every target and prints one line per pair (`--json` for a machine-readable
report; `--covering` builds only `covering_builds`, as the test suite does). Run it without
TRITON_INTERPRET set: under the interpreter `triton.jit` returns functions that cannot be
compiled.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import sys
from typing import Any, Callable, Sequence

from megatron.kernels.dispatch import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    from triton.backends.compiler import GPUTarget

# Empty without Triton: there is nothing to compile with (`main` says so).
TARGETS: dict[str, GPUTarget] = (
    {
        "mi300x": GPUTarget("hip", "gfx942", 64),
        "mi250x": GPUTarget("hip", "gfx90a", 64),
        "h100": GPUTarget("cuda", 90, 32),
    }
    if TRITON_AVAILABLE
    else {}
)

# The last stage each backend produces: the artifact a GPU would load.
FINAL_STAGE = {"hip": "hsaco", "cuda": "cubin"}
# The last textual stage, kept for reading what the compiler made.
ASSEMBLY_STAGE = {"hip": "amdgcn", "cuda": "ptx"}


@dataclasses.dataclass(frozen=True)
class AotSpec:
    """One kernel specialization to build ahead of time: argument types and constexpr values."""

    kernel: Callable[..., Any]
    signature: dict[str, str]
    constexprs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def kernel_name(self) -> str:
        """The kernel's module and function, such as `moe.kernels.sort._sort_scatter_kernel`."""
        function = getattr(self.kernel, "fn", self.kernel)
        return f"{function.__module__}.{function.__name__}"

    @property
    def name(self) -> str:
        """Readable, stable id: the kernel, its constexpr values and its argument types in
        order, such as `moe.kernels.sort._sort_scatter_kernel[BLOCK=128](*i32,*i32,i32)`."""
        values = ",".join(f"{key}={value}" for key, value in self.constexprs.items())
        function = getattr(self.kernel, "fn", self.kernel)
        order = list(inspect.signature(function).parameters)
        types = [self.signature[name] for name in order if name in self.signature]
        return f"{self.kernel_name}[{values}]({','.join(types)})"

    def features(self) -> set[tuple[str, str, str]]:
        """What a build of this specialization exercises: each constexpr value and each
        argument's type."""
        return {("constexpr", key, repr(value)) for key, value in self.constexprs.items()} | {
            ("argument", key, kind) for key, kind in self.signature.items()
        }


def discover_specs(packages: Sequence[str]) -> list[AotSpec]:
    """Imports every module of the named packages and collects their AOT_SPECS lists."""
    specs: dict[str, AotSpec] = {}
    for package_name in packages:
        package = importlib.import_module(package_name)
        modules = pkgutil.walk_packages(package.__path__, prefix=f"{package_name}.")
        for module_info in sorted(modules, key=lambda info: info.name):
            module = importlib.import_module(module_info.name)
            for spec in getattr(module, "AOT_SPECS", []):
                # A package may re-export its kernel module's list; count each spec once.
                specs.setdefault(spec.name, spec)
    return list(specs.values())


def compile_for(spec: AotSpec, target: GPUTarget) -> Any:
    """Compiles one spec for one target; returns triton's CompiledKernel (its `.asm` holds each stage)."""
    if not isinstance(spec.kernel, triton.runtime.JITFunction):
        raise TypeError(
            f"{spec.name}: kernel is a {type(spec.kernel).__name__}, not a triton JITFunction; "
            "TRITON_INTERPRET was set when the kernel module was imported. Compile in a process "
            "without TRITON_INTERPRET (python tools/compile_kernels.py)."
        )
    arg_names = spec.kernel.arg_names
    unknown = (set(spec.signature) | set(spec.constexprs)) - set(arg_names)
    missing = set(arg_names) - set(spec.signature) - set(spec.constexprs)
    if unknown or missing:
        raise ValueError(
            f"{spec.name}: AOT_SPECS entry does not match the kernel's arguments {arg_names}: "
            f"unknown {sorted(unknown)}, missing {sorted(missing)}"
        )
    return triton.compile(_ast_source(spec, arg_names), target=target)


def _ast_source(spec: AotSpec, arg_names: list[str]) -> Any:
    """The kernel's source for triton.compile, in the form the installed Triton takes."""
    ast_source = triton.compiler.ASTSource
    if "constexprs" in inspect.signature(ast_source.__init__).parameters:
        # Newer Triton (3.6 here): every argument in the signature, constexprs typed "constexpr".
        signature = {name: spec.signature.get(name, "constexpr") for name in arg_names}
        return ast_source(fn=spec.kernel, signature=signature, constexprs=dict(spec.constexprs))
    # Older Triton (3.0, as torch 2.4 brings): runtime arguments only, constexprs as `constants`.
    signature = {
        name: spec.signature[name]
        for name in arg_names
        if name in spec.signature and name not in spec.constexprs
    }
    return ast_source(fn=spec.kernel, signature=signature, constants=dict(spec.constexprs))


def artifacts(compiled: Any, target: GPUTarget) -> dict[str, int]:
    """Sizes in bytes of the assembly and the final binary of a compiled kernel."""
    return {
        stage: len(compiled.asm.get(stage) or b"")
        for stage in (ASSEMBLY_STAGE[target.backend], FINAL_STAGE[target.backend])
    }


def covering_builds(specs: Sequence[AotSpec], targets: Sequence[str]) -> list[tuple[AotSpec, str]]:
    """Fewer (specialization, target) builds that still build, for every target, each
    constexpr value and each argument type of every kernel, and every specialization for at
    least one target: what a failure to build for a target depends on (an argument type's
    loads and conversions, a constexpr's branch) is built for that target.

    Per kernel and target, specializations are chosen greedily until those features are
    covered, each target starting its choice at another specialization so that together they
    build more of them; a specialization no target chose is then built for the target that has
    the fewest of that kernel's builds."""
    by_kernel: dict[str, list[AotSpec]] = {}
    for spec in specs:
        by_kernel.setdefault(spec.kernel_name, []).append(spec)
    builds = []
    for kernel_specs in by_kernel.values():
        needed_everywhere = set().union(*(spec.features() for spec in kernel_specs))
        chosen: dict[str, list[int]] = {target: [] for target in targets}
        for offset, target in enumerate(targets):
            order = [(offset + step) % len(kernel_specs) for step in range(len(kernel_specs))]
            needed = set(needed_everywhere)
            while needed:
                best = max(order, key=lambda index: len(kernel_specs[index].features() & needed))
                chosen[target].append(best)
                needed -= kernel_specs[best].features()
        for index in range(len(kernel_specs)):
            if not any(index in indices for indices in chosen.values()):
                min(chosen.values(), key=len).append(index)
        builds += [(kernel_specs[index], target) for target in targets for index in chosen[target]]
    return builds


def compile_all(packages: Sequence[str], covering: bool = False) -> dict[str, dict[str, Any]]:
    """{spec name: {target name: artifact sizes, or the error as a string}} for every pair, or
    for the `covering_builds` only."""
    specs = discover_specs(packages)
    if covering:
        builds = covering_builds(specs, list(TARGETS))
    else:
        builds = [(spec, target) for spec in specs for target in TARGETS]
    report: dict[str, dict[str, Any]] = {}
    for spec, target_name in builds:
        target = TARGETS[target_name]
        try:
            result = artifacts(compile_for(spec, target), target)
        except Exception as error:  # the report says which pair failed and why
            result = f"{type(error).__name__}: {error}"
        report.setdefault(spec.name, {})[target_name] = result
    return report


def main(argv: list[str], packages: Sequence[str]) -> int:
    """The command line of tools/compile_kernels.py: `--list`, `--json`, or a line per pair;
    `--covering` for the `covering_builds` only."""
    if not TRITON_AVAILABLE:
        print("triton is not installed: pip install triton, then run this again", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    covering = "--covering" in argv
    if "--list" in argv:
        specs = discover_specs(packages)
        if covering:
            builds = covering_builds(specs, list(TARGETS))
            print(json.dumps([[spec.name, target] for spec, target in builds]))
        else:
            print(json.dumps([spec.name for spec in specs]))
        return 0
    report = compile_all(packages, covering)
    failed = any(isinstance(result, str) for row in report.values() for result in row.values())
    if "--json" in argv:
        print(json.dumps(report))
    else:
        for name, row in report.items():
            for target_name, result in row.items():
                print(f"{name:70s} {target_name:7s} {result}")
    return 1 if failed else 0
