"""OpenAI audio transcriptions and translations (``POST /v1/audio/transcriptions``, ``/v1/audio/translations``).

Requests are ``multipart/form-data`` as the OpenAI SDK sends them: a ``file`` part and text fields ``model``,
``language``, ``prompt``, ``temperature``, ``response_format``, ``timestamp_granularities[]`` (repeated) and
``stream``. Unknown fields are tolerated, as everywhere in the OpenAI protocols.

Answers, by ``response_format``: ``json`` ``{"text"}``; ``text`` plain text; ``srt`` and ``vtt`` subtitles
rendered from the segments (numbered cues, ``HH:MM:SS,mmm`` / ``HH:MM:SS.mmm`` times); ``verbose_json`` with
``task``, ``language``, ``duration``, ``segments`` and, when asked for with ``timestamp_granularities[]``,
``words``. With ``stream=true`` (transcriptions only) the answer is SSE: ``transcript.text.delta`` events whose
``delta`` fields join to the text of the final ``transcript.text.done`` event.
"""

from __future__ import annotations

import math
from typing import Any, get_args

from protocols.errors import ApiError
from protocols.ir import Transcript, TranscriptFormat, TranscriptionRequest, TranscriptSegment

MULTIPART = "multipart/form-data"
AUDIO_UPLOAD_BYTES = 25 << 20  # OpenAI's audio API takes files up to 25 MB
TEXT_FIELD_BYTES = 1 << 20  # a text field (the prompt) larger than this is not a transcription option
MAX_FORM_PARTS = 256  # the form has a file and about ten fields; werkzeug's own default cap is 1,000
FEED_BYTES = 1 << 16
FORMATS: tuple[str, ...] = get_args(TranscriptFormat)


def parse_multipart(body: bytes, content_type: str) -> tuple[dict[str, list[str]], dict[str, tuple[str, bytes]]]:
    """The form's text fields (name → values, in order) and files (name → (filename, bytes)); a 400 for a body
    that is not a well-formed multipart form."""
    from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData
    from werkzeug.http import parse_options_header

    kind, options = parse_options_header(content_type)
    boundary = options.get("boundary", "")
    if kind.lower() != MULTIPART or not boundary:
        raise ApiError("invalid_request", f"Send the audio as {MULTIPART} with a boundary, as the OpenAI SDK does "
                       f"(got {content_type or 'no content type'!r}).")
    decoder = MultipartDecoder(boundary.encode("latin-1"))
    fields: dict[str, list[str]] = {}
    files: dict[str, tuple[str, bytes]] = {}
    current: Field | File | None = None
    parts: list[bytes] = []
    count = fed = 0
    try:
        while True:
            event = decoder.next_event()
            if isinstance(event, NeedData):
                if decoder.complete:
                    break
                # Fed a piece at a time: werkzeug drops what it has read from the front of its buffer, so the
                # whole body in one piece makes every part cost a copy of the rest (350,000 parts: 17 s).
                decoder.receive_data(body[fed:fed + FEED_BYTES] if fed < len(body) else None)
                fed += FEED_BYTES
            elif isinstance(event, (Field, File)):
                count += 1
                if count > MAX_FORM_PARTS:
                    raise ApiError("request_too_large", f"The form has more than {MAX_FORM_PARTS} parts; a "
                                   "transcription form has a 'file' part and a few text fields.")
                current, parts = event, []
            elif isinstance(event, Data):
                parts.append(event.data)
                if not event.more_data and current is not None:
                    data = b"".join(parts)
                    if isinstance(current, Field) and len(data) > TEXT_FIELD_BYTES:
                        raise ApiError("invalid_request", f"The form field {current.name!r} is {len(data)} bytes "
                                       f"long; text fields take at most {TEXT_FIELD_BYTES} bytes.")
                    if isinstance(current, File):
                        files.setdefault(current.name, (current.filename, data))
                    else:
                        fields.setdefault(current.name, []).append(data.decode("utf-8", "replace"))
                    current = None
            elif isinstance(event, Epilogue):
                break
    except ValueError:  # werkzeug's parse errors name its parser's state: say what that means for the body
        raise ApiError("invalid_request", _unreadable(decoder, boundary)) from None
    if not decoder.complete:
        raise ApiError("invalid_request", f"The multipart body ends before its closing boundary "
                       f"('--{boundary}--').")
    return fields, files


def _unreadable(decoder: Any, boundary: str) -> str:
    from werkzeug.sansio.multipart import State

    if decoder.state == State.PREAMBLE:
        return (f"The multipart body has no part that starts with the boundary its Content-Type names "
                f"('--{boundary}'); send the form as the OpenAI SDK or curl -F does.")
    if decoder.state == State.PART:  # werkzeug's one error there
        return "A part of the multipart body has no 'Content-Disposition: form-data; name=\"…\"' header."
    return f"The multipart body ends inside a part, before its closing boundary ('--{boundary}--')."


