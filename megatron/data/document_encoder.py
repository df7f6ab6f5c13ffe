"""Worker-side half of preprocessing: raw JSON lines in, token arrays out.

Each worker process builds its own tokenizer once (`init_worker`) and then turns a
`LineChunk` into an `EncodedChunk`: per JSON key, one flat token array plus the length of
every sequence and the number of sequences of every document. Lines that are not valid
(bad UTF-8, bad JSON, missing key, non-string value, a lone surrogate escape) come back as
`LineProblem`s with their file and line, and the main process decides whether to stop or skip.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from megatron.data.json_lines import LineChunk
from megatron.tokenizer.flags import TokenizerFlags


@dataclass(frozen=True)
class EncoderSettings:
    """What a worker needs to rebuild the tokenizer and apply the document options."""

    tokenizer: TokenizerFlags
    json_keys: Sequence[str]
    append_eod: bool
    split_sentences: bool
    keep_empty: bool
    token_dtype: str
    sentence_language: str = "english"


@dataclass
class LineProblem:
    """One input line that cannot be used, and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class EncodedKey:
    """The documents of one chunk for one JSON key."""

    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray


@dataclass
class EncodedChunk:
    """Result of encoding one chunk: per-key documents, problems, and input statistics."""

    keys: dict
    problems: List[LineProblem] = field(default_factory=list)
    input_bytes: int = 0
    documents_read: int = 0
    empty_documents: int = 0


_tokenizer = None
_tokenizer_flags: Optional[TokenizerFlags] = None
_sentence_splitter = None
_settings: Optional[EncoderSettings] = None


def shared_tokenizer(flags: TokenizerFlags):
    """This process's tokenizer of these flags, built on the first call. Built in the main
    process before the pool starts, it reaches forked workers ready to use."""
    global _tokenizer, _tokenizer_flags
    if _tokenizer is None or _tokenizer_flags != flags:
        # One process per core: the tokenizer's own thread pool would only contend.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from megatron.tokenizer import build_tokenizer_from_flags

        _tokenizer = build_tokenizer_from_flags(flags)
        _tokenizer_flags = flags
    return _tokenizer


def init_worker(settings: EncoderSettings) -> None:
    """Pool initializer: this process's tokenizer (and sentence splitter), built once."""
    global _sentence_splitter, _settings
    _settings = settings
    shared_tokenizer(settings.tokenizer)
    _sentence_splitter = (
        build_sentence_splitter(settings.sentence_language) if settings.split_sentences else None
    )


def build_sentence_splitter(language: str):
    """NLTK's Punkt splitter: the trained model when NLTK's data is installed, else Punkt's defaults."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError:
        raise RuntimeError("--split-sentences needs NLTK: pip install nltk") from None
    try:
        return nltk.tokenize.PunktTokenizer(language)
    except (LookupError, AttributeError, OSError, ValueError):
        # No punkt data on this machine (nothing is downloaded at run time): Punkt's
        # untrained parameters still split on sentence-final punctuation.
        return PunktSentenceTokenizer()


def _parse_line(raw_line: bytes, path: str, line_number: int, json_keys: Sequence[str]):
    """Return ({key: text}, None) for a usable line or (None, LineProblem)."""
    try:
        text_line = raw_line.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, LineProblem(
            path, line_number, f"invalid UTF-8 at byte {error.start} of the line"
        )
    try:
        record = json.loads(text_line)
    except json.JSONDecodeError as error:
        return None, LineProblem(
            path, line_number, f"malformed JSON: {error.msg} at column {error.colno}"
        )
    if not isinstance(record, dict):
        return None, LineProblem(
            path, line_number, f"expected a JSON object, found {type(record).__name__}"
        )
    texts = {}
    for key in json_keys:
        if key not in record:
            present = ", ".join(sorted(record)) or "none"
            return None, LineProblem(
                path,
                line_number,
                f"key '{key}' is missing (keys present: {present}; choose with --json-keys)",
            )
        value = record[key]
        if not isinstance(value, str):
            return None, LineProblem(
                path,
                line_number,
                f"the value of '{key}' is a JSON {_json_type(value)}, not a string",
            )
        surrogate_at = _lone_surrogate_position(value)
        if surrogate_at is not None:
            return None, LineProblem(
                path,
                line_number,
                f"the value of '{key}' holds a lone surrogate \\u{ord(value[surrogate_at]):04x} "
                f"at character {surrogate_at}, which is not valid Unicode text; "
                "fix or drop the line",
            )
        texts[key] = value
    return texts, None


def _lone_surrogate_position(value: str) -> Optional[int]:
    """Index of the first lone UTF-16 surrogate in `value` (JSON allows `\\ud800`), else None."""
    # No tokenizer can encode such a string. isascii() is O(1) and the strict UTF-8 encode is a
    # single C pass, far cheaper than a regex over every document.
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def _json_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def encode_chunk(chunk: LineChunk) -> EncodedChunk:
    """Tokenize every document of a chunk (runs in a worker process)."""
    settings = _settings
    assert settings is not None and _tokenizer is not None, "init_worker was not called"
    result = EncodedChunk(keys={}, input_bytes=chunk.byte_count)
    documents: List[dict] = []
    for offset, raw_line in enumerate(chunk.lines):
        if not raw_line.strip():
            continue
        texts, problem = _parse_line(
            raw_line, chunk.path, chunk.first_line + offset, settings.json_keys
        )
        if problem is not None:
            result.problems.append(problem)
            continue
        documents.append(texts)
    result.documents_read = len(documents)

    dtype = np.dtype(settings.token_dtype)
    for key in settings.json_keys:
        try:
            result.keys[key] = _encode_key(
                [document[key] for document in documents], settings, dtype, result
            )
        except ValueError as error:  # a text the tokenizer refuses (e.g. NullTokenizer's)
            last_line = chunk.first_line + len(chunk.lines) - 1
            raise ValueError(
                f"{chunk.path}, lines {chunk.first_line}-{last_line}, key '{key}': {error}"
            ) from None
    return result


def _encode_key(
    texts: List[str], settings: EncoderSettings, dtype: np.dtype, result: EncodedChunk
) -> EncodedKey:
    if _sentence_splitter is not None:
        sentences_of_document = [_sentence_splitter.tokenize(text) for text in texts]
    else:
        sentences_of_document = [[text] for text in texts]
    flat_sentences = [sentence for sentences in sentences_of_document for sentence in sentences]
    flat_ids = _tokenizer.tokenize_arrays(flat_sentences) if flat_sentences else []

    pieces: List[np.ndarray] = []
    sequence_lengths: List[int] = []
    sequences_per_document: List[int] = []
    eod = np.asarray([_tokenizer.eod], dtype)
    position = 0
    for sentences in sentences_of_document:
        document_ids = [ids for ids in flat_ids[position : position + len(sentences)] if ids.size]
        position += len(sentences)
        if document_ids:
            lengths = [ids.size for ids in document_ids]
            if settings.append_eod:
                document_ids.append(eod)  # ends the last sequence
                lengths[-1] += 1
        elif settings.keep_empty:
            # --keep-empty: the document stays, as one sequence (just EOD with --append-eod).
            document_ids = [eod] if settings.append_eod else []
            lengths = [len(document_ids)]
        else:
            result.empty_documents += 1
            continue
        pieces.extend(document_ids)
        sequence_lengths.extend(lengths)
        sequences_per_document.append(len(lengths))

    tokens = np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)
    return EncodedKey(
        tokens=tokens,
        sequence_lengths=np.asarray(sequence_lengths, dtype=np.int32),
        sequences_per_document=np.asarray(sequences_per_document, dtype=np.int32),
    )
