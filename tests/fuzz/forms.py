"""What the fuzzer uploads: multipart forms for the speech-to-text routes.

``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` take ``multipart/form-data``, not JSON, so
their cases are built here rather than from a request model: a form of parts (:class:`Part`) rendered with a
boundary (:func:`form`), whose ``file`` is an audio file, good or broken (:func:`audio_files`), and whose text
fields are valid or odd (:func:`field_changes`); and forms that are not well-formed (:func:`structure_cases`:
a boundary that does not match, no closing boundary, bare LF line ends, parts without a name, a form past the
server's body cap).

Each case says what its answer must be, as the JSON cases do: ``accept`` for a well-formed form with a
readable audio file and valid fields, ``reject`` where the server must refuse (no file, no or an unknown
model, a chat model, a format or field value outside what the route takes, options that do not go together),
``any`` where either is fine (a damaged WAV header that a decoder may still read). The judge is the JSON
routes' judge: no 5xx, 4xx in the OpenAI error shape, streams that end with ``transcript.text.done``, the
process alive and serving afterwards.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from protocols.openai_audio import FORMATS, TEXT_FIELD_BYTES
from tests.fuzz.strategies import TARGET, Case, Expect, Request

ROUTES = {"transcriptions": "/v1/audio/transcriptions", "translations": "/v1/audio/translations"}
BOUNDARY = "fuzzform7MA4YWxk"


@dataclass(frozen=True)
class Part:
    """One part of a form: ``name=None`` writes no Content-Disposition at all."""

    name: str | None
    value: bytes
    filename: str | None = None
    content_type: str | None = None
    extra_headers: tuple[bytes, ...] = ()


def form(parts: tuple[Part, ...], boundary: str = BOUNDARY, newline: bytes = b"\r\n", close: bool = True,
         preamble: bytes = b"", epilogue: bytes = b"") -> bytes:
    """The parts as a multipart body (RFC 7578), written by hand so that every way of getting it wrong is open."""
    dash = b"--" + boundary.encode("latin-1")
    out = [preamble]
    for part in parts:
        out += [dash, newline]
        if part.name is not None:
            disposition = f'form-data; name="{part.name}"'
            if part.filename is not None:
                disposition += f'; filename="{part.filename}"'
            out += [b"Content-Disposition: ", disposition.encode("utf-8", "surrogateescape"), newline]
        if part.content_type:
            out += [b"Content-Type: ", part.content_type.encode("latin-1"), newline]
        for header in part.extra_headers:
            out += [header, newline]
        out += [newline, part.value, newline]
    if close:
        out += [dash, b"--", newline, epilogue]
    return b"".join(out)


# --------------------------------------------------------------------------- audio files


def wav(samples: np.ndarray, rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1,
        data_size: int | None = None, riff_size: int | None = None, block_align: int | None = None) -> bytes:
    """A WAV file; every header field can be set to a value that does not match the samples."""
    if tag == 3:
        data = samples.astype("<f4").tobytes()
    elif bits == 8:
        data = (np.clip(samples, -1, 1) * 127 + 128).astype(np.uint8).tobytes()
    elif bits == 24:
        ints = (np.clip(samples, -1, 1) * (2**23 - 1)).astype("<i4").tobytes()
        data = b"".join(ints[i:i + 3] for i in range(0, len(ints), 4))
    else:
        data = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    align = block_align if block_align is not None else max(1, channels * bits // 8)
    fmt = struct.pack("<HHIIHH", tag, channels, rate, (rate * align) & 0xFFFFFFFF, align & 0xFFFF, bits)
    size = len(data) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + data
    riff = len(body) if riff_size is None else riff_size
    return b"RIFF" + struct.pack("<I", riff) + body


def tone(seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.repeat(mono, channels) if channels > 1 else mono


def encoded(container: str, codec: str, rate: int = 16000, seconds: float = 0.4) -> bytes:
    """A short tone in another container, written by PyAV (FFmpeg), as a client's recorder would."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"  # type: ignore[union-attr]
        samples = tone(seconds, rate)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):  # type: ignore[union-attr]
            out.mux(packet)
        for packet in stream.encode(None):  # type: ignore[union-attr]
            out.mux(packet)
    return buffer.getvalue()


