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

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder


class ExactBPEDetokenizer(BPEStreamingDetokenizer):
    """Byte-level BPE is lossless: keep every space, the first one included."""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text

    def finalize(self) -> None:
        self.text += self._decode_bytes(self._unflushed)
        self._unflushed = ""

    def _decode_bytes(self, seq: str) -> str:
        table = _byte_decoder()
        data = bytearray()
        for c in seq:
            byte = table.get(c)
            if byte is None:
                data.extend(c.encode("utf-8"))  # not a byte-level character (an added token's text)
            else:
                data.append(byte)
        return data.decode("utf-8", "replace")


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
    exact.reset()
    wrapper._detokenizer = exact
