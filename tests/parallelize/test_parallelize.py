"""megatron.parallelize.steps on one process: the model is plain PyTorch as built, whatever the
parallel config says, and building it on the meta device then drawing its weights gives the
weights of a model built with them. The parallel layouts themselves are compared with one
process in the multi-process tests beside this one and in tests/pipeline/, tests/moe/ and
tests/optimizer/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from megatron.model import DENSE_MLP, GPTModel
from megatron.model.attention import SelfAttention
from megatron.model.gpt_model import OutputHead
from megatron.model.transformer import TransformerLayer
from megatron.parallel.expert_parameters import is_expert_parameter
from megatron.parallel.parameter_swaps import materialize, replace_parameter
from megatron.parallelize.steps import (
    CompileChoice,
    compile_model,
    materialize_weights,
    shard_model,
)
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    PerRankRandom,
    RowParallelLinear,
    SequenceShard,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
    set_tensor_model_parallel_attributes,
)
from moe.config import MoEConfig
from moe.mlp_spec import MoEMlpSpec
from moe.tensor_parallel import TensorParallelRegion
from tests.tiny_gpt import tiny_model_config

MOE = MoEConfig(num_experts=4, top_k=2, shared_expert=True, router_bias_update_rate=0.01)
MODELS = {
    "dense": (tiny_model_config(), None),
    "untied_rope_swiglu": (
        tiny_model_config(
            untie_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            swiglu=True,
            normalization="RMSNorm",
        ),
        None,
    ),
    "dmoe_bias_shared": (tiny_model_config(), MOE),
}


def build(config, moe, device: str = "cpu") -> GPTModel:
    spec = MoEMlpSpec(moe) if moe is not None else DENSE_MLP
    with torch.device(device):
        return GPTModel(config, spec)


def test_the_model_is_plain_pytorch_whatever_the_parallel_config():
    """The config asks for TP=2 with sequence parallelism (and the spec plans for EP=2), and no
    process groups exist: the model still builds, from torch layers only, with nothing marked
    as a shard."""
    config = tiny_model_config(tensor_model_parallel_size=2, sequence_parallel=True)
    with torch.device("cpu"):
        model = GPTModel(config, MoEMlpSpec(MOE, expert_parallel_size=2))
    parallel_parts = (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        VocabParallelOutputHead,
        PerRankRandom,
        SequenceShard,
        TensorParallelRegion,
    )
    assert not any(isinstance(module, parallel_parts) for module in model.modules())
    marks = ("tensor_model_parallel", "sequence_parallel", "expert_model_parallel")
    for name, param in model.named_parameters():
        assert not any(hasattr(param, mark) for mark in marks), name
    attention = next(m for m in model.modules() if isinstance(m, SelfAttention))
    assert attention.num_heads == config.num_attention_heads
    assert type(model.output_head) is OutputHead


@pytest.mark.parametrize("name", MODELS)
def test_meta_build_then_weights_equals_a_build_with_weights(name):
    """pretrain_gpt.py's way (meta device, then shard_model) and a plain build draw the same
    weights and buffers from one seed, and leave the generator in the same state (so dropout
    masks after it agree too): the constructors' own default inits never reach the generator."""
    config, moe = MODELS[name]
    torch.manual_seed(7)
    built = build(config, moe)
    after_built = torch.get_rng_state()

    torch.manual_seed(7)
    meta = build(config, moe, "meta")
    assert all(param.is_meta for param in meta.parameters())
    sharded = shard_model(meta, config)
    assert torch.equal(torch.get_rng_state(), after_built)

    expected = built.state_dict()
    state = sharded.state_dict()
    assert state.keys() == expected.keys()
    for key, tensor in expected.items():
        assert tensor.device.type == "cpu"
        assert torch.equal(state[key], tensor), key
    if moe is not None:  # the buffers a meta build leaves empty start at zero
        assert any(key.endswith("expert_bias") for key in state)


