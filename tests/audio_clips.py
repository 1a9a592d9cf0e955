"""Audio for the audio tests, made locally: a pure-Python speech-like signal (voiced "syllables": a pitch
contour with formant-like harmonics and pauses) encoded by PyAV into every container a client may send, and
real synthetic speech from espeak-ng where it is installed."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from protocols.audio_codecs import decode_audio, encode_audio

# The containers a client may upload: extension → (PyAV container, codec, sample format).
CONTAINERS: dict[str, tuple[str, str, str]] = {
    "wav": ("wav", "pcm_s16le", "s16"),
    "flac": ("flac", "flac", "s16"),
    "mp3": ("mp3", "libmp3lame", "s16p"),
    "ogg": ("ogg", "libopus", "s16"),
    "m4a": ("ipod", "aac", "fltp"),
    "webm": ("webm", "libopus", "s16"),
}


def speech_like(seconds: float, rate: int = 16000, seed: int = 1) -> np.ndarray:
    """Voiced syllables with pauses: enough structure that a model's encoder sees something speech-shaped."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = (np.sin(2 * np.pi * 3.1 * t) > -0.2).astype(np.float64)
    signal = voice * syllables * (0.6 + 0.4 * np.sin(2 * np.pi * 0.23 * t)) + 0.01 * rng.standard_normal(len(t))
    return (0.3 * signal / np.max(np.abs(signal))).astype(np.float32)


def encode_as(samples: np.ndarray, rate: int, extension: str) -> bytes:
    """``samples`` as a file of the given container (PyAV)."""
    import io

    import av

    container_name, codec, sample_format = CONTAINERS[extension]
    if extension in ("wav", "flac", "mp3"):
        return encode_audio(samples, rate, {"wav": "wav", "flac": "flac", "mp3": "mp3"}[extension])
    out_rate = 48000 if codec == "libopus" else rate
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_name) as container:
        stream: av.AudioStream = container.add_stream(codec, rate=out_rate)  # type: ignore[assignment]
        stream.layout = "mono"
        resampler = av.AudioResampler(format=sample_format, layout="mono", rate=out_rate)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = rate
        pts = 0
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            piece.pts = pts
            pts += piece.samples
            container.mux(stream.encode(piece))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def espeak(sentence: str, rate: int = 16000) -> np.ndarray | None:
    """``sentence`` spoken by espeak-ng, at ``rate`` Hz; None where espeak-ng is not installed."""
    binary = shutil.which("espeak-ng")
    if binary is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run([binary, "-v", "en-us", "-s", "150", "-w", str(wav), sentence], check=True,
                       capture_output=True)
        return decode_audio(wav.read_bytes(), rate, 600.0)
