"""OpenAI text to speech (``POST /v1/audio/speech``) and the voice listing (``GET /v1/audio/voices``).

The body is JSON: ``model``, ``input`` (at most 4,096 characters, as OpenAI's), ``voice`` (a name, or
``{"id": name}``), ``instructions``, ``speed`` (0.25 to 4), ``response_format`` (``mp3`` default, ``opus``,
``aac``, ``flac``, ``wav``, ``pcm``) and ``stream_format``: ``audio`` (default) answers the audio file itself,
chunked as it is synthesized — one container header, then samples; ``sse`` answers ``speech.audio.delta``
events (base64 pieces of that same file) and a final ``speech.audio.done`` with usage.

Long input is spoken sentence by sentence (:func:`sentences`), so the first audio leaves once the first
sentence is synthesized.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from protocols.errors import ApiError
from protocols.ir import SpeechDone, SpeechFormat, SpeechRequest
from protocols.validation import parse_json_body

MAX_INPUT_CHARS = 4096
MAX_PIECE_CHARS = 300  # a sentence longer than this is cut at a comma or a space
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
"""OpenAI's voice names: a model with one voice answers to each, so OpenAI clients work unchanged."""


class VoiceObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr


class SpeechBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are tolerated, as OpenAI-compatible servers do

    model: StrictStr
    input: StrictStr = Field(max_length=MAX_INPUT_CHARS)
    voice: StrictStr | VoiceObject
    instructions: StrictStr | None = Field(default=None, max_length=MAX_INPUT_CHARS)
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    response_format: SpeechFormat = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"


def decode_speech_request(body: bytes, request_id: str) -> SpeechRequest:
    parsed = parse_json_body(SpeechBody, body)
    if not parsed.input.strip():
        raise ApiError("invalid_request", "'input' is empty: send the text to speak.", param="input")
    voice = parsed.voice if isinstance(parsed.voice, str) else parsed.voice.id
    return SpeechRequest(model=parsed.model, input=parsed.input, voice=voice, instructions=parsed.instructions or None,
                         speed=parsed.speed, response_format=parsed.response_format,
                         stream_format=parsed.stream_format, request_id=request_id)


_SENTENCE_END = re.compile(r"(?<=[.!?…;:])[\"')\]]*\s+|\n\s*")


def sentences(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """``text`` in the pieces it is spoken in: sentences (at ``. ! ? … ; :`` and line breaks), each cut at its
    last comma or space before ``max_chars`` when longer."""
    pieces: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        rest = sentence.strip()
        while len(rest) > max_chars:
            head = rest[:max_chars]
            cut = max(head.rfind(", "), head.rfind("; "))
            cut = cut + 1 if cut > max_chars // 3 else head.rfind(" ")
            cut = cut if cut > 0 else max_chars
            pieces.append(rest[:cut].strip())
            rest = rest[cut:].strip()
        if rest:
            pieces.append(rest)
    return pieces


def delta_event(data: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}


def done_event(done: SpeechDone) -> dict[str, Any]:
    return {"type": "speech.audio.done", "usage": {"input_tokens": done.input_characters, "output_tokens": 0,
                                                   "total_tokens": done.input_characters}}


def voices_list(models: list[tuple[str, tuple[str, ...]]]) -> dict[str, Any]:
    """The voice listing: each text-to-speech model's voices."""
    return {"object": "list", "data": [{"id": voice, "object": "voice", "name": voice, "model": model}
                                       for model, voices in models for voice in voices]}
