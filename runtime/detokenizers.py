"""Streaming detokenizers whose text is exactly ``tokenizer.decode(tokens)``.

mlx-lm's streaming detokenizers promise that contract but break it at the start
of an answer (mlx-lm PR #1754, closed unmerged):

- the byte-level BPE one (Qwen, Llama 3, GPT-2 style vocabularies) drops a
  leading space, though ``Ġ`` is a real space there and ``decode`` keeps it;
- the byte-level one also turns a NUL byte (``Ā``) into ``Ā`` (its byte table
  lookup takes byte 0 for "missing");
- the SentencePiece one may drop two leading spaces where the tokenizer's own
  decoder drops one (its trim is keyed on "no text yet", which a trimmed lone
  ``▁`` leaves true).

Beyond fidelity this matters for the prefix cache: an agent sends the answer
back as text in its next turn, and only text that re-tokenizes to the ids the
model generated lets the cache reuse the answer's KV instead of prefilling it
again.
"""

from __future__ import annotations

import functools
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder


@functools.cache
def _byte_level_latin1() -> dict[int, str]:
    """A ``str.translate`` table that turns a piece's characters into its bytes spelled as Latin-1 characters:
    a byte-level character into the byte it stands for; any other character below U+0100 into its UTF-8 bytes
    (what an added token's text is made of). Characters past U+00FF that are not byte-level stay, and make the
    Latin-1 encoding fail."""
    table = {ord(c): chr(byte) for c, byte in _byte_decoder().items()}
    for code in range(256):
        table.setdefault(code, chr(code).encode("utf-8").decode("latin-1"))
    return table


class ExactBPEDetokenizer(BPEStreamingDetokenizer):
    """Byte-level BPE is lossless: keep every space, the first one included.

    And per token, a table look-up rather than a decode: each token's text, where its bytes are whole UTF-8 on
    their own, is worked out once per vocabulary (:meth:`prepare`). A token's text is then appended
    as it is; only a token that ends or continues a multi-byte character goes through the bytes. (The base
    class holds a lone space back one token, to trim it; an exact detokenizer trims nothing, so it does not.)
    """

    _texts: list[str | None]  # per token id: its text, or None when its bytes are not whole UTF-8 alone

    def prepare(self) -> None:
        """Build the per-token table (once per vocabulary, when the model loads: copies share it)."""
        texts: list[str | None] = []
        for piece in self.tokenmap:
            try:
                texts.append(self._bytes_of(piece).decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
        self._texts = texts

    @staticmethod
    def _bytes_of(piece: str) -> bytes:
        """A token's bytes: its byte-level characters decoded, any other character (an added token's text) as
        UTF-8. One ``translate`` for a piece of byte-level characters (a vocabulary's worth at load)."""
        try:
            return piece.translate(_byte_level_latin1()).encode("latin-1")
        except UnicodeEncodeError:  # a character past U+00FF that is not byte-level
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]  # (mlx-lm is untyped)
        self._held = b""  # bytes of a multi-byte character not complete yet

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        if token >= len(self._texts):
            self._add_bytes(b"!")  # mlx-lm's fallback for an id past the vocabulary (a padded embedding)
            return
        text = self._texts[token]
        if text is not None and not self._held:
            self.text += text
            return
        self._add_bytes(self._bytes_of(self.tokenmap[token]))

    def _add_bytes(self, data: bytes) -> None:
        held = self._held + data
        text = held.decode("utf-8", "replace")
        if text.endswith("\ufffd"):
            self._held = held  # for multi-byte UTF-8, wait until it is complete
        else:
            self.text += text
            self._held = b""

    def finalize(self) -> None:
        self.text += self._held.decode("utf-8", "replace")
        self._held = b""


class ExactSPMDetokenizer(SPMStreamingDetokenizer):
    """The SentencePiece decoder drops one leading space of the sequence, once."""

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]  # (mlx-lm is untyped)
        self._trim_pending = self.trim_space

    def _try_flush(self, force: bool = False) -> None:
        text = self._unflushed.replace(self._sep, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return  # a multi-byte character is not complete yet
        if self._trim_pending and text:
            self._trim_pending = False
            if text[0] == " ":
                text = text[1:]
        self.text += text
        self._unflushed = b""


_EXACT: dict[type[Any], type[Any]] = {BPEStreamingDetokenizer: ExactBPEDetokenizer, SPMStreamingDetokenizer: ExactSPMDetokenizer}


def use_exact_detokenizer(wrapper: Any) -> None:
    """Swap an mlx-lm ``TokenizerWrapper``'s streaming detokenizer for its exact counterpart (others stay)."""
    current = wrapper._detokenizer  # the wrapper copies this prototype for every sequence
    exact_type = _EXACT.get(type(current))
    if exact_type is None:
        return
    exact = object.__new__(exact_type)
    exact.__dict__.update(current.__dict__)  # its vocabulary's token map, built once at load
    if isinstance(exact, ExactBPEDetokenizer):
        exact.prepare()
    exact.reset()
    wrapper._detokenizer = exact
