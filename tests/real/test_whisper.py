"""Whisper tiny.en (trained weights) through the real server: speech made locally by espeak-ng, sent in several
containers with the official OpenAI SDK, comes back as the sentence's words; the answer is what mlx-audio's
own ``generate`` gives on the same audio, and the subtitles' times lie within the recording.

No real text-to-speech model can be had from the package registries, so the issue's round trip (speech from
the server's TTS transcribed by its STT) is replaced by speech from espeak-ng.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from tests.audio_clips import encode_as, espeak
from tests.real.conftest import RealModel, RealServer, real_server

pytestmark = pytest.mark.real

SENTENCE = "The quick brown fox jumps over the lazy dog. Today is a sunny day in Paris."


@pytest.fixture(scope="module")
def whisper(real_model: RealModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    with real_server(real_model("whisper-tiny.en"), tmp_path_factory.mktemp("whisper")) as server:
        yield server


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    samples = espeak(SENTENCE)
    if samples is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): it speaks the test sentence")
    return samples


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_spoken_sentence_comes_back_as_its_words_in_every_container(whisper: RealServer, speech: np.ndarray) -> None:
    client = openai.OpenAI(base_url=whisper.url, api_key="unused", max_retries=0, timeout=300)
    expected = set(words(SENTENCE))
    for extension in ("wav", "mp3", "ogg"):
        text = client.audio.transcriptions.create(model=whisper.model, file=(f"s.{extension}",
                                                  encode_as(speech, 16000, extension))).text
        heard = set(words(text))
        assert len(heard & expected) >= 0.75 * len(expected), (extension, text)
        assert {"quick", "today", "sunny", "paris"} <= heard, (extension, text)  # tiny.en mishears a word or two


def test_server_answer_equals_mlx_audio_and_subtitles_fit_the_recording(whisper: RealServer,
                                                                       speech: np.ndarray) -> None:
    from mlx_audio.stt.utils import load_model

    from runtime.audio import TranscribeOptions, to_float32

    client = openai.OpenAI(base_url=whisper.url, api_key="unused", max_retries=0, timeout=300)
    wav = encode_as(speech, 16000, "wav")
    verbose = client.audio.transcriptions.create(model=whisper.model, file=("s.wav", wav),
                                                 response_format="verbose_json")
    model = load_model(str(whisper.path))
    to_float32(model)  # as the server serves it on a CPU
    from protocols.audio_codecs import decode_audio

    options = TranscribeOptions()
    import mlx.core as mx

    mx.random.seed(options.seed)
    direct = model.generate(decode_audio(wav, 16000, 60), **options.generate_kwargs(model))
    assert verbose.text == direct.text.strip()
    assert [s.text for s in verbose.segments or []] == [s["text"] for s in direct.segments]
    duration = len(speech) / 16000
    assert verbose.duration == pytest.approx(duration, abs=0.01)
    srt = client.audio.transcriptions.create(model=whisper.model, file=("s.wav", wav), response_format="srt")
    times = re.findall(r"(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)", srt)
    assert times
    ends = [int(t[4]) * 3600 + int(t[5]) * 60 + int(t[6]) + int(t[7]) / 1000 for t in times]
    assert ends == sorted(ends) and ends[-1] <= duration
    events = list(client.audio.transcriptions.create(model=whisper.model, file=("s.wav", wav), stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == events[-1].text == verbose.text
