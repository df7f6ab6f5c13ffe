"""gpt_pretraining/huggingface/remote_code: a tiny dMoE GPT of this project, written as a Hugging Face
directory (config.json with auto_map, the two remote-code files, model.safetensors under the
project's own keys without the padded vocabulary rows), loads with
`AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` and computes what the
project's model computes: logits, loss, the routing of every router rule (bit for bit, ties
included), greedy generation with and without the KV cache, left padding; and the config mapping
refuses what the modeling file does not implement.

CPU, fp32. transformers' module cache lives in a directory of this module's (`auto_model`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gpt_pretraining.huggingface.hf_files import is_training_counter  # noqa: E402
from gpt_pretraining.huggingface.remote_code.writer import (  # noqa: E402
    AUTO_MAP,
    REMOTE_CODE_DIR,
    REMOTE_CODE_FILES,
    megatron_dmoe_config_from,
    remote_code_config,
    write_remote_code,
)
from megatron.model import GPTModel  # noqa: E402
from moe.config import MoEConfig  # noqa: E402
from moe.mlp_spec import MoEMlpSpec  # noqa: E402
from moe.router import Router  # noqa: E402
from tests.tiny_gpt import tiny_model_config  # noqa: E402

VOCAB = 50  # the tokenizer's; the model pads it to tiny_model_config's 64
EOS = VOCAB - 1
MAX_POSITIONS = 32
NEW_TOKENS = 16

# name -> (ModelConfig overrides, MoEConfig overrides)
VARIANTS: Dict[str, tuple] = {
    "gelu_top1": ({}, {}),
    "glu": ({}, {"mlp_type": "glu"}),
    "top2_normalized": ({}, {"top_k": 2, "normalize_expert_weights": 1.0}),
    "layer_freq2": ({"num_layers": 4}, {"layer_freq": 2}),
    "swiglu_dense_glu_experts": ({"num_layers": 3, "swiglu": True}, {"mlp_type": "glu", "layer_freq": 2}),
    "fine_grained_after_a_dense_layer": (
        {"num_layers": 3}, {"layer_freq": (False, True, True), "ffn_hidden_size": 16, "top_k": 2},
    ),
    "silu_experts_ungated": ({"swiglu": True}, {}),
    "untied_no_bias_gqa": (
        {"untie_embeddings_and_output_weights": True, "add_bias_linear": False, "num_query_groups": 2},
        {"top_k": 2, "normalize_expert_weights": 2.0},
    ),
    "sigmoid_top2": ({}, {"router_score": "sigmoid", "top_k": 2}),
    "softmax_of_the_chosen_logits_top2": ({}, {"top_k": 2, "router_pre_softmax": False}),
    # Scaled after the p-norm division: scaled before it, the factor would cancel.
    "scaled_after_normalizing": (
        {}, {"top_k": 2, "normalize_expert_weights": 1.0, "router_topk_scaling_factor": 2.5},
    ),
    "sigmoid_top2_expert_bias": (
        {}, {"router_score": "sigmoid", "top_k": 2, "router_bias_update_rate": 0.01},
    ),
    "softmax_top1_expert_bias": ({}, {"router_bias_update_rate": 0.01}),
    "router_fp64": ({}, {"top_k": 2, "router_dtype": "fp64"}),
}  # fmt: skip
# Every router's expert bias in the variants that have one: distinct values, as large as the
# scores' differences, so that they change which experts some tokens get.
EXPERT_BIAS = torch.tensor([0.3, -0.2, 0.1, -0.3])


def build_project_model(model_overrides: Dict[str, Any], moe_overrides: Dict[str, Any], seed=0):
    """The project's dMoE GPT (4 experts), eval mode, every parameter perturbed so that biases,
    norms and the router are far from their init (routing then decisive), any expert bias
    EXPERT_BIAS."""
    model_config = tiny_model_config(
        seq_length=MAX_POSITIONS, max_position_embeddings=MAX_POSITIONS, **model_overrides
    )
    moe_config = MoEConfig(**{"num_experts": 4, "top_k": 1, **moe_overrides})
    torch.manual_seed(seed)
    model = GPTModel(model_config, MoEMlpSpec(moe_config)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
        for router in project_routers(model):
            if router.expert_bias is not None:
                router.expert_bias.copy_(EXPERT_BIAS)
    return model, model_config, moe_config


def project_routers(model: GPTModel) -> List[Router]:
    """The project model's routers, in layer order."""
    return [module for module in model.modules() if isinstance(module, Router)]


