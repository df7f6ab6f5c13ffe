"""Text generation with a GPTModel: a static KV cache, a decode step replayed from a CUDA graph,
greedy and top-k / top-p sampling (tools/generate.py, tools/run_text_generation_server.py)."""

from megatron.inference.engine import GenerationEngine
from megatron.inference.kv_cache import KVCache
from megatron.inference.sampling import SamplingOptions, filter_logits, sample_tokens
from megatron.inference.text import Completion, TextGenerator

__all__ = [
    "Completion",
    "GenerationEngine",
    "KVCache",
    "SamplingOptions",
    "TextGenerator",
    "filter_logits",
    "sample_tokens",
]
