"""The streaming detokenizers' text is exactly ``tokenizer.decode`` of their tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from runtime.detokenizers import ExactBPEDetokenizer, ExactSPMDetokenizer, use_exact_detokenizer


def streamed(wrapper: Any, ids: list[int]) -> str:
    detokenizer = wrapper.detokenizer
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return str(detokenizer.text)


def cases(wrapper: Any, texts: list[str], seed: int = 0) -> list[list[int]]:
    """Token sequences as a model may produce them: encoded texts, and random runs of ordinary tokens
    (byte-fallback tokens only inside encoded texts: alone they make invalid UTF-8, which decoders
    replace each in their own way)."""
    rng = random.Random(seed)
    special = set(wrapper.all_special_ids)
    pieces = wrapper.convert_ids_to_tokens(list(range(len(wrapper.get_vocab()))))
    ordinary = [i for i, p in enumerate(pieces) if i not in special and not p.startswith("<0x")]
    out = [wrapper.encode(t, add_special_tokens=False) for t in texts]
    out += [[rng.choice(ordinary) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    return out


def test_byte_level_bpe_keeps_a_leading_space(tiny_qwen3: Path) -> None:
    wrapper = load_tokenizer(tiny_qwen3)
    use_exact_detokenizer(wrapper)
    assert isinstance(wrapper._detokenizer, ExactBPEDetokenizer)
    ids = wrapper.encode(" the lamp", add_special_tokens=False)
    assert wrapper.decode(ids) == " the lamp"
    assert streamed(wrapper, ids) == " the lamp"
    for seq in cases(wrapper, [" leading", "  two spaces", "plain", " é ünïcode", "\n newline first",
                              "a crab 🦀 and 漢字 split across tokens", "nul \x00 byte"]):
        assert streamed(wrapper, seq) == wrapper.decode(seq), seq


def spm_tokenizer(directory: Path) -> Path:
    """A small SentencePiece-style tokenizer (Llama 2 / Mistral decoder chain), trained here."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    words = "the lamp the fog the supply boat leading spaces keep the log check the weather first".split()
    rng = random.Random(1)
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>",
                                                                                         *byte_tokens]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    return directory


def test_sentencepiece_drops_one_leading_space_once(tmp_path: Path) -> None:
    wrapper = load_tokenizer(spm_tokenizer(tmp_path))
    use_exact_detokenizer(wrapper)
    assert isinstance(wrapper._detokenizer, ExactSPMDetokenizer)
    lone, word, x = (wrapper.convert_tokens_to_ids(t) for t in ("▁", "▁leading", "▁the"))
    assert streamed(wrapper, [lone, word, x]) == wrapper.decode([lone, word, x]) == " leading the"
    for seq in cases(wrapper, ["the lamp", " leading", "ünïcode bytes"]):
        assert streamed(wrapper, seq) == wrapper.decode(seq), seq


@pytest.mark.parametrize("reuse", [False, True])
def test_a_reset_detokenizer_trims_again(tmp_path: Path, reuse: bool) -> None:
    """Every sequence gets a fresh copy: the first-token trim is per sequence, not per tokenizer."""
    wrapper = load_tokenizer(spm_tokenizer(tmp_path))
    use_exact_detokenizer(wrapper)
    ids = wrapper.encode("the lamp", add_special_tokens=False)
    first = streamed(wrapper, ids)
    if reuse:
        detokenizer = wrapper.detokenizer
        for token in ids:
            detokenizer.add_token(token)
        detokenizer.reset()
        for token in ids:
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text == first
    assert streamed(wrapper, ids) == first == wrapper.decode(ids)
