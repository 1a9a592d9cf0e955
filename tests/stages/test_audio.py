"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` through the real server, real mlx-audio and
the official OpenAI SDK, on a tiny random-weight multilingual Whisper built locally (runtime/tiny/audio.py),
with audio made locally (tests/audio_clips.py) in every accepted container."""

from __future__ import annotations

import io
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pytest

from flow.builtins import compile_tables
from protocols.audio_codecs import decode_audio
from runtime.tiny import ensure_tiny_model
from tests.audio_clips import CONTAINERS, encode_as, speech_like
from tests.harness import RunningServer, openai_error, running_server, tables_with_model

MAX_SECONDS = 150


@pytest.fixture(scope="module")
def tiny_whisper() -> Path:
    return ensure_tiny_model("tiny-whisper")


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tiny_whisper: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["whisper"] = {"type": "model", "path": str(tiny_whisper), "name": "whisper",
                                      "aliases": ["whisper-1"]}
    tables["stages"]["transcribe"]["max_seconds"] = MAX_SECONDS
    with running_server(compile_tables(tables, "audio test")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return speech_like(3.0)


@pytest.fixture(scope="module")
def wav(clip: np.ndarray) -> bytes:
    return encode_as(clip, 16000, "wav")


def direct(server: RunningServer, path: Path, samples: np.ndarray, **options: Any) -> Any:
    """mlx-audio's Whisper called directly (its own load, float32 on a CPU as the server loads it), with the
    options the server passes for a request: what the server must answer."""
    from runtime.audio import TranscribeOptions, to_float32

    def run() -> Any:
        import mlx.core as mx
        from mlx_audio.stt.utils import load_model

        model = load_model(str(path))
        if model.dtype == mx.float16 and not mx.metal.is_available():
            to_float32(model)
        opts = TranscribeOptions(**options)
        mx.random.seed(opts.seed)
        return model.generate(samples, **opts.generate_kwargs(model))

    return server.server.device.call(run)


def transcribe_raw(server: RunningServer, data: bytes, filename: str = "clip.wav", route: str = "transcriptions",
                   **fields: str) -> httpx.Response:
    return httpx.post(f"{server.url}/audio/{route}", files={"file": (filename, data)},
                      data={"model": "whisper", **fields}, timeout=120)


def test_transcription_equals_a_direct_mlx_audio_call(server: RunningServer, client: openai.OpenAI,
                                                      tiny_whisper: Path, clip: np.ndarray, wav: bytes) -> None:
    expected = direct(server, tiny_whisper, decode_audio(wav, 16000, 60), language="en")
    got = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), language="en")
    assert got.text == expected.text.strip() and got.text
    expected = direct(server, tiny_whisper, decode_audio(wav, 16000, 60), language="en", word_timestamps=True)
    verbose = client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", wav), language="en",
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["segment", "word"])
    assert verbose.text == expected.text.strip() and verbose.language == "en"
    assert verbose.duration == pytest.approx(len(clip) / 16000, abs=0.01)
    assert [s.text for s in verbose.segments or []] == [s["text"] for s in expected.segments]
    assert [(s.start, s.end) for s in verbose.segments or []] == [(s["start"], s["end"]) for s in expected.segments]
    words = [w for s in expected.segments for w in s.get("words", [])]
    assert [(w.word, w.start, w.end) for w in verbose.words or []] == [
        (w["word"].strip(), w["start"], w["end"]) for w in words]


def test_language_detection_and_translation_equal_direct_calls(server: RunningServer, client: openai.OpenAI,
                                                               tiny_whisper: Path, wav: bytes) -> None:
    samples = decode_audio(wav, 16000, 60)
    detected = direct(server, tiny_whisper, samples)
    got = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), response_format="verbose_json")
    assert (got.text, got.language) == (detected.text.strip(), detected.language)
    translated = direct(server, tiny_whisper, samples, task="translate", prompt="Glossary: flow")
    answer = client.audio.translations.create(model="whisper", file=("clip.wav", wav), prompt="Glossary: flow")
    assert answer.text == translated.text.strip()


TIME = r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d)"


def seconds(match: tuple[str, ...]) -> float:
    h, m, s, ms = (int(x) for x in match)
    return h * 3600 + m * 60 + s + ms / 1000


def check_cues(blocks: list[str], separator: str, numbered: bool) -> list[str]:
    """Each cue's text, after checking its structure: numbered 1..n (SRT), ``start --> end`` times with the
    format's separator, start ≤ end, and cues in time order."""
    texts, last_end = [], 0.0
    for i, block in enumerate(blocks, start=1):
        lines = block.split("\n")
        if numbered:
            assert lines.pop(0) == str(i)
        times = re.fullmatch(f"{TIME} --> {TIME}", lines[0])
        assert times is not None and separator in lines[0], lines[0]
        start, end = seconds(times.groups()[:4]), seconds(times.groups()[4:])
        assert last_end <= start <= end <= 3.0  # in order, within the 3-second clip
        last_end = end
        texts.append("\n".join(lines[1:]))
    return texts


