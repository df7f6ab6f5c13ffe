"""tools/generate.py's greedy tokens equal transformers' `generate` on the exported model, token
for token: GPT-2, Mixtral-style and the GPT-2 dMoE with its modeling file (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from gpt_pretraining import generate_text  # noqa: E402
from gpt_pretraining.huggingface import hf_convert  # noqa: E402
from tests.tools.hf_checkpoints import MIXTRAL, write_checkpoint  # noqa: E402

PROMPTS = ["The history of the city", "In 1998, the company announced that"]
KINDS = {
    "gpt2": [],
    "mixtral": MIXTRAL,
    "gpt2_dmoe": ["--moe-num-experts", "4", "--moe-top-k", "1"],
}
NEW_TOKENS = 32


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_generation_equals_transformers(kind, tmp_path, capsys, auto_model):
    from transformers import AutoTokenizer

    # Positions for the prompt and 32 new tokens.
    flags = [*KINDS[kind], "--seq-length", "48", "--max-position-embeddings", "48"]
    write_checkpoint(tmp_path / "ckpt", flags)
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf"]
    assert hf_convert.main([*argv, "--load-dir", str(tmp_path / "ckpt"), "--save-dir",
                         str(tmp_path / "hf")]) == 0  # fmt: skip
    capsys.readouterr()
    argv = ["--load", str(tmp_path / "ckpt"), "--greedy", "--json", "--device", "cpu"]
    argv += ["--tokens-to-generate", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert generate_text.main(argv) == 0
    ours = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = auto_model.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, trust_remote_code=True
    ).eval()
    for prompt, our_tokens in zip(PROMPTS, ours):
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        output = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )
        theirs = output[0, prompt_ids.shape[1] :].tolist()
        # transformers keeps the end-of-document token it stopped at; ours stops before it.
        eod = tokenizer.eos_token_id
        assert our_tokens == (theirs[: theirs.index(eod)] if eod in theirs else theirs)
        assert len(theirs) == NEW_TOKENS or theirs[-1] == eod
