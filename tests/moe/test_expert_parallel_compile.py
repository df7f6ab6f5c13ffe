"""The expert-parallel dMoE layer in fixed-size blocks compiled (torch._grouped_mm, gloo):
as one graph equal to eager, also after its blocks grew, and under
--moe-expert-parallel-chunked-overlap with Inductor's schedule keeping the chunks' all-to-alls
under the other chunks' products. The layers are tests/moe/test_expert_parallel.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.parallel import parallel_state
from megatron.parallelize.steps import CompileChoice, compile_model
from moe.config import MoEConfig
from moe.kernels.grouped_gemm import TORCH, GroupedGemmBackend
from tests.launch import run_distributed
from tests.markers import needs_torch_grouped_mm
from tests.moe.test_expert_parallel import EXPERTS, make_layer, make_tokens, probe

pytestmark = pytest.mark.usefixtures("reference_kernels")


def _compiled_blocks_step(
    rank: int, world_size: int, grouped_gemm: GroupedGemmBackend, chunks: int
) -> list:
    """The fixed-size-block layer eagerly and compiled as one graph (fullgraph: no break, so no
    host sync), forward and backward, at a first block size and at a grown one (as after an
    overflow, which recompiles): the differences."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        overrides = {
            "expert_parallel_buffer_factor": 4.0,
            "grouped_gemm": grouped_gemm,
            "expert_parallel_chunks": chunks,
        }
        runs = {}
        for compiled in (False, True):
            layer = make_layer("grouped", 2, world_size, None, **overrides)
            run = compile_model(layer, CompileChoice(), backend="aot_eager", fullgraph=True)
            run = run if compiled else layer
            runs[compiled] = []
            for factor in (4.0, 4.4):
                layer.expert_parallel_buffer_factor = factor
                layer.zero_grad()
                tokens = make_tokens(world_size, None)[rank : rank + 1].clone()
                tokens.requires_grad_(True)
                # bf16, where torch._grouped_mm (the backend that compiles) has its kernels.
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    output = run(tokens).float()
                (output * probe(world_size)[rank : rank + 1]).sum().backward()
                grads = [p.grad.clone() for p in layer.parameters()]
                runs[compiled] += [output.detach(), tokens.grad, *grads]
            runs[compiled].append(layer.window_expert_parallel_imbalance.clone())
        *eager, load = runs[False]
        *compiled_runs, compiled_load = runs[True]
        errors = [(a - b).abs().max().item() for a, b in zip(eager, compiled_runs)]
        return errors, load.tolist(), compiled_load.tolist()
    finally:
        parallel_state.destroy_model_parallel()


@needs_torch_grouped_mm
@pytest.mark.parametrize("chunks", [1, 2])
def test_fixed_size_blocks_compile_as_one_graph(chunks):
    """With torch._grouped_mm (the grouped GEMM a run on Hopper compiles), the expert-parallel
    layer in fixed-size blocks traces whole, in one exchange or in chunks: no graph break, no
    host sync; the same numbers, also after its blocks grew (a recompile with the new size as a
    constant: megatron.parallelize.steps.compile_model)."""
    for errors, load, compiled_load in run_distributed(_compiled_blocks_step, 2, TORCH, chunks):
        assert max(errors) < 1e-2, errors  # bf16; eager and compiled round alike or nearly
        assert load[1] == compiled_load[1] == 2.0 and load == pytest.approx(compiled_load)


def _inductor_schedule(rank: int, world_size: int, flags: tuple) -> tuple:
    """The order in which the Inductor-compiled layer (torch._grouped_mm) of a run with `flags`
    at EP `world_size` issues its all-to-alls, waits for them and runs its grouped GEMMs: the
    forward's generated code, then the backward's, each as a list of events; and whether the
    process's own Inductor config was left alone. The layer's chunks and how it is compiled
    come from the flags, as pretrain_gpt.py has them: the run's config, its MoE training hooks'
    compile choice, and the compile step (megatron.parallelize.steps.compile_model)."""
    import re

    import torch._inductor.config as inductor
    from torch._inductor.utils import run_and_get_code

    from gpt_pretraining import GPT_RUN
    from tests.config.command_lines import argv

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        args, notes = GPT_RUN.resolve(argv("--moe-num-experts", str(EXPERTS), *flags), world_size)
        config = GPT_RUN.config(args, notes, 64)
        # The grouped GEMM a Hopper GPU's run chooses, with which the layer compiles whole.
        moe = dataclasses.replace(config.extension(MoEConfig), grouped_gemm=TORCH)
        config = dataclasses.replace(config, extensions=(moe,))
        choice = GPT_RUN.training_hooks(config).compile_choice(torch.device("cpu"))
        overrides = {"expert_parallel_buffer_factor": 4.0, "grouped_gemm": TORCH}
        layer = make_layer(
            "grouped", 2, world_size, None, expert_parallel_chunks=moe.expert_parallel_chunks,
            **overrides,
        )  # fmt: skip
        compiled = compile_model(layer, choice, fullgraph=True)
        tokens = make_tokens(world_size, None)[rank : rank + 1].clone().requires_grad_(True)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = compiled(tokens).float()
            (output * probe(world_size)[rank : rank + 1]).sum().backward()

        _, codes = run_and_get_code(step)
        issue = re.compile(r"\s*(\w+) = torch\.ops\._c10d_functional\.all_to_all_single")
        wait = re.compile(r"\s*torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
        schedules = []
        for code in codes:
            events = []
            for line in code.splitlines():
                if issue.match(line):
                    events.append(("issue", issue.match(line).group(1)))
                elif wait.match(line):
                    events.append(("wait", wait.match(line).group(1)))
                elif "extern_kernels._grouped_mm(" in line:
                    events.append(("grouped_mm", ""))
            schedules.append(events)
        untouched = not inductor.reorder_for_compute_comm_overlap
        return schedules, untouched
    finally:
        parallel_state.destroy_model_parallel()


def _hidden_by_products(events: list) -> int:
    """The all-to-alls with a grouped GEMM between their issue and their wait."""
    hidden = 0
    for position, (kind, name) in enumerate(events):
        if kind == "wait" and ("issue", name) in events[:position]:
            issued = events.index(("issue", name))
            hidden += any(kind == "grouped_mm" for kind, _ in events[issued:position])
    return hidden


@needs_torch_grouped_mm
def test_inductor_keeps_the_chunks_exchanges_under_the_products():
    """Compiled by Inductor (which, left alone, emits each all-to-all right before its wait: the
    chunks one after the other), the layer of a run with --moe-expert-parallel-chunked-overlap
    issues chunk 1's dispatch (rows and weights) before chunk 0's products and waits after
    them, and chunk 0's combine under chunk 1's; in the backward the reverse exchanges run under
    the input- and weight-gradient products. The passes that do it come from the flag through
    the run's hooks to the compile step, for this model's graphs only, not for the process."""
    flags = ("--expert-model-parallel-size", "2", "--moe-expert-parallel-buffer-factor", "4")
    (forward, backward), untouched = run_distributed(
        _inductor_schedule, 2, (*flags, "--moe-expert-parallel-chunked-overlap"), timeout_s=600
    )[0]
    assert sum(kind == "issue" for kind, _ in forward) == 6, forward
    assert _hidden_by_products(forward) >= 3, forward
    assert _hidden_by_products(backward) >= 3, backward
    assert untouched