def test_every_response_format_parses(client: openai.OpenAI, wav: bytes) -> None:
    verbose = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), language="en",
                                                 response_format="verbose_json")
    cues = [s.text.strip() for s in verbose.segments or [] if s.text.strip()]
    assert cues, "the tiny model's transcript has segments"
    text = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), language="en",
                                              response_format="text")
    assert isinstance(text, str) and text.strip() == verbose.text.strip()
    srt = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), language="en",
                                             response_format="srt")
    assert check_cues(srt.strip().split("\n\n"), ",", numbered=True) == cues
    vtt = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), language="en",
                                             response_format="vtt")
    header, *blocks = vtt.strip().split("\n\n")
    assert header == "WEBVTT"
    assert check_cues(blocks, ".", numbered=False) == cues


def test_streaming_deltas_join_to_the_final_text(server: RunningServer, client: openai.OpenAI,
                                                 tiny_whisper: Path) -> None:
    # Long enough for two 30-second windows: the first window's segments stream before the second decodes.
    audio = encode_as(speech_like(34.0, seed=2), 16000, "flac")
    whole = client.audio.transcriptions.create(model="whisper", file=("long.flac", audio), language="en")
    events = list(client.audio.transcriptions.create(model="whisper", file=("long.flac", audio), language="en",
                                                     stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and events[-1] is done[0]
    assert len(deltas) >= 2, "segments stream as the windows finish"
    assert "".join(deltas) == done[0].text == whole.text


@pytest.mark.parametrize("extension", sorted(CONTAINERS))
def test_every_accepted_container_decodes_and_transcribes(server: RunningServer, clip: np.ndarray,
                                                          extension: str) -> None:
    data = encode_as(clip, 16000, extension)
    response = transcribe_raw(server, data, f"clip.{extension}", response_format="verbose_json", language="en")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"] and body["duration"] == pytest.approx(3.0, abs=0.1)  # codecs pad a frame at most


def test_audio_at_other_rates_and_in_stereo_is_resampled(clip: np.ndarray) -> None:
    import av

    buffer = io.BytesIO()
    stereo = np.stack([clip, clip * 0.5])
    with av.open(buffer, mode="w", format="wav") as container:
        stream: av.AudioStream = container.add_stream("pcm_s16le", rate=44100)  # type: ignore[assignment]
        stream.layout = "stereo"
        resampler = av.AudioResampler(format="s16", layout="stereo", rate=44100)
        frame = av.AudioFrame.from_ndarray(stereo.astype(np.float32), format="fltp", layout="stereo")
        frame.sample_rate = 16000
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            container.mux(stream.encode(piece))
        container.mux(stream.encode(None))
    decoded = decode_audio(buffer.getvalue(), 16000, 60)
    assert len(decoded) == pytest.approx(len(clip), abs=200)
    expected = clip * 0.75  # the two channels' mean
    assert np.corrcoef(decoded[1000:-1000], expected[1000:-1000])[0, 1] > 0.99




def test_bad_uploads_are_400s_and_the_server_keeps_serving(server: RunningServer, client: openai.OpenAI,
                                                           clip: np.ndarray, wav: bytes) -> None:
    not_audio = openai_error(transcribe_raw(server, b"hello, this is a text file\n" * 50, "notes.txt"))
    assert "WAV, FLAC, MP3" in not_audio["message"] and not_audio["param"] == "file"
    empty = openai_error(transcribe_raw(server, b"", "empty.wav"))
    assert "empty" in empty["message"]
    for extension in ("wav", "flac", "mp3"):
        whole = wav if extension == "wav" else encode_as(clip, 16000, extension)
        truncated = openai_error(transcribe_raw(server, whole[: len(whole) // 2], f"cut.{extension}"))
        assert truncated["code"] in ("truncated_audio", "invalid_audio"), truncated
        assert "truncated" in truncated["message"]
    png = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
    unknown = openai_error(transcribe_raw(server, png, "picture.png"))
    assert unknown["code"] == "unsupported_audio_format"
    too_long = openai_error(transcribe_raw(server, encode_as(speech_like(MAX_SECONDS + 5.0), 16000, "mp3"),
                                           "long.mp3"))
    assert too_long["code"] == "audio_too_long" and f"at most {MAX_SECONDS} s" in too_long["message"]
    wrong_kind = openai_error(httpx.post(f"{server.url}/audio/transcriptions", files={"file": ("a.wav", wav)},
                                         data={"model": "tiny"}, timeout=60))
    assert wrong_kind["code"] == "wrong_model_kind" and "whisper" in wrong_kind["message"]
    chat_on_whisper = openai_error(httpx.post(f"{server.url}/chat/completions", json={
        "model": "whisper", "messages": [{"role": "user", "content": "hi"}]}, timeout=60))
    assert chat_on_whisper["code"] == "wrong_model_kind" and "tiny" in chat_on_whisper["message"]
    language = openai_error(transcribe_raw(server, wav, language="klingon"))
    assert language["param"] == "language"
    fmt = openai_error(transcribe_raw(server, wav, response_format="docx"))
    assert "json, text, srt, vtt, verbose_json" in fmt["message"]
    no_file = openai_error(httpx.post(f"{server.url}/audio/transcriptions", files={"other": ("a.wav", wav)},
                                      data={"model": "whisper"}, timeout=60))
    assert no_file["param"] == "file"
    as_json = openai_error(httpx.post(f"{server.url}/audio/transcriptions", json={"model": "whisper"}, timeout=60),
                           415)
    assert "multipart/form-data" in as_json["message"]
    multipart_elsewhere = openai_error(httpx.post(f"{server.url}/chat/completions", files={"file": ("a.wav", wav)},
                                                  timeout=60), 415)
    assert "must be JSON" in multipart_elsewhere["message"]
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), temperature=3)
    after = client.audio.transcriptions.create(model="whisper", file=("clip.wav", wav), language="en")
    assert after.text


def test_a_long_transcription_shares_the_device_with_chat_streams(server: RunningServer, client: openai.OpenAI) -> None:
    """While a two-minute recording transcribes (~3 s of device time alone), a chat stream goes on: its tokens
    arrive before the transcription ends, and the audio job gave the device back between passes."""
    audio = encode_as(speech_like(120.0, seed=3), 16000, "mp3")
    worker = next(m for m in server.server.models if m.name == "whisper").audio
    assert worker is not None
    yields_before = worker.worker.yields
    finished: list[str] = []

    def long_job() -> None:
        try:
            client.audio.transcriptions.create(model="whisper", file=("long.mp3", audio), language="en")
        except openai.APIError as exc:
            finished.append(repr(exc))
        finished.append("transcription")

    job = threading.Thread(target=long_job)
    job.start()
    while not worker.worker.has_work():
        job.join(0.005)  # wait until the audio job is on the device
        assert job.is_alive(), f"the transcription ended before the chat request was sent: {finished}"
    chunks = 0
    with client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                        max_tokens=24, stream=True, temperature=0) as stream:
        for chunk in stream:
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
    finished.append("chat")
    job.join(300)
    assert chunks > 0 and finished == ["chat", "transcription"]
    assert worker.worker.yields > yields_before


def test_a_client_that_leaves_a_whole_transcription_ends_it(server: RunningServer) -> None:
    """A client that closes its connection while a non-streamed transcription decodes (nothing sent to it yet):
    the server notices the disconnect and the job leaves the device at its next checkpoint."""
    worker = next(m for m in server.server.models if m.name == "whisper").audio
    assert worker is not None
    deadline = time.monotonic() + 60  # a job of an earlier test still on the device would be counted as this one's
    while worker.worker.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    cancelled, done = worker.worker.jobs_cancelled, worker.worker.jobs_done
    request = httpx.Request("POST", f"{server.url}/audio/transcriptions", data={"model": "whisper", "language": "en"},
                            files={"file": ("long.mp3", encode_as(speech_like(140.0, seed=4), 16000, "mp3"))})
    url = urlsplit(server.url)
    head = f"POST {url.path}/audio/transcriptions HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in request.headers.items()) + "\r\n"
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80)) as sock:
        sock.sendall(head.encode() + request.read())
        deadline = time.monotonic() + 60
        while not worker.worker.has_work() and time.monotonic() < deadline:
            time.sleep(0.005)  # the job is on the device
        time.sleep(0.2)
    deadline = time.monotonic() + 60
    while worker.worker.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (worker.worker.jobs_cancelled, worker.worker.jobs_done) == (cancelled + 1, done)


def test_a_client_that_leaves_ends_its_transcription(server: RunningServer) -> None:
    """A client that leaves a streamed transcription after its first words: the job leaves the device at its
    next checkpoint instead of decoding the rest of the recording."""
    worker = next(m for m in server.server.models if m.name == "whisper").audio
    assert worker is not None
    cancelled, done = worker.worker.jobs_cancelled, worker.worker.jobs_done
    audio = encode_as(speech_like(140.0, seed=4), 16000, "mp3")
    with httpx.stream("POST", f"{server.url}/audio/transcriptions", files={"file": ("long.mp3", audio)},
                      data={"model": "whisper", "language": "en", "stream": "true"}, timeout=120) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert "transcript.text.delta" in first  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 60
    while worker.worker.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (worker.worker.jobs_cancelled, worker.worker.jobs_done) == (cancelled + 1, done)