def _one(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    return values[-1] if values else None


def _float(fields: dict[str, list[str]], name: str, low: float, high: float) -> float | None:
    raw = _one(fields, name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise ApiError("invalid_request", f"'{name}' must be a number from {low:g} to {high:g} (got {raw!r}).",
                       param=name)
    return value


def _bool(fields: dict[str, list[str]], name: str) -> bool:
    raw = (_one(fields, name) or "false").strip().lower()
    if raw not in ("true", "false", "1", "0"):
        raise ApiError("invalid_request", f"'{name}' must be true or false (got {raw!r}).", param=name)
    return raw in ("true", "1")


def decode_transcription_request(body: bytes, content_type: str, request_id: str,
                                 task: str = "transcribe") -> TranscriptionRequest:
    """The request a transcriptions (``task="transcribe"``) or translations form asks for."""
    fields, files = parse_multipart(body, content_type)
    if "file" not in files:
        raise ApiError("invalid_request", "The form has no 'file' part: send the audio as the 'file' field.",
                       param="file")
    filename, audio = files["file"]
    model = _one(fields, "model")
    if not model:
        raise ApiError("invalid_request", "'model' is required: the id of a speech-to-text model on this server.",
                       param="model")
    response_format = _one(fields, "response_format") or "json"
    if response_format not in FORMATS:
        raise ApiError("invalid_request", f"'response_format' must be one of {', '.join(FORMATS)} (got "
                       f"{response_format!r}).", param="response_format")
    granularities = fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", [])
    unknown = [g for g in granularities if g not in ("word", "segment")]
    if unknown:
        raise ApiError("invalid_request", f"'timestamp_granularities[]' takes word and segment (got {unknown[0]!r}).",
                       param="timestamp_granularities[]")
    if granularities and response_format != "verbose_json":
        raise ApiError("invalid_request", "'timestamp_granularities[]' needs response_format = verbose_json.",
                       param="timestamp_granularities[]")
    stream = _bool(fields, "stream")
    if stream and task == "translate":
        raise ApiError("invalid_request", "Translations do not stream; leave 'stream' out.", param="stream")
    if stream and response_format in ("srt", "vtt", "verbose_json"):
        raise ApiError("invalid_request", f"response_format = {response_format} does not stream; stream with json "
                       "or text.", param="stream")
    language = (_one(fields, "language") or "").strip() or None
    if task == "translate" and language is not None:
        raise ApiError("invalid_request", "Translations take no 'language': the audio's language is detected and "
                       "the text is English.", param="language")
    return TranscriptionRequest(
        model=model, audio=audio, filename=filename, task="translate" if task == "translate" else "transcribe",
        language=language, prompt=_one(fields, "prompt") or None, temperature=_float(fields, "temperature", 0, 1),
        response_format=response_format,  # type: ignore[arg-type]  # checked against FORMATS above
        word_timestamps="word" in granularities, segment_timestamps="segment" in granularities,
        stream=stream, request_id=request_id)


# ---------------------------------------------------------------------------------------------------- answers
def timestamp(seconds: float, separator: str) -> str:
    """``HH:MM:SS,mmm`` (SRT) or ``HH:MM:SS.mmm`` (WebVTT)."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _cues(transcript: Transcript) -> list[tuple[float, float, str]]:
    """The segments with text as subtitle cues: (start, end, text), their times kept in order and within the
    audio (a model may emit a segment that ends before it starts, or past the end of the recording; a player
    must never see a cue go back in time)."""
    cues: list[tuple[float, float, str]] = []
    last = 0.0
    for segment in transcript.segments:
        text = segment.text.strip()
        if not text:
            continue
        start = min(max(segment.start, last), transcript.duration)
        end = min(max(segment.end, start), transcript.duration)
        cues.append((start, end, text))
        last = end
    return cues


def render_srt(transcript: Transcript) -> str:
    return "".join(f"{i}\n{timestamp(start, ',')} --> {timestamp(end, ',')}\n{text}\n\n"
                   for i, (start, end, text) in enumerate(_cues(transcript), start=1))


def render_vtt(transcript: Transcript) -> str:
    return "WEBVTT\n\n" + "".join(f"{timestamp(start, '.')} --> {timestamp(end, '.')}\n{text}\n\n"
                                   for start, end, text in _cues(transcript))


def _segment_json(segment: TranscriptSegment) -> dict[str, Any]:
    return {"id": segment.id, "seek": segment.seek, "start": segment.start, "end": segment.end,
            "text": segment.text, "tokens": list(segment.tokens), "temperature": segment.temperature,
            "avg_logprob": _finite(segment.avg_logprob), "compression_ratio": _finite(segment.compression_ratio),
            "no_speech_prob": _finite(segment.no_speech_prob)}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def verbose_json(transcript: Transcript) -> dict[str, Any]:
    request = transcript.request
    body: dict[str, Any] = {"task": request.task, "language": transcript.language,
                            "duration": round(transcript.duration, 3), "text": transcript.text,
                            "segments": [_segment_json(s) for s in transcript.segments]}
    if request.word_timestamps:
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                         for s in transcript.segments for w in s.words]
    return body


def encode_transcript(transcript: Transcript) -> tuple[bytes, str]:
    """The body and content type of a finished transcript in its request's ``response_format``."""
    fmt = transcript.request.response_format
    if fmt == "text":
        return (transcript.text + "\n").encode(), "text/plain; charset=utf-8"
    if fmt == "srt":
        return render_srt(transcript).encode(), "application/x-subrip; charset=utf-8"
    if fmt == "vtt":
        return render_vtt(transcript).encode(), "text/vtt; charset=utf-8"
    from protocols.sse import dumps

    body = verbose_json(transcript) if fmt == "verbose_json" else {"text": transcript.text}
    return dumps(body), "application/json"


def delta_event(text: str) -> dict[str, Any]:
    return {"type": "transcript.text.delta", "delta": text}


def done_event(transcript: Transcript) -> dict[str, Any]:
    return {"type": "transcript.text.done", "text": transcript.text}
