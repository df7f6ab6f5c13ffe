"""A SentencePiece model as Megatron-Core's SentencePieceTokenizer, GPTSentencePieceTokenizer and
Llama2Tokenizer all read it: one tokenizer under three names.

In Megatron-Core (megatron/core/tokenizers, Megatron-LM's tokenizer system since Megatron-Core
0.15) the three types build the same SentencePiece wrapper: a text's ids are the model's own
encoding, nothing is added per text (no BOS, not even for Llama2Tokenizer), the end-of-document
id is the model's end-of-sentence piece and the vocabulary is the model's pieces. Megatron-LM's
older tokenizer system (`--legacy-tokenizer`, removed in Megatron-Core 0.17) gave the names
other meanings: Llama2Tokenizer put BOS before every text, and SentencePieceTokenizer appended
<CLS> <SEP> <EOD> <MASK> (and <PAD> where the model had none) to the vocabulary with <EOD> as
the end of a document; those meanings are not this tokenizer's.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import sentencepiece

from megatron.tokenizer.base import TokenizerBase


class SentencePieceTokenizer(TokenizerBase):
    """Wraps a SentencePiece `.model`: no BOS/EOS added per text, `eod` is the model's EOS id,
    `bos` its BOS id and `pad` its pad id (-1 where the model has none)."""

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        piece_count = self._processor.get_piece_size()
        self._inv_vocab: Dict[int, str] = {
            index: self._processor.id_to_piece(index) for index in range(piece_count)
        }
        self._vocab: Dict[str, int] = {piece: index for index, piece in self._inv_vocab.items()}
        self._eod = self._processor.eos_id()
        self.bos = self._processor.bos_id()
        self.pad = self._processor.pad_id()
        if self._eod < 0:
            raise ValueError(
                f"SentencePiece model {model_file} has no end-of-sentence piece (eos_id=-1), so "
                "there is no id to mark document ends; retrain it with eos_id >= 0 "
                "(SentencePieceTrainer's default is eos_id=2)"
            )

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model, before padding."""
        return len(self._inv_vocab)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text."""
        return self._processor.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts; equal to tokenize() on each.

        Single-threaded on purpose: callers parallelise across documents with one process
        per core, and SentencePiece's own batch thread pool would oversubscribe the cores.
        """
        return self._processor.encode(list(texts), out_type=int, num_threads=1)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`."""
        return self._processor.decode(list(token_ids))
