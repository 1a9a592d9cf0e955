"""Concurrent ``POST /v1/audio/speech`` requests sharing passes (mlx-audio's continuous batching) through the real
server, real mlx-audio and the official OpenAI SDK, on a tiny random-weight Qwen3-TTS built locally
(runtime/tiny/audio.py). Its sampling is greedy (its generation_config.json), so a request's speech is the same
alone, in a batch, and from mlx-audio's own ``generate``."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from flow.builtins import compile_tables
from protocols.openai_speech import sentences
from runtime.tiny import ensure_tiny_model
from runtime.tiny.audio import QWEN3_TTS_FRAME_SAMPLES
from tests.stages.test_speech import decoded
from tests.harness import RunningServer, running_server, tables_with_model

TOKENS = 10  # each sentence: 10 codec frames (random weights never pick the end token first)
RATE = 24000
REQUESTS = [("ryan", "The river runs to the sea. It is grey today."),
            ("vivian", "Nobody knows where it began! Maybe in the hills, maybe not."),
            ("aiden", "A short one."),
            ("ryan", "Three sentences here. Each is spoken in turn. Then it ends.")]


@pytest.fixture(scope="module")
def tiny_qwen3_tts() -> Path:
    return ensure_tiny_model("tiny-qwen3-tts")


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tiny_qwen3_tts: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["speaker"] = {"type": "model", "path": str(tiny_qwen3_tts), "name": "speaker",
                                      "speech_max_tokens": TOKENS}
    with running_server(compile_tables(tables, "speech batch test")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def worker_stats(server: RunningServer) -> dict[str, Any]:
    return httpx.get(server.base_url + "/stats", timeout=30).json()["models"]["speaker"]["worker"]  # type: ignore[no-any-return]


def wav_samples(data: bytes) -> np.ndarray:
    samples, rate = decoded(data)
    assert rate == RATE
    return samples


def all_at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads released together; their results in order (a failure is re-raised)."""
    results: list[Any] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def speak(client: openai.OpenAI, voice: str, text: str, fmt: Any = "wav") -> bytes:
    return client.audio.speech.create(model="speaker", voice=voice, input=text, response_format=fmt).read()


def test_concurrent_requests_share_passes_and_each_equals_its_speech_alone(
        server: RunningServer, client: openai.OpenAI, tiny_qwen3_tts: Path) -> None:
    alone = [wav_samples(speak(client, voice, text)) for voice, text in REQUESTS]
    before = worker_stats(server)
    together = all_at_once([partial(speak, client, voice, text) for voice, text in REQUESTS])
    after = worker_stats(server)
    assert after["shared_passes"] > before["shared_passes"] and after["most_requests_in_a_pass"] >= 2
    for (voice, text), data, expected in zip(REQUESTS, together, alone):
        samples = wav_samples(data)
        assert len(samples) == len(sentences(text)) * TOKENS * QWEN3_TTS_FRAME_SAMPLES
        assert np.array_equal(samples, expected), text  # greedy: batching changes nothing
    assert not np.array_equal(alone[0][:160], alone[3][:160])  # different texts, different speech

    def direct() -> list[np.ndarray]:  # mlx-audio's own generate on its own load, sentence by sentence
        from mlx_audio.tts.utils import load_model

        model = load_model(tiny_qwen3_tts)
        return [np.concatenate([np.array(r.audio, dtype=np.float32) for piece in sentences(text)
                                for r in model.generate(piece, voice=voice, max_tokens=TOKENS)])
                for voice, text in REQUESTS]

    for served, expected in zip(alone, server.server.device.call(direct)):
        quantized = np.round(np.clip(expected, -1, 1) * 32767) / 32768  # a 16-bit file
        assert np.abs(served - quantized).max() <= 2 / 32768  # its codec decodes the frames in other chunks


