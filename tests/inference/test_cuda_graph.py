"""On a GPU: the decode step replayed from a CUDA graph gives the eager step's results, for
each kind of model, in fp32 and bf16, greedy and sampled, padded batches included."""

from __future__ import annotations

import pytest
import torch

from megatron.inference import GenerationEngine, SamplingOptions
from tests.inference.models import MODELS, VOCAB, tiny_model
from tests.markers import gpu

PROMPTS = [[3, 17, 42, 8, 25, 9, 1], [44], [12, 13, 14]]
OPTIONS = [SamplingOptions(greedy=True), SamplingOptions(top_k=20, top_p=0.9, seed=4)]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODELS)
def test_cuda_graph_steps_give_the_eager_steps_tokens(name, dtype):
    model = tiny_model(name).to(device="cuda", dtype=dtype)
    graphed = GenerationEngine(model, eod=VOCAB - 1)
    eager = GenerationEngine(model, eod=VOCAB - 1, cuda_graphs=False)
    for options in OPTIONS:
        expected = eager.generate(PROMPTS, 20, options, stop_at_eod=False)
        assert graphed.generate(PROMPTS, 20, options, stop_at_eod=False) == expected
        assert graphed.decode_mode == "CUDA graph"
    # A later call that fits the cache replays the captured step again.
    runner = graphed._runner
    expected = eager.generate(PROMPTS, 20, OPTIONS[0], stop_at_eod=False)
    assert graphed.generate(PROMPTS, 20, OPTIONS[0], stop_at_eod=False) == expected
    assert graphed._runner is runner
    if dtype == torch.float32:  # in bf16 a padded row's rounding may differ from its own
        alone = [graphed.generate([p], 20, OPTIONS[0], stop_at_eod=False)[0] for p in PROMPTS]
        assert alone == expected
