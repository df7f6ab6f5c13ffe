"""Grow a trained dense checkpoint into a dMoE checkpoint whose experts start as copies of each
layer's dense MLP (Megatron-Core's `--moe-use-upcycling` idea).

    python tools/checkpoint/upcycle.py --load-dir checkpoints/gpt2_125m \\
        --save-dir checkpoints/gpt2_125m_upcycled --moe-num-experts 8 --moe-top-k 2

Every MoE layer (all, or every --moe-layer-freq-th) gets E copies of the dense MLP: fc1 ->
w1 (and v1 for SwiGLU), fc2 -> w2, fc2's bias -> the layer's output bias. The router starts at
zero, so every token sees equal probabilities 1/E and the router's weights of its k experts
add up to a known s (k/E, or 1 when normalized); each copy's w2 is divided by s. The upcycled
model therefore computes the dense model's function exactly (to rounding) at its first step,
and the router learns to tell the copies apart from there. The result is a `release`
checkpoint of the weights, trained on with `pretrain_gpt.py --load DIR --finetune` and the
printed flags.
The library is gpt_pretraining.upcycle.
"""

import sys

from gpt_pretraining.upcycle import main

if __name__ == "__main__":
    sys.exit(main())