def hf_routers(model) -> list:
    """The exported model's routers (the remote code's Router class), in layer order."""
    return [module for module in model.modules() if type(module).__name__ == "Router"]


def project_routings(project: GPTModel, tokens: torch.Tensor) -> List[Tuple[Router, Any, Any]]:
    """(router, its input x [T, h], its Routing) of each MoE layer in the project's forward."""
    captured = []

    def keep(router, inputs, routing):
        captured.append((router, inputs[0], routing))

    hooks = [router.register_forward_hook(keep) for router in project_routers(project)]
    try:
        with torch.no_grad():
            project(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def export(
    model: GPTModel, model_config, moe_config, directory: Path, eos: Optional[int] = EOS
) -> Path:
    """What the exporter writes: config.json (auto_map), the remote code, and the state dict
    under the project's keys without the padded vocabulary rows and the training counters, a
    tied table stored once."""
    fields = megatron_dmoe_config_from(model_config, moe_config, VOCAB, eos_token_id=eos)
    remote_code_config(**fields).save_pretrained(str(directory))
    write_remote_code(str(directory))
    state = {}
    for key, tensor in model.state_dict().items():
        if is_training_counter(key):
            continue
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensor = tensor[:VOCAB]
        state[key] = tensor.detach().clone().contiguous()
    safetensors_torch.save_file(state, str(directory / "model.safetensors"), {"format": "pt"})
    return directory


def load(auto_model, directory: Path):
    """The exported model through transformers, checking that every tensor was used."""
    model, info = auto_model.from_pretrained(
        str(directory), trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def exported_pair(auto_model, tmp_path: Path, variant: str, eos: Optional[int] = EOS):
    """(project model, Hugging Face model) of `variant`, in a directory named after it."""
    model_overrides, moe_overrides = VARIANTS[variant]
    project, model_config, moe_config = build_project_model(model_overrides, moe_overrides)
    directory = export(project, model_config, moe_config, tmp_path / f"dmoe_{variant}", eos)
    return project, load(auto_model, directory)


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    """max |actual - expected| <= tolerance * max |expected|."""
    error = (actual - expected).abs().max().item()
    assert error <= tolerance * expected.abs().max().item(), (error, expected.abs().max().item())


def project_greedy(project: GPTModel, prompt: List[int], steps: int) -> List[int]:
    """Greedy decoding by re-running the whole sequence through the project's model, over the
    real vocabulary."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = project(torch.tensor([tokens]))[0, -1, :VOCAB]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def hf_greedy(model, input_ids: torch.Tensor, attention_mask=None, **kwargs):
    """model.generate's NEW_TOKENS new tokens [b, NEW_TOKENS] and the logits it chose each from
    [b, NEW_TOKENS, vocab], greedy (the models of the generation tests have no EOS to stop at:
    random weights emit any token often)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    assert output.sequences.shape[1] == input_ids.shape[1] + NEW_TOKENS
    return output.sequences[:, input_ids.shape[1] :], torch.stack(output.logits, dim=1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_loss_match_the_project_model(auto_model, tmp_path, variant):
    project, model = exported_pair(auto_model, tmp_path, variant)
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = project(tokens)[..., :VOCAB]
        output = model(tokens, labels=tokens)
    assert_relative(output.logits, expected, 1e-5)
    expected_loss = F.cross_entropy(expected[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert abs(output.loss.item() - expected_loss.item()) <= 1e-6 * expected_loss.item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_routing_is_the_project_routers_bit_for_bit(auto_model, tmp_path, variant):
    """Each MoE layer's exported router, on the tokens the project's router saw, chooses the
    same experts in the same order and gives them the same weights, to the bit (the experts
    scale by them in fp32)."""
    project, model = exported_pair(auto_model, tmp_path, variant)
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(8))
    routings = project_routings(project, tokens)
    assert len(routings) == len(hf_routers(model)) > 0
    for (_, x, routing), hf_router in zip(routings, hf_routers(model)):
        with torch.no_grad():
            weights, experts = hf_router(x)
        assert torch.equal(experts, routing.expert_indices)
        assert weights.dtype == torch.float32
        assert torch.equal(weights, routing.expert_weights.float())


def test_the_expert_bias_chooses_experts_and_does_not_weight_them(auto_model, tmp_path):
    """The bias changes which experts the project's router chooses for some tokens; the export
    chooses those experts and weights them by their sigmoid scores without the bias."""
    project, model = exported_pair(auto_model, tmp_path, "sigmoid_top2_expert_bias")
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(9))
    changed = 0
    for (router, x, routing), hf_router in zip(
        project_routings(project, tokens), hf_routers(model)
    ):
        assert torch.equal(hf_router.expert_bias, EXPERT_BIAS)
        with torch.no_grad():
            logits = router.logits(x)
            router.expert_bias.zero_()
            unbiased = router.route(logits).expert_indices
            router.expert_bias.copy_(EXPERT_BIAS)
            weights, experts = hf_router(x)
        changed += int((unbiased != routing.expert_indices).any(dim=-1).sum())
        assert torch.equal(experts, routing.expert_indices)
        assert torch.equal(weights, logits.sigmoid().gather(1, experts))
    assert changed > 0


def test_the_expert_bias_stays_fp32_in_a_bf16_model(auto_model, tmp_path):
    """As the project's buffer, which its bf16 runs add unrounded to fp32 softmax scores."""
    project, model_config, moe_config = build_project_model(*VARIANTS["softmax_top1_expert_bias"])
    directory = export(project, model_config, moe_config, tmp_path / "dmoe_bf16")
    model = auto_model.from_pretrained(str(directory), trust_remote_code=True, dtype=torch.bfloat16)
    router = hf_routers(model)[0]
    assert router.layer.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32
    assert torch.equal(router.expert_bias, EXPERT_BIAS)


# Rows of tied logits: all four equal, three, two pairs, two of the top three.
TIED_LOGITS = torch.tensor(
    [[3.0, 3.0, 3.0, 3.0], [0.0, 2.0, 2.0, 2.0], [1.0, 1.0, 0.0, 0.0], [0.5, -1.0, 0.5, 0.5]]
)


@pytest.mark.parametrize(
    "variant",
    ["gelu_top1", "top2_normalized", "sigmoid_top2", "sigmoid_top2_expert_bias",
     "softmax_top1_expert_bias"],
)  # fmt: skip
def test_ties_break_as_the_project_routers(auto_model, tmp_path, variant):
    """Tied scores go to the experts the project's router picks: the lower index by argmax or
    its top-k kernel, torch.topk's choice with an expert bias (here one value for all experts,
    so that the scores' ties stay ties; torch.topk on CPU does not prefer the lower index)."""
    project, model = exported_pair(auto_model, tmp_path, variant)
    router, hf_router = project_routers(project)[0], hf_routers(model)[0]
    with torch.no_grad():
        if router.expert_bias is not None:
            router.expert_bias.fill_(0.25)
            hf_router.expert_bias.fill_(0.25)
        routing = router.route(TIED_LOGITS)
        weights, experts = hf_router.route(TIED_LOGITS)
    assert torch.equal(experts, routing.expert_indices)
    assert torch.equal(weights, routing.expert_weights.float())


def test_a_config_json_without_the_routing_fields_routes_as_before(auto_model, tmp_path):
    """A config.json written before the moe_router_* fields existed loads with the routing it
    had: the softmax over all experts, no scaling, no expert bias."""
    project, model_config, moe_config = build_project_model({}, {"top_k": 2})
    directory = export(project, model_config, moe_config, tmp_path / "dmoe_older")
    config = json.loads((directory / "config.json").read_text())
    routing_fields = [key for key in config if key.startswith("moe_router_")]
    assert len(routing_fields) == 5
    for key in routing_fields:
        del config[key]
    (directory / "config.json").write_text(json.dumps(config))
    model = load(auto_model, directory)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert_relative(model(tokens).logits, project(tokens)[..., :VOCAB], 1e-5)


def test_loss_is_the_project_models_mean_cross_entropy(auto_model, tmp_path):
    """Without padded rows the project's own per-token losses apply; -100 labels are skipped."""
    project, model_config, moe_config = build_project_model({"padded_vocab_size": VOCAB}, {})
    model = load(auto_model, export(project, model_config, moe_config, tmp_path / "dmoe_loss"))
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    labels = tokens.clone()
    labels[0, 5:9] = -100
    with torch.no_grad():
        losses = project(tokens[:, :-1], labels=tokens[:, 1:])
        kept = labels[:, 1:] != -100
        expected_all, expected_kept = losses.mean().item(), losses[kept].mean().item()
        assert abs(model(tokens, labels=tokens).loss.item() - expected_all) <= 1e-6 * expected_all
        loss = model(tokens, labels=labels).loss.item()
    assert abs(loss - expected_kept) <= 1e-6 * expected_kept


@pytest.mark.parametrize("variant", ["gelu_top1", "top2_normalized", "untied_no_bias_gqa"])
def test_greedy_generation_matches_with_and_without_cache_and_the_project(
    auto_model, tmp_path, variant
):
    project, model = exported_pair(auto_model, tmp_path, variant, eos=None)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    cached, cached_logits = hf_greedy(model, prompt, use_cache=True)
    uncached, uncached_logits = hf_greedy(model, prompt, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached[0].tolist() == project_greedy(project, prompt[0].tolist(), NEW_TOKENS)
    # Every decode step's logits, not only its argmax: a step that read a stale or empty cache
    # can still pick the same token on a short prompt.
    with torch.no_grad():
        expected = project(torch.cat([prompt, cached], dim=1))[:, prompt.shape[1] - 1 : -1, :VOCAB]
    assert_relative(cached_logits, expected, 1e-5)
    assert_relative(uncached_logits, expected, 1e-5)


def test_cache_steps_give_the_full_sequences_logits(auto_model, tmp_path):
    """A prefill, then a chunk of several tokens, then single tokens, through one cache."""
    from transformers import DynamicCache

    _, model = exported_pair(auto_model, tmp_path, "top2_normalized")
    tokens = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        pieces = [model(tokens[:, :8], past_key_values=cache, use_cache=True).logits]
        pieces.append(model(tokens[:, 8:11], past_key_values=cache, use_cache=True).logits)
        for position in range(11, 14):
            step = tokens[:, position : position + 1]
            pieces.append(model(step, past_key_values=cache, use_cache=True).logits)
    assert_relative(torch.cat(pieces, dim=1), expected, 1e-5)


@pytest.mark.parametrize("variant", ["gelu_top1", "top2_normalized"])
def test_left_padded_batch_matches_single_prompts(auto_model, tmp_path, variant):
    _, model = exported_pair(auto_model, tmp_path, variant, eos=None)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (length,), generator=generator) for length in (3, 8, 5)]
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        batch_logits = model(input_ids, attention_mask=attention_mask).logits
    batch_new, batch_step_logits = hf_greedy(model, input_ids, attention_mask)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            single_logits = model(prompt[None]).logits[0]
        assert_relative(batch_logits[row, width - len(prompt) :], single_logits, 1e-5)
        single_new, single_step_logits = hf_greedy(model, prompt[None])
        assert torch.equal(batch_new[row], single_new[0])
        assert_relative(batch_step_logits[row], single_step_logits[0], 1e-5)


def test_gathered_and_per_expert_paths_agree(auto_model, tmp_path):
    _, model = exported_pair(auto_model, tmp_path, "untied_no_bias_gqa")
    moe = model.decoder.layers[0].mlp
    x = torch.randn(3, moe.experts.w1.shape[1], generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        weights, experts = moe.route(x)
        gathered = moe.experts._gathered(x, weights, experts)
        per_expert = moe.experts._per_expert(x, weights, experts)
    assert_relative(gathered, per_expert, 1e-6)


@pytest.mark.parametrize("variant", ["gelu_top1", "untied_no_bias_gqa"])
def test_save_pretrained_round_trips_and_ties_once(auto_model, tmp_path, variant):
    _, model = exported_pair(auto_model, tmp_path, variant)
    tied = model.config.tie_word_embeddings
    output_weight = model.get_output_embeddings().weight
    assert (output_weight is model.get_input_embeddings().weight) == tied
    saved = tmp_path / f"resaved_{variant}"
    model.save_pretrained(str(saved))  # copies the remote code too: the model came through it
    keys = set(safetensors_torch.load_file(str(saved / "model.safetensors")))
    assert ("output_layer.weight" in keys) == (not tied)
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == "megatron_dmoe" and config["auto_map"] == AUTO_MAP
    assert all((saved / name).is_file() for name in REMOTE_CODE_FILES)
    tokens = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(7))
    reloaded = load(auto_model, saved)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


def test_config_json_names_the_remote_code(tmp_path):
    project, model_config, moe_config = build_project_model({}, {"top_k": 2})
    export_dir = export(project, model_config, moe_config, tmp_path)
    config = json.loads((export_dir / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["architectures"] == ["MegatronDMoEForCausalLM"]
    expected = {
        "model_type": "megatron_dmoe", "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2,
        "num_attention_heads": 4, "num_query_groups": 4, "ffn_hidden_size": 48,
        "max_position_embeddings": MAX_POSITIONS, "num_experts": 4, "moe_top_k": 2,
        "moe_layer_freq": 1, "mlp_type": "mlp", "activation": "gelu",
        "normalize_expert_weights": None, "add_bias_linear": True, "moe_ffn_hidden_size": None,
        "moe_router_score": "softmax", "moe_router_pre_softmax": True,
        "moe_router_topk_scaling_factor": None, "moe_router_bias_update_rate": 0.0,
        "moe_router_dtype": None, "eos_token_id": EOS, "bos_token_id": EOS,
    }  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    # transformers 4 leaves out a value equal to its own default (True).
    assert config.get("tie_word_embeddings", True) is True
    for name in REMOTE_CODE_FILES:
        assert (export_dir / name).read_bytes() == (Path(REMOTE_CODE_DIR) / name).read_bytes()


REFUSALS = [
    ({"position_embedding_type": "rope"}, {}, "--position-embedding-type rope"),
    ({"normalization": "RMSNorm"}, {}, "--normalization RMSNorm"),
    ({}, {"dropless": False}, "--no-moe-dropless"),
    ({}, {"shared_expert": True}, "--moe-shared-expert"),
]


@pytest.mark.parametrize("model_overrides, moe_overrides, flag", REFUSALS)
def test_unsupported_models_are_refused_with_the_flag(model_overrides, moe_overrides, flag):
    model_config = tiny_model_config(**model_overrides)
    moe_config = MoEConfig(**{"num_experts": 4, **moe_overrides})
    with pytest.raises(ValueError) as error:
        megatron_dmoe_config_from(model_config, moe_config, VOCAB, EOS)
    assert flag in str(error.value) and "\n" not in str(error.value)


def test_dense_models_and_oversized_vocabularies_are_refused():
    model_config = tiny_model_config()
    with pytest.raises(ValueError, match="--moe-num-experts"):
        megatron_dmoe_config_from(model_config, None, VOCAB, EOS)
    moe_config = MoEConfig(num_experts=4)
    too_big = model_config.padded_vocab_size + 1
    with pytest.raises(ValueError, match="padded vocabulary"):
        megatron_dmoe_config_from(model_config, moe_config, too_big, EOS)
    gqa = dataclasses.replace(model_config, num_query_groups=2)
    assert megatron_dmoe_config_from(gqa, moe_config, VOCAB, EOS)["num_query_groups"] == 2
