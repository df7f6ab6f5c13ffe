"""Convert a checkpoint between --ckpt-format torch (one Megatron model_optim_rng.pt) and
torch_dist (sharded, through torch.distributed.checkpoint), tensor for tensor.

    python tools/convert_checkpoint_format.py --load checkpoints --save converted \\
        --ckpt-format torch

Reads the iteration the tracker of --load names (checksums verified), and writes it under
--save (with its checksums and tracker) in the other format. One process, no GPU; it holds
the whole state in memory. Either format resumes at any parallel layout, so this is for
tools that read one format only (upstream Megatron-LM's reads model_optim_rng.pt).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from gpt_pretraining.checkpoint_format import FORMATS, convert
from megatron.errors import UserError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory to convert")
    parser.add_argument("--save", required=True, help="directory to write the converted one to")
    parser.add_argument(
        "--ckpt-format", required=True, choices=FORMATS, help="the format to convert to"
    )
    args = parser.parse_args(argv)
    try:
        written = convert(args.load, args.save, args.ckpt_format)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"converted to {args.ckpt_format}: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
