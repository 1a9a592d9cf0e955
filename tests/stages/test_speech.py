"""``POST /v1/audio/speech`` and ``GET /v1/audio/voices`` through the real server, real mlx-audio and the official
OpenAI SDK, on a tiny random-weight Soprano (mlx-audio's text-to-speech architecture) built locally."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from flow.builtins import compile_tables
from protocols.openai_speech import sentences
from runtime.tiny import ensure_tiny_model
from tests.harness import RunningServer, openai_error, running_server, tables_with_model

TOKENS_PER_SENTENCE = 12  # each of the tiny model's sentences: 12 × 2,048 samples at 32 kHz (0.77 s)
TEXT = "The river runs to the sea. It is grey today, and slow. Nobody knows where it began!"


@pytest.fixture(scope="module")
def tiny_soprano() -> Path:
    return ensure_tiny_model("tiny-soprano")


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tiny_soprano: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["speaker"] = {"type": "model", "path": str(tiny_soprano), "name": "speaker",
                                      "aliases": ["tts-1"], "speech_max_tokens": TOKENS_PER_SENTENCE}
    tables["resources"]["whisper"] = {"type": "model", "path": str(ensure_tiny_model("tiny-whisper")),
                                      "name": "whisper", "load": "lazy"}
    with running_server(compile_tables(tables, "speech test")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(server: RunningServer, tiny_soprano: Path) -> np.ndarray:
    """mlx-audio's Soprano called directly (its own load), sentence by sentence as the server splits the text,
    with the options the server passes: the samples the server must send."""
    from runtime.audio import SpeechOptions

    def run() -> np.ndarray:
        import mlx.core as mx
        from mlx_audio.tts.utils import load_model

        model = load_model(tiny_soprano)
        options = SpeechOptions(max_tokens=TOKENS_PER_SENTENCE)
        mx.random.seed(options.seed)
        parts = [np.array(r.audio, dtype=np.float32) for piece in sentences(TEXT)
                 for r in model.generate(piece, **options.generate_kwargs(model))]
        return np.concatenate(parts)

    return server.server.device.call(run)


def decoded(data: bytes, fmt: str | None = None) -> tuple[np.ndarray, int]:
    """A file's samples (mono float32) and sample rate, read by PyAV as a client's player would: knowing the
    format it asked for (``fmt``), as a player knows it from the content type. (FFmpeg 8 no longer recognizes a
    headerless AAC stream of a few hundred bytes by probing it.)"""
    import av

    with av.open(io.BytesIO(data), format="aac" if fmt == "aac" else None) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().astype(np.float32).reshape(f.samples, -1).mean(axis=1) if f.format.is_packed
                  else f.to_ndarray().astype(np.float32).mean(axis=0) for f in container.decode(stream)]
        scale = 32768.0 if stream.format.name.startswith("s16") else 1.0
        return np.concatenate(frames) / scale, stream.rate


def test_wav_and_flac_carry_exactly_the_models_samples(client: openai.OpenAI, expected: np.ndarray) -> None:
    assert len(expected) == len(sentences(TEXT)) * TOKENS_PER_SENTENCE * 2048  # the tiny model never stops early
    for fmt in ("wav", "flac"):
        audio = client.audio.speech.create(model="speaker", voice="alloy", input=TEXT, response_format=fmt).read()
        samples, rate = decoded(audio)
        assert rate == 32000 and len(samples) == len(expected)
        quantized = np.round(np.clip(expected, -1, 1) * 32767) / 32768  # 16-bit files
        assert np.abs(samples - quantized).max() < 2 / 32768, fmt


@pytest.mark.parametrize("fmt,rate", [("mp3", 32000), ("opus", 48000), ("aac", 32000), ("pcm", 24000)])
def test_every_format_decodes_at_its_rate_and_length(client: openai.OpenAI, expected: np.ndarray, fmt: str,
                                                     rate: int) -> None:
    audio = client.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format=fmt).read()
    seconds = len(expected) / 32000
    if fmt == "pcm":  # OpenAI's pcm: 16-bit little-endian mono at 24 kHz, no header
        assert not audio.startswith((b"RIFF", b"ID3", b"OggS", b"fLaC"))
        assert len(audio) == pytest.approx(2 * seconds * rate, abs=4)
        return
    samples, got_rate = decoded(audio, fmt)
    assert got_rate == rate
    assert len(samples) / rate == pytest.approx(seconds, abs=0.08)  # codecs pad a frame or two


def test_streamed_wav_and_pcm_are_one_header_then_samples(server: RunningServer, expected: np.ndarray) -> None:
    body = {"model": "speaker", "voice": "alloy", "input": TEXT}
    for fmt in ("wav", "pcm"):
        with httpx.stream("POST", f"{server.url}/audio/speech", json={**body, "response_format": fmt},
                          timeout=120) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == {"wav": "audio/wav", "pcm": "audio/pcm"}[fmt]
            pieces = list(response.iter_raw())
        data = b"".join(pieces)
        assert data.count(b"RIFF") == data.count(b"WAVE") == (1 if fmt == "wav" else 0)
        rate = 32000 if fmt == "wav" else 24000
        header = data.index(b"data") + 8 if fmt == "wav" else 0
        assert len(data) - header == pytest.approx(2 * len(expected) * rate / 32000, abs=4)


def test_first_audio_leaves_before_the_whole_input_is_spoken(server: RunningServer) -> None:
    worker = next(m for m in server.server.models if m.name == "speaker").audio
    assert worker is not None
    long_text = " ".join(f"Sentence number {i} is here, spoken on its own." for i in range(12))
    with httpx.stream("POST", f"{server.url}/audio/speech", timeout=120,
                      json={"model": "speaker", "voice": "alloy", "input": long_text, "response_format": "pcm"}
                      ) as response:
        pieces = response.iter_raw()
        first = next(pieces)
        still_speaking = worker.worker.has_work()
        rest = b"".join(pieces)
    assert first and still_speaking, "the first sentence's audio came before the last sentences were spoken"
    assert len(first) + len(rest) == 2 * 12 * TOKENS_PER_SENTENCE * 2048 * 24000 // 32000


def test_sse_stream_carries_the_same_file(server: RunningServer, client: openai.OpenAI) -> None:
    whole = client.audio.speech.create(model="speaker", voice="alloy", input=TEXT, response_format="mp3").read()
    with httpx.stream("POST", f"{server.url}/audio/speech", timeout=120, json={
            "model": "speaker", "voice": "alloy", "input": TEXT, "response_format": "mp3",
            "stream_format": "sse"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == len(TEXT)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole


def test_voices_are_listed(server: RunningServer) -> None:
    listing = httpx.get(f"{server.url}/audio/voices", timeout=60).json()
    voices = {(v["model"], v["id"]) for v in listing["data"]}
    assert ("speaker", "default") in voices and ("speaker", "alloy") in voices
    assert {m for m, _ in voices} == {"speaker"}  # the Whisper model speaks no voices
    models = httpx.get(f"{server.url}/models", timeout=60).json()["data"]
    speaker = next(m for m in models if m["id"] == "speaker")
    assert speaker["kind"] == "audio" and speaker["capabilities"] == ["tts"] and "alloy" in speaker["voices"]




def test_bad_speech_requests_are_400s_and_the_server_keeps_serving(server: RunningServer,
                                                                   client: openai.OpenAI) -> None:
    def speak(**body: Any) -> httpx.Response:
        return httpx.post(f"{server.url}/audio/speech", timeout=120,
                          json={"model": "speaker", "voice": "alloy", "input": "Hello there.", **body})

    voice = openai_error(speak(voice="nobody"))
    assert voice["code"] == "unknown_voice" and "alloy" in voice["message"]
    assert openai_error(speak(speed=2.0))["param"] == "speed"  # Soprano speaks at one speed
    assert openai_error(speak(speed=9.0))["param"] == "speed"
    assert openai_error(speak(instructions="whisper it"))["param"] == "instructions"
    assert openai_error(speak(input="a" * 4097))["param"] == "input"
    assert openai_error(speak(input="   "))["param"] == "input"
    assert openai_error(speak(response_format="ogg"))["param"] == "response_format"
    wrong_kind = openai_error(speak(model="whisper"))
    assert wrong_kind["code"] == "wrong_model_kind" and "Models that can: speaker" in wrong_kind["message"]
    chat_model = openai_error(speak(model="tiny"))
    assert chat_model["code"] == "wrong_model_kind"
    # only the models that speak are named: the Whisper model is an audio model too, but cannot
    assert chat_model["message"].endswith("cannot serve this text-to-speech request. Models that can: speaker, tts-1.")
    upload = httpx.post(f"{server.url}/audio/transcriptions", files={"file": ("a.wav", b"RIFF")},
                        data={"model": "speaker"}, timeout=60)
    assert "cannot transcribe speech. Models that can: whisper" in openai_error(upload)["message"]
    after = client.audio.speech.create(model="speaker", voice="alloy", input="Still here.", response_format="wav")
    assert after.read().startswith(b"RIFF")
