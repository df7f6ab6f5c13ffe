"""Convert a checkpoint between --ckpt-format torch (one Megatron model_optim_rng.pt) and
torch_dist (sharded, through torch.distributed.checkpoint), tensor for tensor.

    python tools/convert_checkpoint_format.py --load checkpoints --save converted \\
        --ckpt-format torch

Reads the iteration the tracker of --load names (checksums verified), and writes it under
--save (with its checksums and tracker) in the other format. One process, no GPU; it holds
the whole state in memory. Either format resumes at any parallel layout, so this is for
tools that read one format only (upstream Megatron-LM's reads model_optim_rng.pt). The library
is gpt_pretraining.checkpoint_format.
"""

import sys

from gpt_pretraining.checkpoint_format import main

if __name__ == "__main__":
    sys.exit(main())
