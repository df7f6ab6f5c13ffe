"""An exported model under EleutherAI's lm-eval, as docs/inference.md shows it: a multiple-
choice task defined from a local file (nothing downloaded), whose per-choice log-likelihoods
are this project's model's, computed here from the checkpoint."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from gpt_pretraining.checkpoint_model import read_checkpoint_model  # noqa: E402
from gpt_pretraining.huggingface import hf_convert  # noqa: E402
from gpt_pretraining.huggingface.hf_export import TokenizerFiles, build_checkpoint_tokenizer  # noqa: E402
from tests.tools.hf_checkpoints import GPT2_VOCAB_SIZE, write_checkpoint  # noqa: E402

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "a dog"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0},
    {"question": "The sky is", "choices": ["blue", "made of cheese", "green"], "answer": 0},
    {
        "question": "Water freezes at zero degrees",
        "choices": ["Celsius", "Fahrenheit"],
        "answer": 0,
    },
]
TASK = """task: local_multiple_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_scores_the_exported_model(tmp_path):
    write_checkpoint(tmp_path / "ckpt", [])
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf"]
    argv += ["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]
    assert hf_convert.main(argv) == 0
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tasks / "local_multiple_choice.yaml").write_text(TASK.format(data=data))
    environment = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1",
                       HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "hf",
        "--model_args", f"pretrained={tmp_path / 'hf'},dtype=float32",
        "--tasks", "local_multiple_choice", "--include_path", str(tasks), "--device", "cpu",
        "--output_path", str(tmp_path / "results"), "--log_samples",
    ]  # fmt: skip
    completed = subprocess.run(command, env=environment, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (samples_file,) = glob.glob(
        str(tmp_path / "results" / "**" / "samples_*.jsonl"), recursive=True
    )
    samples = [json.loads(line) for line in open(samples_file)]
    assert len(samples) == len(DOCS)

    checkpoint = read_checkpoint_model(str(tmp_path / "ckpt"), print_fn=lambda _: None)
    model = checkpoint.build_model()
    tokenizer = build_checkpoint_tokenizer(checkpoint, TokenizerFiles())
    correct = 0
    for sample in samples:
        ours = []
        for request, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = request["arg_0"], request["arg_1"]
            context_ids = tokenizer.tokenize(context)
            whole = tokenizer.tokenize(context + continuation)
            tokens = torch.tensor([whole])
            with torch.no_grad():
                logits = model(tokens)[0, :, :GPT2_VOCAB_SIZE].double()
            log_probs = logits.log_softmax(-1)
            positions = range(len(context_ids), len(whole))
            ours.append(sum(log_probs[p - 1, whole[p]].item() for p in positions))
            assert float(response[0][0]) == pytest.approx(ours[-1], abs=1e-4)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == sample["doc"]["answer"])
    (results_file,) = glob.glob(str(tmp_path / "results" / "**" / "results_*.json"), recursive=True)
    results = json.loads(open(results_file).read())["results"]["local_multiple_choice"]
    assert results["acc,none"] == pytest.approx(correct / len(DOCS))
