"""Rebuilding a Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) from a GGUF vocabulary.

Theory of operation
-------------------

A GGUF carries no ``tokenizer.json``: llama.cpp stores the vocabulary as metadata (``tokenizer.ggml.*``)
and re-implements the tokenizer in C++. Two vocabulary kinds cover the models flow imports:

* ``gpt2`` — byte-level BPE (Llama 3, Qwen, SmolLM …). Tokens are spelled in GPT-2's byte alphabet and
  the merges are listed. What the file does not carry is how text is split before BPE: llama.cpp names
  it (``tokenizer.ggml.pre``) and keeps the regular expression in its source, so the known names map to
  the same expressions here.
* ``llama`` — SentencePiece (Llama 2, Mistral, Gemma …): ``▁`` for spaces, ``<0xNN>`` byte pieces and a
  score per piece, usually no merges. llama.cpp tokenizes it by merging, again and again, the adjacent
  pair whose joined piece scores highest; as BPE merges that is every split of a piece into two pieces,
  ranked by the piece's score (for SentencePiece BPE, the order the pieces were learned in).

Token types say which tokens are matched whole before any splitting: control tokens (``<|im_end|>``)
become special added tokens, user-defined ones (``<tool_call>``, Gemma's runs of newlines) plain added
tokens — as llama.cpp treats them.

This module knows nothing about files: :class:`GGUFVocab` holds what the importer read, and
:class:`VocabularyError` says what cannot be rebuilt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (gguf TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SENTENCEPIECE_SPACE = "\u2581"

# The split expressions of llama.cpp's pre-tokenizer names (llama-vocab.cpp), as the models'
# own tokenizer.json files write them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPLIT_BY_PRE: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# These split every digit off, then split as GPT-2 does.
DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact"})
# GPT-2's own expression (ByteLevel's built-in).
GPT2_PRE = frozenset({"default", "gpt-2", "gpt2"})
# llama.cpp takes a whole pre-token straight from the vocabulary when it has one (Llama 3's tokenizer.json
# says "ignore_merges": true).
IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})
# Qwen's tokenizers normalize to NFC before splitting.
NFC_PRE = frozenset({"qwen2", "deepseek-r1-qwen"})

# Token texts llama.cpp ends generation on besides the eos id (llama-vocab.cpp's end-of-generation list).
END_OF_GENERATION_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                     "<|endoftext|>", "<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>"})

SUPPORTED_VOCABULARIES = ("gpt2 (byte-level BPE)", "llama (SentencePiece)")


class VocabularyError(ValueError):
    """The GGUF's vocabulary cannot be rebuilt as a Hugging Face tokenizer; the message says why."""


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF says about its tokenizer (``tokenizer.ggml.*`` and ``tokenizer.chat_template*``)."""

    model: str  # tokenizer.ggml.model: "gpt2", "llama", …
    tokens: Sequence[str]
    types: Sequence[int]
    scores: Sequence[float] | None = None
    merges: Sequence[str] | None = None
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None

    def token(self, token_id: int | None) -> str | None:
        """The text of ``token_id``, None for no id (or one past the vocabulary)."""
        return self.tokens[token_id] if token_id is not None and 0 <= token_id < len(self.tokens) else None


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The ``tokenizers`` tokenizer the vocabulary describes."""
    if len(vocab.types) != len(vocab.tokens):
        raise VocabularyError(f"the vocabulary has {len(vocab.tokens)} tokens but {len(vocab.types)} token types")
    if vocab.model == "gpt2":
        tokenizer = _byte_level_tokenizer(vocab)
    elif vocab.model == "llama":
        tokenizer = _sentencepiece_tokenizer(vocab)
    else:
        raise VocabularyError(f"tokenizer model {vocab.model!r} cannot be rebuilt; flow rebuilds "
                              f"{' and '.join(SUPPORTED_VOCABULARIES)} vocabularies")
    _add_whole_tokens(tokenizer, vocab)
    return tokenizer


def end_of_generation_ids(vocab: GGUFVocab) -> list[int]:
    """The eos id, the end-of-turn/message ids, and the tokens llama.cpp ends generation on by their text."""
    ids = {i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None}
    ids.update(i for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types))
               if kind == CONTROL and text in END_OF_GENERATION_TEXTS)
    return sorted(ids)


def tokenizer_config(vocab: GGUFVocab, context_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, whether bos/eos are added, the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "bos_token": vocab.token(vocab.bos_id),
        "eos_token": vocab.token(vocab.eos_id),
        "unk_token": vocab.token(vocab.unk_id),
        "pad_token": vocab.token(vocab.pad_id),
        "chat_template": vocab.chat_template,
    }
    return {key: value for key, value in config.items() if value is not None}


