"""The QuACK grouped product (moe.kernels.quack_grouped_gemm) without a GPU or QuACK: its custom
ops run the CPU stand-in of tests/quack_stand_in.py, which computes what QuACK's varlen gemm
documents and asserts the layouts its kernels assert. The product and both gradients against
grouped_mm_reference, an expert without rows given a zero weight gradient whatever the kernel
leaves there, one graph under torch.compile, and --moe-grouped-gemm-kernel's one-line refusals.
"""

import pickle
import sys

import pytest
import torch

from gpt_pretraining import GPT_RUN
from megatron.config import Config, ConfigError, ModelConfig, parse_arguments
from megatron.config.validation import resolve_arguments_with_notes
from moe.arguments import add_moe_args
from moe.config import MoEConfig, moe_config
from moe.kernels import quack_grouped_gemm
from moe.kernels.grouped_gemm import MOE, grouped_mm_reference, grouped_product
from moe.kernels.quack_grouped_gemm import QUACK, quack_missing
from moe.layers import build_moe_layer
from moe.training_hooks import MoETrainingHooks
from tests.config.command_lines import argv
from tests.moe.test_dmoe_compile import assert_gpt_model_is_one_graph

# Experts 1 and 3 get no rows; 16 columns keep every row a multiple of 16 bytes in bf16.
TOKENS_PER_EXPERT = torch.tensor([5, 0, 7, 0, 4])
IN_FEATURES, OUT_FEATURES = 16, 24


def _operands(rows_past_groups: int = 0):
    generator = torch.Generator().manual_seed(0)
    rows = int(TOKENS_PER_EXPERT.sum()) + rows_past_groups
    x = torch.randn(rows, IN_FEATURES, generator=generator)
    weight = torch.randn(len(TOKENS_PER_EXPERT), IN_FEATURES, OUT_FEATURES, generator=generator)
    grad_out = torch.randn(rows, OUT_FEATURES, generator=generator)
    return x, weight, grad_out


def _product_and_grads(multiply, x, weight, grad_out):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = multiply(x, weight)
    out.backward(grad_out)
    return out.detach(), x.grad, weight.grad


def _quack(x, weight):
    offsets = torch.cumsum(TOKENS_PER_EXPERT, 0, dtype=torch.int32)
    return grouped_product(x, weight, TOKENS_PER_EXPERT, offsets, QUACK)


def _reference(x, weight):
    return grouped_mm_reference(x, weight, TOKENS_PER_EXPERT)


def test_the_product_and_its_gradients_are_the_references(stand_in_quack):
    x, weight, grad_out = _operands()
    got = _product_and_grads(_quack, x, weight, grad_out)
    want = _product_and_grads(_reference, x, weight, grad_out)
    for name, value, expected in zip(("product", "input grad", "weight grad"), got, want):
        torch.testing.assert_close(value, expected, msg=name)
    for expert in (1, 3):  # no rows: exactly zero
        assert torch.count_nonzero(got[2][expert]) == 0


def test_rows_past_the_groups_are_in_no_product(stand_in_quack):
    """Expert-parallel padding (moe.exchange.fixed_blocks): the groups' rows and the weight
    gradient are the references', whatever the padded rows hold."""
    x, weight, grad_out = _operands(rows_past_groups=3)
    grouped = int(TOKENS_PER_EXPERT.sum())
    got = _product_and_grads(_quack, x, weight, grad_out)
    want = _product_and_grads(_reference, x, weight, grad_out)
    torch.testing.assert_close(got[0][:grouped], want[0][:grouped])
    torch.testing.assert_close(got[1][:grouped], want[1][:grouped])
    torch.testing.assert_close(got[2], want[2])


def test_without_rows_the_product_is_empty_and_the_weight_gradient_zero(stand_in_quack):
    x = torch.zeros(0, IN_FEATURES)
    weight = torch.randn(3, IN_FEATURES, OUT_FEATURES)
    tokens_per_expert = torch.zeros(3, dtype=torch.int64)
    offsets = torch.zeros(3, dtype=torch.int32)
    weight.requires_grad_()
    out = grouped_product(x, weight, tokens_per_expert, offsets, QUACK)
    assert out.shape == (0, OUT_FEATURES)
    out.sum().backward()
    assert weight.grad.shape == weight.shape and torch.count_nonzero(weight.grad) == 0


