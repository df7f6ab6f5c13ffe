"""tools/run_text_generation_server.py over real HTTP on a free loopback port: Megatron's
`PUT /api` answered with prompt + completion (and segments, tokens) equal to what the
TextGenerator computes directly; malformed requests answered 400 naming the field."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from gpt_pretraining.text_generation_server import GenerationServer
from megatron.inference import GenerationEngine, SamplingOptions, TextGenerator
from megatron.model import GPTModel
from megatron.tokenizer import build_tokenizer
from tests.sample_data import MERGES, VOCAB
from tests.tiny_gpt import tiny_model_config


@pytest.fixture(scope="module")
def generator():
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(VOCAB), str(MERGES))
    config = tiny_model_config(
        padded_vocab_size=50304, max_position_embeddings=64, seq_length=64, init_method_std=0.3
    )
    torch.manual_seed(0)
    engine = GenerationEngine(GPTModel(config), tokenizer.eod, tokenizer.vocab_size)
    return TextGenerator(engine, tokenizer, max_batch_size=2)


@pytest.fixture(scope="module")
def url(generator):
    server = GenerationServer(("127.0.0.1", 0), generator)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def put(url: str, body, path: str = "/api", method: str = "PUT"):
    """(status, decoded JSON answer) of a request with `body` (bytes, or JSON-encoded)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_put_api_returns_prompt_and_completion(url, generator):
    prompts = ["The city of", "Hello", ""]  # three prompts: two batches of max_batch_size 2
    status, answer = put(url, {"prompts": prompts, "tokens_to_generate": 6, "top_k": 1})
    assert status == 200, answer
    expected = generator.complete(prompts, 6, SamplingOptions(greedy=True))
    assert answer["text"] == [completion.full_text for completion in expected]
    assert answer["tokens"] == [c.prompt_tokens + c.tokens for c in expected]
    assert [len(segments) for segments in answer["segments"]] == [len(t) for t in answer["tokens"]]
    assert all(text.startswith(prompt) for text, prompt in zip(answer["text"], prompts))
    assert any(completion.tokens for completion in expected)


def test_random_seed_reproduces_a_sampled_answer(url):
    request = {"prompts": ["Once upon"], "tokens_to_generate": 8, "top_p": 0.9,
               "temperature": 1.3, "random_seed": 11}  # fmt: skip
    first = put(url, request)
    assert first[0] == 200
    assert put(url, request) == first


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "the body is not JSON"),
        ({"tokens_to_generate": 4}, '"prompts" must be a list of strings'),
        ({"prompts": "text"}, '"prompts" must be a list of strings'),
        ({"prompts": []}, '"prompts" must hold 1 to 128 prompts, not 0'),
        ({"prompts": ["a"], "tokens_to_generate": -1}, '"tokens_to_generate" must be >= 0'),
        ({"prompts": ["a"], "tokens_to_generate": 2.5}, '"tokens_to_generate" must be an int'),
        ({"prompts": ["a"], "temperature": 0}, '"temperature" must be > 0'),
        ({"prompts": ["a"], "top_p": 1.5}, '"top_p" 1.5 must lie in [0, 1]'),
        ({"prompts": ["a"], "top_k": "1"}, '"top_k" must be a number, got "1"'),
        ({"prompts": ["a"], "tokens_to_generate": 100}, "max_position_embeddings=64"),
    ],
)
def test_bad_requests_are_answered_400(url, body, message):
    status, answer = put(url, body)
    assert status == 400
    assert message in answer["message"]


def test_other_paths_and_methods(url):
    assert put(url, {"prompts": ["a"]}, path="/generate")[0] == 404
    assert put(url, {"prompts": ["a"]}, method="POST")[0] == 405
