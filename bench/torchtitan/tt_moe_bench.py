"""Extra model flavors for torchtitan 0.2.2, loaded with
``--experimental.custom_import tt_moe_bench`` (this file on PYTHONPATH).
Nothing in torchtitan is edited: the flavors are added to the Qwen3 family's
flavor table (``torchtitan.models.qwen3.qwen3_args``), which the Trainer looks
up after the custom import, so ``--model.name qwen3 --model.flavor moe125m``.

Shape: 12 layers, hidden 768, 12 heads of 64 (n_kv_heads == n_heads: standard
multi-head attention, no QK-norm), every layer's FFN an MoE of 64 routed
experts, top-1, no shared expert, GPT-2 vocabulary padded to 50304, tied
input/output embeddings.  torchtitan's experts are SwiGLU (w1, w3: dim->ffn,
w2: ffn->dim), so:
  moe125m          expert ffn 2048: 3*768*2048 = 2*768*3072 parameters and
                   FLOPs, i.e. the same as a GELU expert of ffn 3072 (default)
  moe125m_ffn3072  expert ffn 3072 SwiGLU (1.5x the expert parameters/FLOPs)
  moe_tiny         2 layers, hidden 64, 8 experts: CPU smoke tests only
"""

import copy
import os

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs


def _moe125m(moe_inter_dim: int) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        vocab_size=50304,  # 50257 GPT-2 BPE padded to a multiple of 128 (Megatron's default)
        max_seq_len=1024,
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        head_dim=64,
        qk_norm=False,
        hidden_dim=3072,  # dense FFN size; unused since every layer is MoE
        norm_eps=1e-5,
        rope_theta=10000,
        attn_type="sdpa",  # causal SDPA (flash) over the packed sequence
        attn_mask_type="causal",
        eos_id=50256,
        enable_weight_tying=True,
        moe_enabled=True,
        moe_inter_dim=moe_inter_dim,
        moe_args=MoEArgs(
            num_experts=64,
            num_shared_experts=0,
            top_k=1,
            score_func="softmax",
            route_norm=False,  # top-1 weight = softmax probability (MegaBlocks/Megatron style)
            route_scale=1.0,
            score_before_experts=False,
            use_grouped_mm=True,
            load_balance_coeff=1e-3,  # torchtitan's aux-loss-free expert-bias balancing
        ),
    )


FLAVORS = {
    "moe125m": _moe125m(2048),
    "moe125m_ffn3072": _moe125m(3072),
}
_tiny = copy.deepcopy(FLAVORS["moe125m"])
_tiny.dim, _tiny.n_layers, _tiny.n_heads, _tiny.n_kv_heads, _tiny.head_dim = 64, 2, 4, 4, 16
_tiny.moe_inter_dim = 128
_tiny.moe_args.num_experts = 8
FLAVORS["moe_tiny"] = _tiny

for _name, _args in FLAVORS.items():
    qwen3_args.setdefault(_name, _args)

# Tokenize each document once. The sample corpus (1000 documents, about 1.05M GPT-2 tokens)
# is re-looped every couple of steps; without a cache, GPT-2 BPE of 64-128k tokens per rank
# per step (~0.25 s on one core) runs in the data-loader worker and can become the limit
# at high tokens/s. Megatron-style trainers read pre-tokenized data, so caching keeps the
# comparison about the GPU work. TT_TOKEN_CACHE=0 turns it off.
if os.environ.get("TT_TOKEN_CACHE", "1") == "1":
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    _encode = HuggingFaceTokenizer.encode
    _cache: dict = {}

    def _cached_encode(self, *args, **kwargs):
        text = args[0] if args else kwargs.get("text", "")
        key = (id(self), text, kwargs.get("add_bos"), kwargs.get("add_eos"), len(args))
        ids = _cache.get(key)
        if ids is None:
            ids = _cache[key] = _encode(self, *args, **kwargs)
        return ids

    HuggingFaceTokenizer.encode = _cached_encode