def test_materialize_weights_leaves_a_model_with_weights_alone():
    torch.manual_seed(0)
    model = build(*MODELS["dense"])
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    generator_state = torch.get_rng_state()
    materialize_weights(model)
    assert torch.equal(torch.get_rng_state(), generator_state)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[key]), key


def test_swapped_parameters_keep_their_marks_and_sharing():
    with torch.device("meta"):
        first, second = nn.Linear(4, 3), nn.Linear(4, 3, bias=False)
    second.weight = first.weight  # shared between two modules
    set_tensor_model_parallel_attributes(first.weight, partition_dim=0)
    first.bias.requires_grad_(False)
    holder = nn.Sequential(first, second)
    assert materialize(holder, "cpu")
    assert not materialize(holder, "cpu")  # nothing left on meta
    assert first.weight is second.weight and first.weight.device.type == "cpu"
    assert first.weight.tensor_model_parallel and first.weight.partition_dim == 0
    assert not first.bias.requires_grad

    swapped = replace_parameter(first, "weight", torch.zeros(2, 4))
    assert first.weight is swapped and swapped.partition_dim == 0
    assert not is_expert_parameter(swapped)


def test_compile_says_what_it_compiles_or_why_not(capsys):
    model = build(*MODELS["dense"])
    assert compile_model(model, CompileChoice(veto="a reason to stay eager")) is model
    assert capsys.readouterr().out == "note: a reason to stay eager\n"
    compiled = compile_model(model, CompileChoice(), backend="eager")
    assert compiled is not model and capsys.readouterr().out == "> torch.compile: the whole model\n"
    compile_model(model, CompileChoice(), layer_by_layer=True, backend="eager")
    assert capsys.readouterr().out == "> torch.compile: each transformer layer's forward\n"


def test_layer_by_layer_compile_keeps_the_layers_forward_hooks_eager():
    """With --overlap-grad-reduce each layer's forward compiles on its own and the rest stays
    eager: the layer's forward pre-hooks (where the distributed optimizer's waits for its
    parameters run) are not traced, and the state dict keeps its names."""
    torch._dynamo.reset()
    model = build(*MODELS["dense"])
    names = list(model.state_dict())
    counter = torch._dynamo.testing.CompileCounter()
    assert compile_model(model, CompileChoice(), layer_by_layer=True, backend=counter) is model
    tracing = []
    for layer in model.modules():
        if isinstance(layer, TransformerLayer):
            layer.register_forward_pre_hook(
                lambda *_: tracing.append(torch.compiler.is_compiling())
            )
    tokens = torch.zeros(2, 8, dtype=torch.long)
    reference = build(*MODELS["dense"])
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(tokens, None), reference(tokens, None))
    assert tracing == [False] * model.config.num_layers
    assert counter.frame_count >= 1  # the layers' forward
    assert list(model.state_dict()) == names
    torch._dynamo.reset()


REPO_ROOT = Path(__file__).resolve().parents[2]
PLAIN_MODEL_SOURCES = sorted((REPO_ROOT / "megatron" / "model").glob("*.py")) + [
    REPO_ROOT / "moe" / name for name in ("layers.py", "experts.py", "router.py")
]


@pytest.mark.parametrize("path", PLAIN_MODEL_SOURCES, ids=lambda path: path.name)
def test_the_plain_model_holds_no_tensor_parallel_switch(path):
    """Tensor parallelism swaps parts (megatron.parallelize.tensor_parallelism); no module of the
    plain model keeps a tensor- or sequence-parallel flag for its forward to read, and the
    framework's model code takes nothing from megatron.tensor_parallel but the recompute's
    checkpoint (its weights initialise without knowing the parallel layer types)."""
    tree = ast.parse(path.read_text())
    switches = [
        f"{path.name}:{node.lineno}: self.{target.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and any(word in target.attr for word in ("tensor_parallel", "sequence_parallel", "fork"))
    ]
    assert not switches, switches
    if path.parent.name == "model":
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("megatron.tensor_")
            for alias in node.names
        }
        assert imported <= {"checkpoint"}, imported
