"""tools/checkpoint/convert.py between this project's checkpoints and Hugging Face model
directories: the exported models compute this project's logits and loss, round trips keep
every bit, and what no class expresses is refused with what it lacks."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from gpt_pretraining.checkpoint_model import read_checkpoint_model  # noqa: E402
from gpt_pretraining.huggingface import hf_convert  # noqa: E402
from gpt_pretraining.huggingface.hf_export import REMOTE_DMOE  # noqa: E402
from gpt_pretraining.huggingface.hf_files import (  # noqa: E402
    is_training_counter,
    read_safetensors,
)
from moe.config import MoEConfig  # noqa: E402
from tests.tools.hf_checkpoints import (  # noqa: E402
    GPT2_VOCAB_SIZE,
    LLAMA,
    MIXTRAL,
    tiny_config,
    write_checkpoint,
)

# Fine-grained experts (half the dense size) beside a dense first layer.
FINE_GRAINED_DMOE = [
    "--moe-num-experts", "4", "--moe-top-k", "2", "--moe-ffn-hidden-size", "24",
    "--moe-layer-freq", "([0]*1+[1]*1)",
]  # fmt: skip
SIGMOID_BIAS_DMOE = [
    "--moe-num-experts", "4", "--moe-top-k", "2", "--moe-router-score", "sigmoid",
    "--moe-router-bias-update-rate", "0.01", "--moe-router-topk-scaling-factor", "2.0",
]  # fmt: skip
KINDS = {
    "gpt2": ([], "GPT2LMHeadModel"),
    "llama": (LLAMA, "LlamaForCausalLM"),
    "llama_tied_with_biases": (
        ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"],
        "LlamaForCausalLM",
    ),
    "mixtral": (MIXTRAL, "MixtralForCausalLM"),
    # Megatron-Core's default weights, the softmax over the chosen logits: Mixtral's too
    "mixtral_softmax_after_top_k": (
        MIXTRAL[:-2] + ["--no-moe-router-pre-softmax"],
        "MixtralForCausalLM",
    ),
    # MegaBlocks' recipe (GELU experts, biases, learned positions): this project's modeling file
    "gpt2_dmoe": (["--moe-num-experts", "4", "--moe-top-k", "2"], REMOTE_DMOE),
    "gpt2_dmoe_fine_grained": (FINE_GRAINED_DMOE, REMOTE_DMOE),
    # DeepSeek-V3's routing: sigmoid scores, the expert bias (random in these checkpoints, as
    # every tensor) choosing, the weights scaled.
    "gpt2_dmoe_sigmoid_bias": (SIGMOID_BIAS_DMOE, REMOTE_DMOE),
    # Mixtral's experts are its only MLPs: their size is its intermediate_size.
    "mixtral_fine_grained": ([*MIXTRAL, "--moe-ffn-hidden-size", "24"], "MixtralForCausalLM"),
}


def export(load_dir, save_dir, *extra) -> None:
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf"]
    assert (
        hf_convert.main([*argv, "--load-dir", str(load_dir), "--save-dir", str(save_dir), *extra])
        == 0
    )


def import_(load_dir, save_dir) -> None:
    argv = ["--model-type", "GPT", "--loader", "hf", "--saver", "megatron"]
    assert hf_convert.main([*argv, "--load-dir", str(load_dir), "--save-dir", str(save_dir)]) == 0


def ours_and_theirs(auto_model, checkpoint_dir, hf_dir, tokens):
    """(this project's logits [1, s, vocab] and mean loss, transformers' logits and loss).

    This project's loss is taken over the tokenizer's vocabulary: the padded rows, which no
    token has, are not exported (trained, their logits sit far below the real ones; random
    here, they would weigh in the softmax)."""
    model = read_checkpoint_model(str(checkpoint_dir), print_fn=lambda _: None).build_model()
    hf_model = auto_model.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=True)
    hf_model.eval()
    with torch.no_grad():
        logits = model(tokens)[..., :GPT2_VOCAB_SIZE]
        losses = torch.nn.functional.cross_entropy(
            logits[0, :-1].double(), tokens[0, 1:], reduction="none"
        ).float()
        output = hf_model(tokens, labels=tokens)
    return logits, losses.mean(), output.logits, output.loss


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_export_computes_the_same_logits_and_loss(kind, ckpt_format, tmp_path, auto_model):
    flags, architecture = KINDS[kind]
    write_checkpoint(tmp_path / "ckpt", flags, ckpt_format)
    export(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config["vocab_size"] == GPT2_VOCAB_SIZE
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    tokens = tokenizer("The model leaves the framework and runs elsewhere.", return_tensors="pt")
    tokens = tokens.input_ids
    logits, loss, hf_logits, hf_loss = ours_and_theirs(
        auto_model, tmp_path / "ckpt", tmp_path / "hf", tokens
    )
    assert hf_logits.shape == logits.shape
    scale = logits.abs().max()
    assert (hf_logits - logits).abs().max() <= 1e-5 * scale
    assert abs(hf_loss.item() - loss.item()) <= 1e-6 * loss.item()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_export_then_import_reproduces_the_checkpoint(kind, tmp_path):
    flags, architecture = KINDS[kind]
    state, config = write_checkpoint(tmp_path / "ckpt", flags)
    export(tmp_path / "ckpt", tmp_path / "hf")
    import_(tmp_path / "hf", tmp_path / "imported")
    imported = read_checkpoint_model(str(tmp_path / "imported"), print_fn=lambda _: None)
    assert imported.iteration == "release"
    if architecture == REMOTE_DMOE:
        # Its config.json carries every MoE flag, the routing's too. (Mixtral's comes back as
        # flags that compute the same: --moe-normalize-expert-weights 1 for the softmax of
        # the chosen logits, --ffn-hidden-size for its only MLPs' size.)
        assert imported.moe == config.extension(MoEConfig)
    assert imported.state_dict.keys() == state.keys()
    for name, tensor in state.items():
        if is_training_counter(name):  # not exported; a finetune counts from zero
            assert not imported.state_dict[name].any(), name
        elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(
                imported.state_dict[name][:GPT2_VOCAB_SIZE], tensor[:GPT2_VOCAB_SIZE]
            )
            assert not imported.state_dict[name][GPT2_VOCAB_SIZE:].any()
        else:
            assert torch.equal(imported.state_dict[name], tensor), name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_import_then_export_reproduces_the_hugging_face_tensors(kind, tmp_path, auto_model):
    """A model saved by transformers itself (its own initialization, its own file layout)
    comes back tensor for tensor."""
    flags, _ = KINDS[kind]
    write_checkpoint(tmp_path / "ckpt", flags)
    export(tmp_path / "ckpt", tmp_path / "seed")
    torch.manual_seed(5)
    seed_config = auto_model.from_pretrained(tmp_path / "seed", trust_remote_code=True).config
    original = auto_model.from_config(seed_config, dtype=torch.float32, trust_remote_code=True)
    with torch.no_grad():  # norms and biases off their defaults too
        for tensor in original.parameters():
            tensor.add_(0.05 * torch.randn_like(tensor))
    original.save_pretrained(tmp_path / "original")
    AutoTokenizer.from_pretrained(tmp_path / "seed").save_pretrained(tmp_path / "original")
    import_(tmp_path / "original", tmp_path / "imported")
    export(tmp_path / "imported", tmp_path / "again")
    before = auto_model.from_pretrained(tmp_path / "original", trust_remote_code=True).state_dict()
    after = auto_model.from_pretrained(tmp_path / "again", trust_remote_code=True).state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    # The files hold the same names too (transformers writes Mixtral's experts per expert, the
    # Hub's layout, as the export does).
    assert read_safetensors(str(tmp_path / "again")).keys() <= read_safetensors(
        str(tmp_path / "original")
    ).keys() | {"lm_head.weight"}


def test_mixtral_experts_import_from_either_layout(tmp_path, auto_model):
    """Mixtral's experts as the Hub stores them (per expert) and as transformers 5 holds them
    in memory (fused gate_up_proj / down_proj, which a file written from its state_dict keeps)
    import to the same checkpoint."""
    from safetensors.torch import save_file

    write_checkpoint(tmp_path / "ckpt", MIXTRAL)
    export(tmp_path / "ckpt", tmp_path / "per_expert")
    model = auto_model.from_pretrained(tmp_path / "per_expert")
    fused = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if not any(name.endswith("mlp.experts.gate_up_proj") for name in fused):
        import transformers

        assert int(transformers.__version__.split(".")[0]) < 5, sorted(fused)
        pytest.skip("transformers 4 holds Mixtral's experts as the Hub stores them")
    (tmp_path / "fused").mkdir()
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "fused" / name).write_bytes((tmp_path / "per_expert" / name).read_bytes())
    import_(tmp_path / "per_expert", tmp_path / "from_per_expert")
    import_(tmp_path / "fused", tmp_path / "from_fused")
    first = read_checkpoint_model(str(tmp_path / "from_per_expert"), print_fn=lambda _: None)
    second = read_checkpoint_model(str(tmp_path / "from_fused"), print_fn=lambda _: None)
    assert first.state_dict.keys() == second.state_dict.keys()
    for name, tensor in first.state_dict.items():
        assert torch.equal(second.state_dict[name], tensor), name


def test_imported_checkpoint_finetunes(data_prefix, tmp_path, capsys):
    """pretrain_gpt.py --load IMPORTED --finetune with the printed flags trains from the
    imported weights: its losses are those of a run finetuning the checkpoint exported."""
    import re

    import pretrain_gpt
    from tests.tiny_gpt import tiny_gpt_args

    write_checkpoint(tmp_path / "ckpt", [], zero_padding=True)
    export(tmp_path / "ckpt", tmp_path / "hf")
    capsys.readouterr()
    import_(tmp_path / "hf", tmp_path / "imported")
    line = next(
        text for text in capsys.readouterr().out.splitlines() if text.startswith("train it with:")
    )
    model_flags = line.split("--finetune ", 1)[1].split(" [")[0].split()

    def first_losses(load_dir) -> list:
        argv = tiny_gpt_args(data_prefix, train_iters=3, seq_length=16) + model_flags
        argv += ["--micro-batch-size", "2", "--global-batch-size", "2"]
        if load_dir is not None:
            argv += ["--load", str(load_dir), "--finetune"]
        assert pretrain_gpt.main(argv).iteration == 3
        return re.findall(r"\| lm loss: (\S+) \|", capsys.readouterr().out)

    imported = first_losses(tmp_path / "imported")
    assert len(imported) == 3
    assert imported == first_losses(tmp_path / "ckpt")
    assert imported[0] != first_losses(None)[0]  # a fresh model's first loss differs


def test_sharded_export_loads(tmp_path):
    write_checkpoint(tmp_path / "ckpt", LLAMA)
    export(tmp_path / "ckpt", tmp_path / "hf", "--max-shard-size", "0.002")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--position-embedding-type", "rope"],
            "GPT2LMHeadModel cannot express --position-embedding-type rope",
        ),
        (LLAMA + ["--rotary-percent", "0.5"], "--rotary-percent 0.5"),
        (MIXTRAL[:-2], "--moe-normalize-expert-weights None"),
        (MIXTRAL + ["--moe-shared-expert"], "--moe-shared-expert"),
        (
            MIXTRAL + ["--moe-router-topk-scaling-factor", "2"],
            "--moe-router-topk-scaling-factor 2.0",
        ),
        (MIXTRAL + ["--moe-layer-freq", "[0,1]"], "--moe-layer-freq [0,1] (Mixtral's every"),
    ],
)
def test_models_no_class_fits_are_refused(flags, expected, tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", flags)
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf"]
    argv += ["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]
    assert hf_convert.main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: no Hugging Face class fits this model") and "\n" not in error
    assert expected in error
    assert not (tmp_path / "hf").exists()


def test_missing_tokenizer_file_names_the_flag(tmp_path, capsys):
    args, _ = tiny_config([])
    write_checkpoint(tmp_path / "ckpt", [])
    moved = tmp_path / "elsewhere.json"
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--vocab-file",
            str(moved), "--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]  # fmt: skip
    assert hf_convert.main(argv) == 1
    error = capsys.readouterr().err
    assert f"{moved}" in error and "--vocab-file" in error


def test_a_sentencepiece_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus for a tokenizer\n" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=40, minloglevel=2
    )
    model_file = str(tmp_path / "sp.model")
    write_checkpoint(
        tmp_path / "ckpt",
        ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model_file],
    )
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf"]
    argv += ["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]
    assert hf_convert.main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: the checkpoint's SentencePieceTokenizer") and "\n" not in error
    assert not (tmp_path / "hf").exists()


def test_a_tensor_parallel_dmoe_run_exports(data_prefix, tmp_path, auto_model):
    """A checkpoint saved by 2 tensor-parallel ranks (each holding half of every expert's
    channels) exports like any other: the export computes the logits of the model the
    checkpoint holds."""
    from tests.launch import pretrain_ranks
    from tests.tiny_gpt import MOE_ARGS, tiny_gpt_args

    args = tiny_gpt_args(data_prefix, *MOE_ARGS, train_iters=3, tensor_parallel=2)
    args += ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    pretrain_ranks(2, args, tmp_path / "tb")
    export(tmp_path / "ckpt", tmp_path / "hf")
    tokens = torch.randint(0, GPT2_VOCAB_SIZE, (1, 24), generator=torch.Generator().manual_seed(1))
    logits, loss, hf_logits, hf_loss = ours_and_theirs(
        auto_model, tmp_path / "ckpt", tmp_path / "hf", tokens
    )
    assert (hf_logits - logits).abs().max() <= 1e-5 * logits.abs().max()
    assert abs(hf_loss.item() - loss.item()) <= 1e-6 * loss.item()