def test_batched_speech_decodes_in_every_format_and_stream(server: RunningServer, client: openai.OpenAI) -> None:
    text = REQUESTS[3][1]
    seconds = len(sentences(text)) * TOKENS * QWEN3_TTS_FRAME_SAMPLES / RATE

    def sse() -> bytes:
        with httpx.stream("POST", f"{server.url}/audio/speech", timeout=120, json={
                "model": "speaker", "voice": "vivian", "input": text, "response_format": "flac",
                "stream_format": "sse"}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done"
        return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")

    def streamed_pcm() -> bytes:
        with httpx.stream("POST", f"{server.url}/audio/speech", timeout=120, json={
                "model": "speaker", "voice": "aiden", "input": text, "response_format": "pcm"}) as response:
            assert response.headers["content-type"] == "audio/pcm"
            return b"".join(response.iter_raw())

    formats = {"mp3": RATE, "opus": 48000, "aac": RATE, "flac": RATE}
    results = all_at_once([*(partial(speak, client, "ryan", text, fmt) for fmt in formats), sse, streamed_pcm])
    for (fmt, rate), data in zip(formats.items(), results):
        samples, got_rate = decoded(data, fmt)
        assert got_rate == rate, fmt
        assert seconds <= len(samples) / rate <= seconds + 0.1, fmt  # lossy codecs pad a frame or two
    flac, rate = decoded(results[-2])
    assert rate == RATE and len(flac) == len(sentences(text)) * TOKENS * QWEN3_TTS_FRAME_SAMPLES
    assert len(results[-1]) == 2 * len(flac)  # OpenAI's pcm: 16-bit mono at 24 kHz, the model's own rate


def test_a_client_that_leaves_cancels_its_sequence_and_the_others_are_intact(
        server: RunningServer, client: openai.OpenAI) -> None:
    alone = [wav_samples(speak(client, voice, text)) for voice, text in REQUESTS[:2]]
    long_text = " ".join(f"Sentence number {i} is here." for i in range(200))
    before = worker_stats(server)
    left = threading.Event()

    def leave() -> None:
        with httpx.stream("POST", f"{server.url}/audio/speech", timeout=120, json={
                "model": "speaker", "voice": "aiden", "input": long_text, "response_format": "pcm"}) as response:
            next(response.iter_raw())  # its first sentence came, then it hangs up
        left.set()

    def stay(voice: str, text: str) -> tuple[np.ndarray, np.ndarray]:
        beside = wav_samples(speak(client, voice, text))
        left.wait(60)
        return beside, wav_samples(speak(client, voice, text))  # and after it left, again

    _, *stayed = all_at_once([leave, *(partial(stay, voice, text) for voice, text in REQUESTS[:2])])
    for (beside, after), expected in zip(stayed, alone):
        assert np.array_equal(beside, expected) and np.array_equal(after, expected)
    batcher = next(m for m in server.server.models if m.name == "speaker").audio.batcher  # type: ignore[union-attr]
    assert batcher is not None
    for _ in range(600):  # the batch ends once no request is left in it (a long request left to run: minutes)
        if batcher.idle:
            break
        threading.Event().wait(0.1)
    stats = worker_stats(server)
    assert batcher.idle and stats["shared_passes"] > before["shared_passes"]
    # The long request left after its first sentence: far fewer passes than its 200 sentences would take.
    assert stats["batch_passes"] - before["batch_passes"] < 200 * TOKENS // 4


def test_a_request_whose_sentence_fails_in_a_shared_pass_fails_alone(
        server: RunningServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    audio = next(m for m in server.server.models if m.name == "speaker").audio
    assert audio is not None
    prepare = audio.model._prepare_generation_inputs  # mlx-audio's prompt for one sentence, in every prefill

    def failing(text: str, *args: Any, **kwargs: Any) -> Any:
        if "Poison" in text:
            raise ValueError("this sentence cannot be spoken")
        return prepare(text, *args, **kwargs)

    monkeypatch.setattr(audio.model, "_prepare_generation_inputs", failing)
    alone = [wav_samples(speak(client, voice, text)) for voice, text in REQUESTS[:2]]
    before = worker_stats(server)

    def poisoned() -> httpx.Response:
        return httpx.post(f"{server.url}/audio/speech", timeout=120, json={
            "model": "speaker", "voice": "aiden", "input": "Poison in the first sentence. Then more.",
            "response_format": "wav"})

    failed, *others = all_at_once([poisoned, *(partial(speak, client, voice, text) for voice, text in REQUESTS[:2])])
    assert failed.status_code == 500 and "cannot be spoken" not in failed.text  # no internals leak
    for data, expected in zip(others, alone):
        assert np.array_equal(wav_samples(data), expected)  # the others' speech, whole and unchanged
    assert worker_stats(server)["shared_passes"] > before["shared_passes"]
    assert wav_samples(speak(client, "ryan", REQUESTS[0][1])).size == alone[0].size  # still serving


def test_the_speakers_are_its_voices(server: RunningServer) -> None:
    listing = httpx.get(f"{server.url}/audio/voices", timeout=60).json()
    assert {v["id"] for v in listing["data"] if v["model"] == "speaker"} == {"aiden", "ryan", "vivian"}
    unknown = httpx.post(f"{server.url}/audio/speech", timeout=60,
                         json={"model": "speaker", "voice": "alloy", "input": "Hello there."})
    assert unknown.status_code == 400 and "aiden, ryan, vivian" in unknown.json()["error"]["message"]
