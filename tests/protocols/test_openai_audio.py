"""The transcription form parser: what it reads from a multipart body, and what it says about one it cannot."""

from __future__ import annotations

import pytest

from protocols.errors import ApiError
from protocols.openai_audio import decode_transcription_request, parse_multipart
from tests.fuzz.forms import BOUNDARY, Part, form, tone, wav

CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
AUDIO = wav(tone(0.1))
PARTS = (Part("file", AUDIO, "clip.wav", "audio/wav"), Part("model", b"whisper"), Part("prompt", b"caf\xc3\xa9"))


def refusal(body: bytes, content_type: str = CONTENT_TYPE) -> str:
    with pytest.raises(ApiError) as refused:
        decode_transcription_request(body, content_type, "req")
    assert refused.value.kind == "invalid_request"
    return refused.value.message


def test_a_form_gives_its_fields_and_file() -> None:
    fields, files = parse_multipart(form(PARTS), CONTENT_TYPE)
    assert fields == {"model": ["whisper"], "prompt": ["café"]}
    assert files == {"file": ("clip.wav", AUDIO)}
    request = decode_transcription_request(form(PARTS, newline=b"\n"), f'multipart/form-data; boundary="{BOUNDARY}"',
                                           "req")
    assert request.audio == AUDIO and request.model == "whisper" and request.prompt == "café"


def test_a_body_that_does_not_start_with_the_boundary_names_it() -> None:
    message = refusal(form(PARTS, boundary="other"))
    assert f"'--{BOUNDARY}'" in message and "Content-Type" in message and "State." not in message
    assert "no part that starts with the boundary" in refusal(b"")


def test_a_body_cut_short_says_where() -> None:
    for body in (form(PARTS, close=False), form(PARTS)[:120]):
        message = refusal(body)
        assert f"'--{BOUNDARY}--'" in message and "State." not in message, message


def test_a_part_without_content_disposition_is_named() -> None:
    message = refusal(form((Part(None, b"stray", content_type="text/plain"), *PARTS)))
    assert "Content-Disposition" in message and "State." not in message


def test_what_is_missing_is_said() -> None:
    assert "'file'" in refusal(form(PARTS[1:]))
    assert "'model'" in refusal(form(PARTS[:1]))
    assert "boundary" in refusal(form(PARTS), "multipart/form-data")
