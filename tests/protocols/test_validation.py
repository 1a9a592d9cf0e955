"""Error locations as the client's field paths: pydantic's union member tags left out."""

from __future__ import annotations

import json

import pytest

from protocols.errors import ApiError
from protocols.openai_speech import decode_speech_request
from protocols.rerank import decode_rerank_request


def _error(decode: object, body: dict[str, object]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        decode(json.dumps(body).encode(), "req-1")  # type: ignore[operator]
    return caught.value


def test_a_model_class_in_a_union_is_not_part_of_the_path() -> None:
    # pydantic locates it at ('documents', 0, '_Document', 'text'): the class name means nothing to a client
    error = _error(decode_rerank_request, {"model": "m", "query": "q", "documents": [{"text": 5}]})
    assert error.param == "documents[0].text"
    assert "_Document" not in error.message and "'documents[0].text'" in error.message


def test_a_missing_field_of_a_union_member_is_named_plainly() -> None:
    error = _error(decode_rerank_request, {"model": "m", "query": "q", "documents": [{}]})
    assert error.param == "documents[0].text"
    assert "'documents[0].text' is required" in error.message


def test_a_voice_object_without_a_string_id() -> None:
    error = _error(decode_speech_request, {"model": "m", "input": "hi", "voice": {"id": 3}})
    assert error.param == "voice.id"
    assert "VoiceObject" not in error.message


def test_builtin_union_tags_are_left_out_too() -> None:
    error = _error(decode_rerank_request, {"model": "m", "query": ["q"], "documents": ["a"]})
    assert error.param == "query"