def test_bf16_rows_keep_their_dtype_and_the_fp32_weight_gets_its_gradient(stand_in_quack):
    x, weight, grad_out = _operands()
    x = x.to(torch.bfloat16).requires_grad_()
    weight.requires_grad_()
    out = _quack(x, weight)  # grouped_product casts the weight to the rows' dtype
    assert out.dtype == torch.bfloat16
    out.backward(grad_out.to(torch.bfloat16))
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_the_compiled_product_and_backward_are_one_graph(stand_in_quack):
    """The custom ops' fake implementations let dynamo trace the product and the offsets'
    padding, and AOTAutograd the backward through the gradient ops, without a break
    (fullgraph=True raises on one); the results are eager's."""
    torch._dynamo.reset()
    x, weight, grad_out = _operands()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(_quack, backend="aot_eager", fullgraph=True)
    got = _product_and_grads(compiled, x, weight, grad_out)
    for value, expected in zip(got, _product_and_grads(_quack, x, weight, grad_out)):
        torch.testing.assert_close(value, expected)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1


def test_a_gpt_model_on_quack_traces_as_one_graph_and_compiles_whole(stand_in_quack):
    """What training compiles: the whole GPT with dMoE layers on QUACK, no break anywhere, and
    the MoE hooks do not veto compiling it."""
    moe = MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", grouped_gemm=QUACK)
    assert_gpt_model_is_one_graph(moe)
    hooks = MoETrainingHooks(moe, torch.bfloat16, num_layers=2, writes_metrics=False)
    assert hooks.compile_choice(torch.device("cuda")).veto is None


def test_the_compiled_dmoe_layer_on_quack_is_the_eager_layer_on_the_references(stand_in_quack):
    torch._dynamo.reset()
    model = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
        seq_length=16, max_position_embeddings=16, add_bias_linear=False, init_method_std=0.2,
    )  # fmt: skip
    results = []
    for backend in (MOE, QUACK):
        torch.manual_seed(0)
        moe = MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", grouped_gemm=backend)
        layer = build_moe_layer(model, moe)
        run = (
            torch.compile(layer, backend="aot_eager", fullgraph=True) if backend is QUACK else layer
        )
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = run(x)
        out.square().sum().backward()
        experts = layer.experts
        results.append([out, x.grad, experts.w1.grad, experts.w2.grad, layer.tokens_per_expert])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)


def test_quack_is_missing_where_it_does_not_import(monkeypatch, stand_in_quack):
    assert quack_missing() is None
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    missing = quack_missing()
    assert missing.startswith(("ImportError", "ModuleNotFoundError")) and "\n" not in missing


# --------------------------------------------------------------------------------------------
# --moe-grouped-gemm-kernel: chosen once, at start-up (moe.config.with_grouped_gemm_for)
# --------------------------------------------------------------------------------------------

QUACK_FLAGS = ("--moe-num-experts", "4", "--moe-grouped-gemm-kernel", "quack")


def _run_config(*flags: str) -> Config:
    """pretrain_gpt.py's config of a small dMoE with `flags`, on this process's device."""
    namespace = parse_arguments(argv(*flags), [add_moe_args])
    resolved, notes = resolve_arguments_with_notes(namespace, 1)
    return Config.from_resolved(resolved, notes, 64, extensions=[moe_config])


def _refusal(*flags: str) -> str:
    with pytest.raises(ConfigError) as refused:
        _run_config(*flags)
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.fixture
def on_hopper(monkeypatch):
    """The device check passes, as on an H100 (the tests run on the CPU)."""
    monkeypatch.setattr(quack_grouped_gemm, "quack_runs_on", lambda device: True)


def test_quack_where_it_runs_is_the_runs_grouped_gemm(stand_in_quack, on_hopper):
    moe = _run_config(*QUACK_FLAGS, "--bf16").extension(MoEConfig)
    assert moe.grouped_gemm is QUACK and moe.grouped_gemm_kernel == "quack"
    assert "dMoE grouped GEMM: quack (quack-kernels)" in moe.notes()
    assert pickle.loads(pickle.dumps(moe)) == moe  # as the spawned ranks of a GPU run get it


