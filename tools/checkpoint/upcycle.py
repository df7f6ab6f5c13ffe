"""Grow a trained dense checkpoint into a dMoE checkpoint whose experts start as copies of each
layer's dense MLP (Megatron-Core's `--moe-use-upcycling` idea).

    python tools/checkpoint/upcycle.py --load-dir checkpoints/gpt2_125m \\
        --save-dir checkpoints/gpt2_125m_upcycled --moe-num-experts 8 --moe-top-k 2

How the copies and the router start, so that the upcycled model computes the dense model's
function at its first step: gpt_pretraining/upcycle.py, its library.
"""

import sys

from gpt_pretraining.upcycle import main

if __name__ == "__main__":
    sys.exit(main())