def write_tokenizer_files(vocab: GGUFVocab, out: Path, context_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` into ``out``."""
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    config = tokenizer_config(vocab, context_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")


# ------------------------------------------------------------------ byte-level BPE (gpt2)

def _byte_level_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    if not vocab.merges:
        raise VocabularyError("the byte-level BPE vocabulary lists no merges (tokenizer.ggml.merges)")
    merges = [_merge_pair(m) for m in vocab.merges]
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False,
                                     ignore_merges=vocab.pre in IGNORE_MERGES_PRE))
    if vocab.pre in NFC_PRE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _with_bos(processors.ByteLevel(trim_offsets=False), vocab)
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    left, space, right = merge.partition(" ")
    if not space:
        raise VocabularyError(f"merge {merge!r} is not two tokens separated by a space")
    return left, right


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in SPLIT_BY_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT_BY_PRE[pre]), "isolated"), byte_level_only])
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    known = sorted({*SPLIT_BY_PRE, *DIGITS_THEN_GPT2, *GPT2_PRE})
    raise VocabularyError(f"byte-level BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one flow knows; "
                          f"known: {', '.join(known)}")


# ------------------------------------------------------------------ SentencePiece (llama)

def _sentencepiece_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    pieces = _sentencepiece_spelling(vocab)
    unk = vocab.token(vocab.unk_id)
    if vocab.merges:
        merges = [_merge_pair(m) for m in vocab.merges]
    else:
        merges = _merges_by_score(pieces, vocab.types, _require_scores(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=_piece_ids(pieces), merges=merges, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
    if vocab.add_space_prefix:
        # SentencePiece adds its dummy prefix once, at the start of the text, not after each added token.
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(SENTENCEPIECE_SPACE, prepend_scheme="first", split=False)
    else:
        tokenizer.normalizer = normalizers.Replace(" ", SENTENCEPIECE_SPACE)
    steps: list[decoders.Decoder] = [decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    post = _with_bos(None, vocab)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


def _sentencepiece_spelling(vocab: GGUFVocab) -> list[str]:
    """Pieces as SentencePiece spells them: some converters wrote runs of spaces (Gemma's user-defined
    whitespace tokens) with real spaces, which the normalizer never leaves in the text."""
    return [token if kind == CONTROL else token.replace(" ", SENTENCEPIECE_SPACE)
            for token, kind in zip(vocab.tokens, vocab.types)]


def _piece_ids(pieces: Sequence[str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        ids.setdefault(piece, i)  # a repeated piece keeps its first id, as SentencePiece does
    return ids


def _require_scores(vocab: GGUFVocab) -> Sequence[float]:
    if vocab.scores is None or len(vocab.scores) != len(vocab.tokens):
        raise VocabularyError("the SentencePiece vocabulary has neither merges nor a score for every token "
                              "(tokenizer.ggml.scores)")
    return vocab.scores


def _merges_by_score(pieces: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a mergeable piece into two pieces of the vocabulary, ranked as
    SentencePiece applies them: user-defined pieces (matched whole: runs of spaces or newlines) first,
    the longest first; then by the joined piece's score, best first (for SentencePiece BPE, the order
    the pieces were learned in), ties by id. Within one piece the longer left part goes first."""
    mergeable = {piece: i for i, (piece, kind) in enumerate(zip(pieces, types)) if kind in (NORMAL, USER_DEFINED)}
    ranked: list[tuple[tuple[int, float, int, int], str, str]] = []
    for piece, piece_id in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                rank = ((0, -len(left), piece_id, 0) if types[piece_id] == USER_DEFINED
                        else (1, -scores[piece_id], piece_id, -len(left)))
                ranked.append((rank, left, right))
    ranked.sort(key=lambda entry: entry[0])
    return [(left, right) for _, left, right in ranked]


# ------------------------------------------------------------------ shared

def _with_bos(base: processors.PostProcessor | None, vocab: GGUFVocab) -> processors.PostProcessor | None:
    """``base``, followed by a bos token in front when the vocabulary says to add one."""
    bos = vocab.token(vocab.bos_id)
    if not vocab.add_bos or bos is None or vocab.bos_id is None:
        return base
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                             special_tokens=[(bos, vocab.bos_id)])
    return template if base is None else processors.Sequence([base, template])


def _add_whole_tokens(tokenizer: Tokenizer, vocab: GGUFVocab) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens: both are matched
    whole in the text before it is split, as llama.cpp does."""
    pieces = _sentencepiece_spelling(vocab) if vocab.model == "llama" else list(vocab.tokens)
    special = [AddedToken(p, special=True, normalized=False)
               for p, kind in zip(pieces, vocab.types) if kind == CONTROL]
    plain = [AddedToken(p, special=False, normalized=False)
             for p, kind in zip(pieces, vocab.types) if kind == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
