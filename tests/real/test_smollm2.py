"""SmolLM2-135M-Instruct (trained weights) through every text protocol of the real server.

Greedy answers are what ``mlx_lm.generate`` gives for the same templated prompt and token limit (on the
same model directory, in the test process), and they state the fact asked for. Stop strings stop, usage
counts the tokens that were prefilled and generated, and a second turn reads the first from the prefix
cache. Decode here runs ~9 tokens/s, so answers are short.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.real.conftest import RealModel, RealServer, real_server

pytestmark = pytest.mark.real

QUESTION = "What is the capital of France?"
MESSAGES: list[Any] = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 16
GREEDY: Any = {"temperature": 0}  # in the body: the installed Anthropic SDK's create() has no temperature argument


@pytest.fixture(scope="module")
def smollm2(real_model: RealModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    with real_server(real_model("smollm2-135m-instruct"), tmp_path_factory.mktemp("smollm2")) as server:
        yield server


class Reference:
    """``mlx_lm`` itself on the same model directory, in this process."""

    def __init__(self, path: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(path))

    def chat_prompt(self, messages: list[Any]) -> list[int]:
        """The prompt's token ids after the model's own chat template."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def answer(self, prompt: list[int] | str, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        """``mlx_lm.generate``'s greedy answer, and how many tokens it generated (the answer's own: not the
        end-of-turn token, which flow, like ``mlx_lm.server``, does not count). ``generate`` is
        ``stream_generate`` with its text joined; one pass gives both figures."""
        from mlx_lm import stream_generate

        steps = list(stream_generate(self.model, self.tokenizer, prompt=prompt, max_tokens=max_tokens))
        return "".join(step.text for step in steps), steps[-1].generation_tokens - (steps[-1].finish_reason == "stop")


@pytest.fixture(scope="module")
def reference(smollm2: RealServer) -> Reference:
    return Reference(smollm2.path)


def test_detected_as_chatml_by_its_template(smollm2: RealServer) -> None:
    """SmolLM2 is a ``llama`` with a ChatML template: the template's fingerprint gives it the chatml family
    (llama3's would have waited for <|eot_id|>, which its vocabulary lacks), and tools are described in the
    system message, since its template has no tools branch."""
    import httpx

    assert httpx.get(smollm2.base_url + "/health", timeout=30).json()["models"][0]["family"] == "chatml"
    assert "is not in model" not in smollm2.log.read_text()  # no stop token missing from the vocabulary


@pytest.fixture(scope="module")
def expected(reference: Reference) -> tuple[str, int]:
    answer, generated = reference.answer(reference.chat_prompt(MESSAGES))
    assert "Paris" in answer, f"SmolLM2 should know the capital of France; mlx_lm.generate gave {answer!r}"
    return answer, generated


def openai_client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def anthropic_client(server: RealServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def test_openai_chat_answers_as_mlx_lm_does(smollm2: RealServer, reference: Reference,
                                            expected: tuple[str, int]) -> None:
    answer, generated = expected
    c = openai_client(smollm2)
    full = c.chat.completions.create(model=smollm2.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert full.choices[0].message.content == answer and full.choices[0].finish_reason == "stop"
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(reference.chat_prompt(MESSAGES))
    assert full.usage.completion_tokens == generated
    assert full.usage.total_tokens == full.usage.prompt_tokens + generated
    chunks = list(c.chat.completions.create(model=smollm2.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == generated


def test_anthropic_messages_answer_as_mlx_lm_does(smollm2: RealServer, reference: Reference,
                                                  expected: tuple[str, int]) -> None:
    answer, generated = expected
    c = anthropic_client(smollm2)
    message = c.messages.create(model=smollm2.model, max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"] and message.stop_reason == "end_turn"
    assert message.content[0].type == "text" and message.content[0].text == answer
    u = message.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    assert prompt == len(reference.chat_prompt(MESSAGES)) and u.output_tokens == generated
    with c.messages.stream(model=smollm2.model, max_tokens=MAX_TOKENS, messages=MESSAGES,
                           extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == answer
        assert stream.get_final_message().usage.output_tokens == generated


def test_responses_answer_as_mlx_lm_does(smollm2: RealServer, reference: Reference,
                                         expected: tuple[str, int]) -> None:
    answer, generated = expected
    c = openai_client(smollm2)
    response = c.responses.create(model=smollm2.model, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.status == "completed" and response.output_text == answer
    assert response.usage is not None and response.usage.output_tokens == generated
    assert response.usage.input_tokens == len(reference.chat_prompt(MESSAGES))
    with c.responses.stream(model=smollm2.model, input=QUESTION, max_output_tokens=MAX_TOKENS,
                            temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == answer


def test_legacy_completions_continue_the_templated_prompt_as_mlx_lm_does(smollm2: RealServer,
                                                                         reference: Reference) -> None:
    prompt = str(reference.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))
    answer, generated = reference.answer(prompt)
    out = openai_client(smollm2).completions.create(model=smollm2.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0)
    assert out.choices[0].text == answer and "Paris" in answer
    assert out.usage is not None and out.usage.completion_tokens == generated
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(prompt, add_special_tokens=False))


def test_a_stop_string_ends_the_answer_before_it(smollm2: RealServer, expected: tuple[str, int]) -> None:
    before = expected[0].split("Paris")[0]
    chat = openai_client(smollm2).chat.completions.create(model=smollm2.model, messages=MESSAGES,
                                                          max_tokens=MAX_TOKENS, temperature=0, stop=["Paris"])
    assert chat.choices[0].message.content == before and chat.choices[0].finish_reason == "stop"
    message = anthropic_client(smollm2).messages.create(model=smollm2.model, max_tokens=MAX_TOKENS, messages=MESSAGES,
                                                        extra_body=GREEDY, stop_sequences=["Paris"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Paris"
    assert message.content[0].type == "text" and message.content[0].text == before


def test_a_second_turn_reads_the_first_from_the_prefix_cache(smollm2: RealServer, reference: Reference,
                                                             expected: tuple[str, int]) -> None:
    first_prompt = len(reference.chat_prompt(MESSAGES))
    turn: list[Any] = [*MESSAGES, {"role": "assistant", "content": expected[0]},
                       {"role": "user", "content": "And the capital of Germany?"}]
    c = openai_client(smollm2)
    c.chat.completions.create(model=smollm2.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    chat = c.chat.completions.create(model=smollm2.model, messages=turn, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    # At least the whole first prompt is read back (an exact repeat re-feeds only its last token).
    assert first_prompt - 1 <= chat.usage.prompt_tokens_details.cached_tokens < chat.usage.prompt_tokens
    assert "Berlin" in (chat.choices[0].message.content or "")

    message = anthropic_client(smollm2).messages.create(model=smollm2.model, max_tokens=MAX_TOKENS, messages=turn,
                                                        extra_body=GREEDY)
    u = message.usage
    assert u.cache_read_input_tokens is not None and u.cache_read_input_tokens >= chat.usage.prompt_tokens - 1
    assert u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0) == chat.usage.prompt_tokens

    response = c.responses.create(model=smollm2.model, input=turn, max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.input_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 1
