"""KV-cache decoding (megatron.inference.decode) computes what the full model computes on the
growing sequence, for each kind of model; a left-padded batch decodes each row as its prompt
alone; the engine's greedy tokens are the full model's argmax chain."""

from __future__ import annotations

import pytest
import torch

from megatron.inference import GenerationEngine, KVCache, SamplingOptions
from megatron.inference.decode import decode_step, prefill
from tests.inference.models import MODELS, VOCAB, tiny_model

PROMPT = [3, 17, 42, 8, 25]
STEPS = 12
GREEDY = SamplingOptions(greedy=True)


def allocate_cache(model, batch_size: int, capacity: int = 64) -> KVCache:
    attention = model.decoder.layers[0].self_attention
    return KVCache.allocate(
        len(model.decoder.layers),
        batch_size,
        attention.num_query_groups,
        capacity,
        attention.head_dim,
        torch.float32,
        torch.device("cpu"),
    )


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_cached_logits_equal_full_model_on_growing_sequence(name):
    model = tiny_model(name)
    cache = allocate_cache(model, 1)
    sequence = list(PROMPT)
    logits = prefill(model, cache, torch.tensor([PROMPT]), torch.tensor([len(PROMPT)]))
    chosen = []
    for _ in range(STEPS):
        expected = model(torch.tensor([sequence]))[:, -1]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        token = int(expected.argmax())
        assert int(logits.argmax()) == token
        chosen.append(token)
        sequence.append(token)
        logits = decode_step(model, cache, torch.tensor([[token]]))
    assert len(set(chosen)) > 2, f"the random model repeats itself: {chosen}"


@pytest.mark.parametrize("name", MODELS)
def test_engine_greedy_tokens_are_the_full_models_argmax_chain(name):
    model = tiny_model(name)
    generated = GenerationEngine(model, eod=VOCAB - 1).generate([PROMPT], STEPS, GREEDY)[0]
    sequence = list(PROMPT)
    with torch.no_grad():
        for _ in range(STEPS):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
    assert generated == sequence[len(PROMPT) :]


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_left_padded_batch_decodes_each_row_as_its_prompt_alone(name):
    model = tiny_model(name)
    prompts = [[5, 9, 31, 2, 60, 11, 7], [44], [12, 13, 14]]
    padded_length = max(len(prompt) for prompt in prompts)
    tokens = torch.tensor([[0] * (padded_length - len(p)) + p for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    batch_cache = allocate_cache(model, len(prompts))
    batch_logits = prefill(model, batch_cache, tokens, lengths)
    alone = [allocate_cache(model, 1) for _ in prompts]
    alone_logits = [
        prefill(model, cache, torch.tensor([p]), torch.tensor([len(p)]))
        for cache, p in zip(alone, prompts)
    ]
    for _ in range(6):
        torch.testing.assert_close(batch_logits, torch.cat(alone_logits), atol=1e-5, rtol=0)
        next_tokens = batch_logits.argmax(dim=-1)
        batch_logits = decode_step(model, batch_cache, next_tokens.view(-1, 1))
        alone_logits = [
            decode_step(model, cache, next_tokens[row].view(1, 1))
            for row, cache in enumerate(alone)
        ]

    engine = GenerationEngine(model, eod=VOCAB - 1)
    batch = engine.generate(prompts, 10, GREEDY)
    assert batch == [engine.generate([prompt], 10, GREEDY)[0] for prompt in prompts]


def test_generation_stops_at_eod_and_reuses_the_cache():
    model = tiny_model("gpt")
    engine = GenerationEngine(model, eod=VOCAB - 1)
    free = engine.generate([PROMPT], STEPS, GREEDY, stop_at_eod=False)[0]
    eod = free[3]  # make the fourth generated token the end of document
    engine = GenerationEngine(model, eod=eod)
    first_cache = engine.generate([PROMPT], STEPS, GREEDY) and engine._cache
    assert engine.generate([PROMPT], STEPS, GREEDY)[0] == free[: free.index(eod)]
    assert engine._cache is first_cache  # the same batch size and length reuse the buffers
    assert engine.generate([PROMPT], STEPS, GREEDY, stop_at_eod=False)[0] == free


def test_vocabulary_padding_is_never_generated():
    model = tiny_model("gpt")  # tied: the output layer is the word embedding table
    with torch.no_grad():
        model.embedding.word_embeddings.weight[40:] *= 50.0  # "padding" rows that win argmax
    unrestricted = GenerationEngine(model, eod=0).generate([PROMPT], STEPS, GREEDY, False)[0]
    assert max(unrestricted) >= 40
    engine = GenerationEngine(model, eod=0, vocab_size=40)
    generated = engine.generate([PROMPT], STEPS, GREEDY, stop_at_eod=False)[0]
    assert len(generated) == STEPS and max(generated) < 40


def test_learned_positions_limit_the_generated_length():
    engine = GenerationEngine(tiny_model("gpt"), eod=VOCAB - 1)  # 48 positions
    assert len(engine.generate([PROMPT], 48 - len(PROMPT) + 1, GREEDY, stop_at_eod=False)[0])
    with pytest.raises(ValueError, match="max_position_embeddings=48; generate at most 44"):
        engine.generate([PROMPT], 48 - len(PROMPT) + 2, GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([PROMPT, []], 4, GREEDY)