@cache
def audio_files() -> tuple[tuple[str, str, bytes, Expect], ...]:
    """(label, filename, bytes, expectation): files a server must transcribe, must refuse, or may do either."""
    short = tone(0.4)
    good: list[tuple[str, str, bytes, Expect]] = [
        ("wav 16 kHz 16-bit", "clip.wav", wav(short), "accept"),
        ("wav 8 kHz stereo", "clip.wav", wav(tone(0.4, 8000, 2), 8000, channels=2), "accept"),
        ("wav 44.1 kHz float", "clip.wav", wav(tone(0.3, 44100), 44100, bits=32, tag=3), "accept"),
        ("wav 8-bit", "clip.wav", wav(short, bits=8), "accept"),
        ("wav 24-bit", "clip.wav", wav(short, bits=24), "accept"),
        ("wav of silence", "quiet.wav", wav(np.zeros(8000, np.float32)), "accept"),
        ("wav of 10 samples", "tick.wav", wav(short[:10]), "accept"),
        ("wav named .mp3", "clip.mp3", wav(short), "accept"),
        ("wav without a name", "", wav(short), "accept"),
    ]
    for label, container, codec in (("flac", "flac", "flac"), ("mp3", "mp3", "libmp3lame"),
                                    ("ogg opus", "ogg", "libopus"), ("ogg vorbis", "ogg", "libvorbis")):
        try:
            data = encoded(container, codec, 48000 if codec == "libopus" else 16000)
        except Exception:  # noqa: BLE001 - an FFmpeg build without this encoder: fuzz the others
            continue
        good.append((label, f"clip.{container}", data, "accept"))
    pcm = wav(short)
    damaged: list[tuple[str, str, bytes, Expect]] = [
        ("empty file", "clip.wav", b"", "reject"),
        ("text", "notes.txt", b"hello, this is not audio\n" * 20, "reject"),
        ("png header", "pic.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "reject"),
        ("json", "clip.wav", b'{"audio": "none"}', "reject"),
        ("random bytes", "clip.wav", np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "any"),
        ("riff header only", "clip.wav", pcm[:12], "any"),
        ("wav header only", "clip.wav", pcm[:44], "any"),
        ("wav cut in half", "clip.wav", pcm[:len(pcm) // 2], "any"),
        ("wav cut mid-sample", "clip.wav", pcm[:45], "any"),
        ("wav data size 2^32-1", "clip.wav", wav(short, data_size=0xFFFFFFFF), "any"),
        ("wav riff size 2^32-1", "clip.wav", wav(short, riff_size=0xFFFFFFFF), "any"),
        ("wav riff size 0", "clip.wav", wav(short, riff_size=0), "any"),
        ("wav 0 channels", "clip.wav", wav(short, channels=0, block_align=2), "any"),
        ("wav 65535 channels", "clip.wav", wav(short, channels=65535), "any"),
        ("wav rate 0", "clip.wav", wav(short, rate=0), "any"),
        ("wav rate 1 Hz", "clip.wav", wav(short[:12], rate=1), "any"),
        ("wav rate 2^32-1", "clip.wav", wav(short, rate=0xFFFFFFFF), "any"),
        ("wav 0 bits", "clip.wav", wav(short, bits=0, block_align=2), "any"),
        ("wav 7 bits", "clip.wav", wav(short, bits=7), "any"),
        ("wav block align 0", "clip.wav", wav(short, block_align=0), "any"),
        ("wav format tag 0x55 (mp3)", "clip.wav", wav(short, tag=0x55), "any"),
        ("wav format tag 0xFFFE", "clip.wav", wav(short, tag=0xFFFE), "any"),
        ("wav format tag 0", "clip.wav", wav(short, tag=0), "any"),
        ("RIFX (big-endian) wav", "clip.wav", b"RIFX" + pcm[4:], "any"),
        ("wav without fmt", "clip.wav", pcm[:12] + pcm[36:], "any"),
        ("ID3 then junk", "clip.mp3", b"ID3\x04\x00\x00\x00\x00\x00\x10" + b"\xff\xfb" * 500, "any"),
        ("OggS then junk", "clip.ogg", b"OggS" + b"\x00" * 2000, "any"),
        ("fLaC then junk", "clip.flac", b"fLaC" + b"\x00\x00\x00\x22" + b"\x01" * 500, "any"),
        ("ftyp then junk", "clip.m4a", b"\x00\x00\x00\x18ftypM4A " + b"\x00" * 800, "any"),
    ]
    for label, _, data, _ in good[:1]:
        damaged.append((f"{label}, last byte gone", "clip.wav", data[:-1], "any"))
    return tuple(good + damaged)


# --------------------------------------------------------------------------- text fields


def valid_fields(draw: Any, endpoint: str) -> dict[str, list[bytes]]:
    """Text fields a server must accept (values as bytes, a list: a field may repeat)."""
    fields: dict[str, list[bytes]] = {"model": [draw(st.sampled_from(TARGET.listeners)).encode()]}
    response_format = draw(st.sampled_from([None, *FORMATS]))
    if response_format:
        fields["response_format"] = [response_format.encode()]
    if endpoint == "transcriptions" and draw(st.booleans()):
        fields["language"] = [draw(st.sampled_from([b"en", b"de", b"fr", b" en "]))]
    if draw(st.booleans()):
        fields["prompt"] = [draw(st.sampled_from([b"Glossary: flow", b"", "caf\u00e9 \u2603".encode()]))]
    if draw(st.booleans()):
        fields["temperature"] = [draw(st.sampled_from([b"0", b"0.2", b"1", b""]))]
    if response_format == "verbose_json" and draw(st.booleans()):
        fields["timestamp_granularities[]"] = draw(st.sampled_from([[b"word"], [b"segment"], [b"word", b"segment"]]))
    if endpoint == "transcriptions" and response_format in (None, "json", "text") and draw(st.booleans()):
        fields["stream"] = [draw(st.sampled_from([b"true", b"false", b"1", b"0", b" TRUE "]))]
    return fields


# (field, value, expectation): one field set to it (None: the field left out)
ODD_FIELDS: list[tuple[str, bytes | None, Expect]] = [
    ("model", None, "reject"), ("model", b"", "reject"), ("model", b"nope", "reject"),
    ("model", b"\xff\xfe", "reject"), ("model", b"\x00", "reject"), ("model", b"a" * 5000, "reject"),
    ("response_format", b"xml", "reject"), ("response_format", b"JSON", "reject"), ("response_format", b" ", "reject"),
    ("temperature", b"NaN", "reject"), ("temperature", b"-1", "reject"), ("temperature", b"2", "reject"),
    ("temperature", b"1e999", "reject"), ("temperature", b"abc", "reject"), ("temperature", b"0x1", "reject"),
    ("temperature", b"inf", "reject"), ("temperature", b"1_0", "reject"), ("temperature", b"\xff", "reject"),
    ("stream", b"yes", "reject"), ("stream", b"2", "reject"), ("stream", b"\x00", "reject"),
    ("timestamp_granularities[]", b"char", "reject"), ("timestamp_granularities", b"word", "any"),
    ("language", b"xx", "any"), ("language", b"english", "any"), ("language", b"EN", "any"),
    ("language", b"\x00", "any"), ("language", b"e" * 10_000, "any"), ("language", b"\xed\xa0\x80", "any"),
    ("prompt", b"\xed\xa0\x80 lone surrogate", "any"), ("prompt", b"word " * 20_000, "any"),
    ("prompt", b"x" * (TEXT_FIELD_BYTES + 1), "reject"), ("prompt", b"<|endoftext|><|startoftranscript|>", "any"),
    ("x_fuzz", b"unknown field", "accept"), ("file", b"a text field named file", "any"),
]


@st.composite
def field_changes(draw: Any, endpoint: str, fields: dict[str, list[bytes]]) -> tuple[dict[str, list[bytes]], str,
                                                                                         Expect]:
    """The fields with one thing changed: an odd value, a model of another kind, options that do not mix."""
    combos: list[tuple[dict[str, list[bytes] | None], str, Expect]] = [
        ({"model": [TARGET.models[0].encode()]}, "model: a chat model", "reject"),
        ({"model": [TARGET.embedder.encode()]}, "model: an embedding model", "reject"),
        ({"model": [b"nope", TARGET.listeners[0].encode()]}, "model: twice, the last valid", "accept"),
        ({"response_format": [b"json"], "timestamp_granularities[]": [b"word"]},
         "timestamp_granularities[] without verbose_json", "reject"),
        ({"response_format": [b"srt"], "stream": [b"true"]}, "stream with srt", "reject"),
    ]
    if endpoint == "translations":
        combos += [({"stream": [b"true"]}, "stream on translations", "reject"),
                   ({"language": [b"en"]}, "language on translations", "reject")]
    if draw(st.booleans()):
        change, label, expect = draw(st.sampled_from(combos))
    else:
        key, value, expect = draw(st.sampled_from(ODD_FIELDS))
        change = {key: None if value is None else [value]}
        label = f"{key}: {'left out' if value is None else ascii(value[:24])}"
    out = dict(fields)
    for key, values in change.items():
        if values is None:
            out.pop(key, None)
        else:
            out[key] = values
    if expect == "accept" and not _compatible(endpoint, out):
        expect = "any"
    return out, label, expect


def _compatible(endpoint: str, fields: dict[str, list[bytes]]) -> bool:
    """Whether fields that each pass together make a request the route takes (stream and the formats)."""
    streaming = (fields.get("stream") or [b"false"])[-1].strip().lower() in (b"true", b"1")
    response_format = (fields.get("response_format") or [b"json"])[-1]
    if streaming and (endpoint == "translations" or response_format not in (b"json", b"text")):
        return False
    return not (fields.get("timestamp_granularities[]") and response_format != b"verbose_json")


def text_parts(fields: dict[str, list[bytes]]) -> tuple[Part, ...]:
    return tuple(Part(name, value) for name, values in fields.items() for value in values)


# --------------------------------------------------------------------------- cases


def _case(endpoint: str, body: bytes, labels: tuple[str, ...], expect: Expect,
          content_type: str = f"multipart/form-data; boundary={BOUNDARY}",
          headers: tuple[tuple[str, str], ...] = ()) -> Case:
    path = ROUTES[endpoint]
    request = Request("POST", path, body, (("content-type", content_type), *headers) if content_type else headers)
    return Case(endpoint="transcriptions", route=f"POST {path}", request=request, expect=expect, labels=labels,
                shape="openai", grammar="transcription")


def _combine(*expects: Expect) -> Expect:
    if "reject" in expects:
        return "reject"
    return "accept" if all(e == "accept" for e in expects) else "any"


@st.composite
def upload_cases(draw: Any) -> Case:
    """A well-formed form: an audio file (good or broken) and text fields (valid, or with one thing changed)."""
    endpoint = draw(st.sampled_from(["transcriptions", "transcriptions", "translations"]))
    label, filename, audio, file_expect = draw(st.sampled_from(audio_files()))
    fields = valid_fields(draw, endpoint)
    labels = [f"file: {label}"]
    fields_expect: Expect = "accept"
    if draw(st.sampled_from([False, True, True])):
        fields, change, fields_expect = draw(field_changes(endpoint, fields))
        labels.append(change)
    file_part = Part("file", audio, filename, draw(st.sampled_from([None, "audio/wav", "application/octet-stream"])))
    parts = (file_part, *text_parts(fields)) if draw(st.booleans()) else (*text_parts(fields), file_part)
    return _case(endpoint, form(parts), tuple(labels), _combine(file_expect, fields_expect))


@cache
def malformed_forms(model: str) -> tuple[tuple[str, bytes, str, Expect], ...]:
    """(label, body, content type, expectation): forms that are not well-formed, or not forms."""
    parts = (Part("file", wav(tone(0.3)), "clip.wav", "audio/wav"), Part("model", model.encode()))
    plain = f"multipart/form-data; boundary={BOUNDARY}"
    return (
        ("the body's boundary is not the header's", form(parts, boundary="other"), plain, "reject"),
        ("no closing boundary", form(parts, close=False), plain, "reject"),
        ("cut mid-file", form(parts)[:200], plain, "reject"),
        ("empty body", b"", plain, "reject"),
        ("no boundary in the content type", form(parts), "multipart/form-data", "reject"),
        ("content type json", form(parts), "application/json", "reject"),
        ("content type form-urlencoded", b"model=whisper&file=abc", "application/x-www-form-urlencoded", "reject"),
        ("no content type", form(parts), "", "reject"),
        ("quoted boundary", form(parts), f'multipart/form-data; boundary="{BOUNDARY}"', "accept"),
        ("upper-case media type", form(parts), f"Multipart/Form-Data; boundary={BOUNDARY}", "accept"),
        ("bare LF line ends", form(parts, newline=b"\n"), plain, "any"),
        ("preamble and epilogue", form(parts, preamble=b"ignore me\r\n", epilogue=b"and me"), plain, "accept"),
        ("boundary of 200 characters", form(parts, boundary="b" * 200), "multipart/form-data; boundary=" + "b" * 200,
         "any"),
        ("boundary with spaces and quotes", form(parts, boundary='a b"c'), 'multipart/form-data; boundary="a b\\"c"',
         "any"),
        ("no parts", form(()), plain, "reject"),
        ("only the file", form(parts[:1]), plain, "reject"),
        ("only the model", form(parts[1:]), plain, "reject"),
        ("the file without a filename", form((replace(parts[0], filename=None), *parts[1:])), plain, "reject"),
        ("the file named 'audio'", form((replace(parts[0], name="audio"), *parts[1:])), plain, "reject"),
        ("the file twice", form((parts[0], *parts)), plain, "accept"),
        ("the model as a file", form((parts[0], Part("model", b"whisper", "model.txt"))), plain, "reject"),
        ("a part without headers", form((Part(None, b"stray"), *parts)), plain, "any"),
        ("a part without Content-Disposition", form((Part(None, b"stray", content_type="text/plain"), *parts)),
         plain, "reject"),
        ("a 100 KB part header", form((replace(parts[0], extra_headers=(b"X-Pad: " + b"p" * 100_000,)), *parts[1:])),
         plain, "any"),
        ("a part header without a colon", form((replace(parts[0], extra_headers=(b"garbage",)), *parts[1:])),
         plain, "any"),
        ("1,000 unknown fields", form((*parts, *(Part(f"x{i}", b"1") for i in range(1000)))), plain, "any"),
        ("a filename with a path and a NUL", form((replace(parts[0], filename="../../etc/x\x00.wav"), *parts[1:])),
         plain, "any"),
        ("a file past the body cap", form((replace(parts[0], value=wav(tone(70.0))), *parts[1:])), plain, "reject"),
        ("a nested multipart file", form((replace(parts[0], content_type=f"multipart/mixed; boundary={BOUNDARY}"),
                                          *parts[1:])), plain, "any"),
    )


@st.composite
def structure_cases(draw: Any) -> Case:
    """A malformed form (:func:`malformed_forms`) sent to either route, now and then with an odd header."""
    endpoint = draw(st.sampled_from(["transcriptions", "translations"]))
    label, body, content_type, expect = draw(st.sampled_from(malformed_forms(TARGET.listeners[0])))
    extra: tuple[tuple[str, str], ...] = ()
    if draw(st.sampled_from([False, False, False, True])):
        extra = (draw(st.sampled_from([("content-encoding", "gzip"), ("expect", "100-continue")])),)
        label += f"; header {extra[0][0]}: {extra[0][1]}"
        expect = "any" if expect == "accept" else expect
    return _case(endpoint, body, (label,), expect, content_type, extra)


def transcription_cases() -> SearchStrategy[Case]:
    return st.one_of(upload_cases(), upload_cases(), structure_cases())


def transcription_regressions() -> list[Case]:
    """Fixed cases CI always runs: a valid upload to each route, each audio file once, each malformed form once."""
    out: list[Case] = []
    for endpoint in ROUTES:
        parts = (Part("file", wav(tone(0.3)), "clip.wav", "audio/wav"), Part("model", TARGET.listeners[0].encode()))
        out.append(_case(endpoint, form(parts), (), "accept"))
    for label, filename, audio, expect in audio_files():
        parts = (Part("file", audio, filename), Part("model", TARGET.listeners[0].encode()))
        out.append(_case("transcriptions", form(parts), (f"file: {label}",), expect))
    for label, body, content_type, expect in malformed_forms(TARGET.listeners[0]):
        out.append(_case("transcriptions", body, (label,), expect, content_type))
    return out
