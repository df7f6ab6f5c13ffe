"""Build torchtitan's local inputs offline.

  tokenizer/tokenizer.json        GPT-2 byte-level BPE built with `tokenizers`
                                  from gpt2-vocab.json + gpt2-merges.txt
  tokenizer/tokenizer_config.json bos/eos = <|endoftext|> (id 50256)
  data/owt.jsonl                  the OpenWebText sample, decompressed

usage: python prepare_assets.py GPT2_DIR OWT_JSONL_XZ OUT_DIR
"""

import json
import lzma
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE


def build_tokenizer(gpt2_dir: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    bpe = BPE.from_file(
        os.path.join(gpt2_dir, "gpt2-vocab.json"),
        os.path.join(gpt2_dir, "gpt2-merges.txt"),
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 1024,
            },
            f,
        )
    eot = tok.token_to_id("<|endoftext|>")
    ids = tok.encode("Hello world, this is GPT-2.").ids
    assert eot == 50256, eot
    assert ids == [15496, 995, 11, 428, 318, 402, 11571, 12, 17, 13], ids
    print(f"tokenizer: vocab {tok.get_vocab_size()}, <|endoftext|>={eot}, ok")


def unpack_data(xz_path: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "owt.jsonl")
    n = 0
    with lzma.open(xz_path, "rt", encoding="utf-8") as src, open(out, "w") as dst:
        for line in src:
            rec = json.loads(line)
            dst.write(json.dumps({"text": rec["text"]}) + "\n")
            n += 1
    print(f"data: {n} documents -> {out}")


if __name__ == "__main__":
    gpt2_dir, xz_path, out = sys.argv[1:4]
    build_tokenizer(gpt2_dir, os.path.join(out, "tokenizer"))
    unpack_data(xz_path, os.path.join(out, "data"))
