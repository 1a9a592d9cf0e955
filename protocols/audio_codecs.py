"""Audio files in and out: containers and codecs through PyAV (FFmpeg's libraries), never by hand.

Theory of operation
-------------------
:func:`decode_audio` turns an uploaded file into mono float32 samples at the rate a model reads. It accepts
the containers clients send — WAV, FLAC, MP3, Ogg (Opus, Vorbis), MP4/M4A (AAC), WebM/Matroska, ADTS AAC —
found by probing the bytes (the file name is only a hint for the message), and refuses anything else with a
400 that says what is accepted. Three more checks make a bad upload a clear 400 rather than a transcript of
noise: an empty body, a stream that stops well before the duration its header declares (a truncated
upload), and audio longer than the limit (checked on the declared duration before decoding, and again
while decoding, so an over-long file is never decoded whole).

:class:`AudioEncoder` writes samples as a client asked for them (``mp3``, ``opus``, ``aac``, ``flac``,
``wav``, ``pcm``) in chunks: one container header, then samples as they come, so a streamed response is
one file, never several glued together. Resampling (to a rate the codec takes) is PyAV's too.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.errors import ApiError

# FFmpeg's demuxer names for the containers accepted (a demuxer may carry several names, "mov,mp4,m4a,…").
ACCEPTED_CONTAINERS = frozenset({"wav", "flac", "mp3", "ogg", "mov", "mp4", "m4a", "matroska", "webm", "aac"})
ACCEPTED_TEXT = "WAV, FLAC, MP3, OGG (Opus or Vorbis), M4A/MP4 (AAC), WebM/Matroska, or AAC (ADTS)"
# A file whose decoded audio falls this far short of its declared duration is truncated.
TRUNCATION_TOLERANCE_SECONDS = 0.25


def _invalid(message: str, code: str = "invalid_audio") -> ApiError:
    return ApiError("invalid_request", message, param="file", code=code)


def decode_audio(data: bytes, rate: int, max_seconds: float, filename: str = "") -> np.ndarray:
    """The file's audio as mono float32 samples at ``rate`` Hz (blocking: run it on a worker thread)."""
    import av

    label = f"'{filename}'" if filename else "The uploaded file"
    if not data:
        raise _invalid(f"{label} is empty; send an audio file ({ACCEPTED_TEXT}).")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError):
        raise _invalid(f"{label} is not an audio file this server can read; send {ACCEPTED_TEXT}.",
                       "unsupported_audio_format") from None
    with container:
        formats = set(container.format.name.split(","))
        streams = container.streams.audio
        if not formats & ACCEPTED_CONTAINERS or not streams:
            found = container.format.long_name or container.format.name
            raise _invalid(f"{label} is {found}{'' if streams else ' without an audio stream'}, which this server "
                           f"does not transcribe; send {ACCEPTED_TEXT}.", "unsupported_audio_format")
        stream = streams[0]
        declared = _wav_header_seconds(data) if "wav" in formats else _declared_seconds(container, stream)
        if declared is not None and declared > max_seconds:
            raise _too_long(label, declared, max_seconds)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks: list[np.ndarray] = []
        samples = 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    chunks.append(chunk)
                    samples += len(chunk)
                if samples > max_seconds * rate:
                    raise _too_long(label, samples / rate, max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
        except av.error.FFmpegError as exc:
            raise _invalid(f"{label} could not be decoded ({exc.strerror or type(exc).__name__}): it is damaged "
                           f"or truncated.") from None
    audio = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    seconds = len(audio) / rate
    if declared is not None and seconds < declared - TRUNCATION_TOLERANCE_SECONDS:
        raise _invalid(f"{label} is truncated: its header declares {declared:.2f} s of audio but it holds "
                       f"{seconds:.2f} s.", "truncated_audio")
    if not len(audio):
        raise _invalid(f"{label} holds no audio samples.")
    return audio


def _declared_seconds(container: Any, stream: Any) -> float | None:
    """The duration the file's header declares, if it declares one."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    return None


def _wav_header_seconds(data: bytes) -> float | None:
    """The duration a PCM WAV header declares (FFmpeg's demuxer reports what the file holds instead, which
    hides a truncated upload); None for WAV files the standard library cannot read (non-PCM codecs)."""
    import wave

    try:
        with wave.open(io.BytesIO(data)) as reader:
            return float(reader.getnframes()) / float(reader.getframerate())
    except (wave.Error, EOFError, ZeroDivisionError):
        return None


def _too_long(label: str, seconds: float, limit: float) -> ApiError:
    return _invalid(f"{label} is {seconds:.1f} s long; this server transcribes at most {limit:g} s per request. "
                    "Split the audio and send the parts.", "audio_too_long")


@dataclass(frozen=True)
class _Format:
    container: str | None  # None: raw samples, no container
    codec: str
    sample_format: str
    content_type: str
    rates: tuple[int, ...] = ()  # the rates the codec takes (empty: any)


FORMATS: dict[str, _Format] = {
    "mp3": _Format("mp3", "libmp3lame", "s16p", "audio/mpeg",
                   (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)),
    "opus": _Format("ogg", "libopus", "s16", "audio/ogg", (8000, 12000, 16000, 24000, 48000)),
    "aac": _Format("adts", "aac", "fltp", "audio/aac"),
    "flac": _Format("flac", "flac", "s16", "audio/flac"),
    "wav": _Format("wav", "pcm_s16le", "s16", "audio/wav"),
    # OpenAI's pcm: signed 16-bit little-endian mono at 24 kHz, whatever the model's rate.
    "pcm": _Format(None, "pcm_s16le", "s16", "audio/pcm", (24000,)),
}


def output_rate(fmt: str, rate: int) -> int:
    """The rate a clip of ``rate`` Hz is written at in ``fmt``: its own where the codec takes it, else the
    nearest rate above it the codec takes (else the highest)."""
    rates = FORMATS[fmt].rates
    if not rates or rate in rates:
        return rate
    return min(rates, key=lambda r: (r < rate, abs(r - rate)))


class AudioEncoder:
    """Mono float32 samples in, encoded bytes out, chunk by chunk: :meth:`encode` returns the bytes ready so
    far (the container header first), :meth:`finish` the rest. A streamed WAV's header declares an unknown
    length (what FFmpeg writes to a pipe), as OpenAI's streamed WAV does; ``pcm`` has no header at all."""

    def __init__(self, fmt: str, rate: int) -> None:
        import av

        spec = FORMATS[fmt]
        self.format = fmt
        self.input_rate = rate
        self.rate = output_rate(fmt, rate)
        self.content_type = spec.content_type
        self._resampler = av.AudioResampler(format=spec.sample_format, layout="mono", rate=self.rate)
        self._raw = spec.container is None
        self._buffer = io.BytesIO()
        self._sent = 0
        self._pts = 0
        if self._raw:
            return
        self._container = av.open(self._buffer, mode="w", format=spec.container)
        stream: Any = self._container.add_stream(spec.codec, rate=self.rate)
        stream.layout = "mono"
        stream.format = spec.sample_format
        self._stream = stream

    def encode(self, samples: np.ndarray) -> bytes:
        import av

        frame = av.AudioFrame.from_ndarray(np.clip(samples, -1, 1).astype(np.float32).reshape(1, -1), format="flt",
                                           layout="mono")
        frame.sample_rate = self.input_rate
        for out in self._resampler.resample(frame):
            self._write(out)
        return self._take()

    def finish(self) -> bytes:
        for out in self._resampler.resample(None):
            self._write(out)
        if not self._raw:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        return self._take()

    def whole_file(self) -> bytes:
        """After :meth:`finish`: the whole file, its header completed (a WAV's then declares its length)."""
        return bytes(self._buffer.getvalue())

    def _write(self, frame: Any) -> None:
        if self._raw:
            self._buffer.write(bytes(frame.planes[0])[: frame.samples * 2])
            return
        frame.pts = self._pts
        self._pts += frame.samples
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def _take(self) -> bytes:
        data = bytes(self._buffer.getvalue()[self._sent:])
        self._sent += len(data)
        return data


def encode_audio(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """A whole clip as one file."""
    encoder = AudioEncoder(fmt, rate)
    encoder.encode(samples)
    encoder.finish()
    return encoder.whole_file()


def content_type(fmt: str) -> str:
    return FORMATS[fmt].content_type


def chunks(samples: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(samples), size):
        yield samples[start:start + size]