def test_auto_keeps_choose_backends_choice(stand_in_quack, on_hopper):
    moe = _run_config("--moe-num-experts", "4", "--bf16").extension(MoEConfig)
    assert moe.grouped_gemm_kernel == "auto" and moe.grouped_gemm is MOE  # the CPU's choice


def test_quack_refuses_where_it_does_not_import(monkeypatch, on_hopper):
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    message = _refusal(*QUACK_FLAGS, "--bf16")
    assert message.startswith(
        "--moe-grouped-gemm-kernel quack needs the quack-kernels package, and "
        "quack.gemm_interface does not import here (ModuleNotFoundError: "
    )
    assert message.endswith(
        "pip install quack-kernels (the project's [quack] extra) or drop the flag"
    )


def test_quack_refuses_the_cpu(stand_in_quack):
    assert _refusal(*QUACK_FLAGS, "--bf16") == (
        "--moe-grouped-gemm-kernel quack runs on NVIDIA Hopper or Blackwell GPUs (sm90 or "
        "newer), and this process computes on cpu; drop the flag (auto chooses for the device)"
    )


def test_quack_refuses_fp32_rows(stand_in_quack, on_hopper):
    assert _refusal(*QUACK_FLAGS) == (
        "--moe-grouped-gemm-kernel quack multiplies bf16 rows, and this run's experts compute in "
        "float32; add --bf16 or drop the flag"
    )


def test_quack_refuses_widths_its_tma_loads_cannot_take(stand_in_quack, on_hopper):
    assert _refusal(*QUACK_FLAGS, "--bf16", "--moe-ffn-hidden-size", "100") == (
        "--moe-grouped-gemm-kernel quack needs expert widths that are multiples of 8 (16 bytes "
        "of bf16, for its TMA loads), got --hidden-size 64 and 100 expert channels per "
        "tensor-parallel rank; choose multiples of 8 or drop the flag"
    )


@pytest.mark.parametrize(
    "mode, forced", [("reference", "the PyTorch references"), ("triton", "our Triton kernels")]
)
def test_quack_refuses_a_kernel_mode_that_forces_other_kernels(
    monkeypatch, stand_in_quack, on_hopper, mode, forced
):
    """The explicit flag and MEGATRON_KERNELS contradict each other: neither silently wins."""
    monkeypatch.setenv("MEGATRON_KERNELS", mode)
    assert _refusal(*QUACK_FLAGS, "--bf16") == (
        "--moe-grouped-gemm-kernel quack runs the dMoE's products on QuACK's kernels, but "
        f"MEGATRON_KERNELS={mode} forces {forced} everywhere; unset MEGATRON_KERNELS or drop the "
        "flag"
    )


@pytest.mark.parametrize("flag", [["--no-moe-dropless"], ["--moe-impl", "sparse"]])
def test_quack_refuses_moe_layers_without_the_grouped_gemm(stand_in_quack, on_hopper, flag):
    assert "which --no-moe-dropless and --moe-impl sparse or reference do not run" in _refusal(
        *QUACK_FLAGS, "--bf16", *flag
    )


def test_a_checkpoint_of_a_quack_run_reads_anywhere(stand_in_quack, monkeypatch):
    """The saved config chooses the grouped GEMM for the device that reads it (here the CPU)
    rather than refusing the run's QuACK (moe.arguments.MOE_KERNEL_ARGUMENTS)."""
    monkeypatch.setattr(quack_grouped_gemm, "quack_runs_on", lambda device: True)
    config = GPT_RUN.config(*GPT_RUN.resolve(argv(*QUACK_FLAGS, "--bf16"), 1), 64)
    assert config.extension(MoEConfig).grouped_gemm is QUACK
    monkeypatch.undo()
    again = GPT_RUN.config_from_saved(config.saved_arguments()).extension(MoEConfig)
    assert again.grouped_gemm_kernel == "auto" and again.grouped_gemm is MOE
