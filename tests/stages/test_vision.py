"""Vision models through the real server and real mlx-vlm: greedy output equals ``mlx_vlm.stream_generate`` on the
same image and prompt (the model as the server runs it: flow's GELU on the CPU) in every protocol, streaming and
not, alone, beside 8 text streams and in one batch of image and text rows — on SmolVLM and Gemma 3 (1-D positions)
as on Qwen2-VL, Qwen2.5-VL and Qwen3-VL (3-D M-RoPE positions and rope deltas per row) and Llama 3.2 Vision
(cross-attention states per row; its text rows skip those layers, tests/mllama_reference.py); the prefix cache keys image spans by their pixels (a next turn reads the
image from the cache, swapped or changed images never match) and the feature cache lets a repeated image skip
the vision tower, without changing the output; every image limit and bad input is a 400 in the protocol's
shape."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from flow.builtins import compile_tables
from runtime.cpu_activations import use_fast_gelu
from runtime.tiny import ensure_tiny_model
from tests.harness import RunningServer, running_server, tables_with_model
from tests.mllama_reference import text_rows_skip_cross_attention

PRESETS = ("tiny-smolvlm", "tiny-gemma3-vision", "tiny-qwen2.5-vl", "tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-mllama",
           "tiny-qwen3.5-vl")
MAX_TOKENS = 10
QUESTION = "What is in the picture?"


def picture(seed: int, size: tuple[int, int] = (80, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def served_family(preset: str) -> dict[str, str]:
    """The model resource's family: Qwen3.5's template opens a <think> block its family (and any with a <think>
    parser) reads as reasoning, so these tests, which compare the answer's text with mlx-vlm's, serve it with a family
    that parses no reasoning (llama3's): every token is text, as mlx-vlm writes it. The template is still the model's
    own, so the prompt, its turn point and the next turn's history render as under its own family."""
    return {"family": "llama3"} if preset == "tiny-qwen3.5-vl" else {}


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


A, B = picture(1), picture(2)
A_CHANGED = A.copy()
A_CHANGED.putpixel((5, 5), (0, 0, 0) if A.getpixel((5, 5)) != (0, 0, 0) else (255, 255, 255))


@dataclass(frozen=True)
class Case:
    """A conversation: messages in HF multimodal shape (``{"type": "image"}`` parts), with its images."""

    messages: tuple[dict[str, Any], ...]
    images: tuple[Image.Image, ...]


def user(*parts: str | Image.Image) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p}
                                        for p in parts]}


def case(*messages: dict[str, Any], images: tuple[Image.Image, ...]) -> Case:
    return Case(tuple(messages), images)


ONE = case(user(A, QUESTION), images=(A,))


def reference(model: Any, processor: Any, conversation: Case, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    """mlx-vlm's own greedy tokens and text for the conversation."""
    from mlx_vlm import stream_generate

    prompt = processor.tokenizer.apply_chat_template(list(conversation.messages), add_generation_prompt=True,
                                                     tokenize=False)
    bos = processor.tokenizer.bos_token
    if not conversation.images and bos and prompt.startswith(bos) and processor.tokenizer.encode(prompt)[:2] == [
            processor.tokenizer.bos_token_id] * 2:
        # mlx-vlm tokenizes a text-only prompt with the special tokens added, so Gemma 3's rendered <bos> would be
        # doubled; flow (as mlx-lm) tokenizes the rendered template as it is.
        prompt = prompt[len(bos):]
    with text_rows_skip_cross_attention():  # Llama 3.2 Vision's text rows as Hugging Face runs them (no-op else)
        results = list(stream_generate(model, processor, prompt, image=list(conversation.images) or None,
                                       max_tokens=max_tokens, temperature=0.0))
    tokens = [r.token for r in results][: results[-1].generation_tokens]  # the last result repeats its token
    if results[-1].finish_reason == "stop":
        tokens = tokens[:-1]  # the end token, which flow does not hand out either
    # The text as the tokenizer decodes the tokens (mlx-vlm's streaming detokenizer drops bytes that are no
    # UTF-8, which random weights produce; flow's writes U+FFFD for them, as tokenizer.decode does).
    return tokens, str(processor.tokenizer.decode(tokens))


@dataclass
class Vision:
    server: RunningServer
    references: dict[str, tuple[list[int], str]]
    image_token: int
    processor: Any
    preset: str = ""

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.server.base_url + path, json={"model": "vlm", **body}, timeout=120)

    def engine(self) -> dict[str, Any]:
        models = httpx.get(self.server.base_url + "/stats", timeout=30).json()["models"]
        return dict(models["vlm"]["engine"])

    def stats(self) -> dict[str, Any]:
        return dict(self.engine()["vision"])


def openai_content(message: dict[str, Any], images: list[Image.Image]) -> list[dict[str, Any]] | str:
    if isinstance(message["content"], str):
        return message["content"]
    out: list[dict[str, Any]] = []
    for part in message["content"]:
        if part["type"] == "image":
            data = base64.b64encode(png(images.pop(0))).decode()
            out.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
        else:
            out.append({"type": "text", "text": part["text"]})
    return out


def chat_body(conversation: Case) -> dict[str, Any]:
    images = list(conversation.images)
    return {"messages": [{"role": m["role"], "content": openai_content(m, images)} for m in conversation.messages],
            "max_tokens": MAX_TOKENS, "temperature": 0}


def anthropic_body(conversation: Case) -> dict[str, Any]:
    images = list(conversation.images)
    messages = []
    for m in conversation.messages:
        content: Any = m["content"]
        if not isinstance(content, str):
            content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                    "data": base64.b64encode(png(images.pop(0))).decode()}}
                       if p["type"] == "image" else {"type": "text", "text": p["text"]} for p in content]
        messages.append({"role": m["role"], "content": content})
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


def responses_body(conversation: Case) -> dict[str, Any]:
    images = list(conversation.images)
    items = []
    for m in conversation.messages:
        if isinstance(m["content"], str):
            items.append({"role": m["role"], "content": m["content"]})
            continue
        parts = [{"type": "input_image", "image_url": "data:image/png;base64,"
                  + base64.b64encode(png(images.pop(0))).decode()}
                 if p["type"] == "image" else {"type": "input_text", "text": p["text"]} for p in m["content"]]
        items.append({"role": m["role"], "content": parts})
    return {"input": items, "max_output_tokens": MAX_TOKENS, "temperature": 0}


def sse_text(response: httpx.Response, protocol: str) -> str:
    text = []
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if protocol == "chat":
            text += [c["delta"].get("content") or "" for c in event.get("choices", [])]
        elif protocol == "anthropic" and event.get("type") == "content_block_delta":
            text.append(event["delta"].get("text", ""))
        elif protocol == "responses" and event.get("type") == "response.output_text.delta":
            text.append(event["delta"])
    return "".join(text)


def answer(vision: Vision, conversation: Case, protocol: str, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """The model's text for the conversation, and the usage (non-streamed) through ``protocol``."""
    path, body = {"chat": ("/v1/chat/completions", chat_body), "anthropic": ("/v1/messages", anthropic_body),
                  "responses": ("/v1/responses", responses_body)}[protocol]
    response = vision.post(path, {**body(conversation), "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        return sse_text(response, protocol), {}
    data = response.json()
    if protocol == "chat":
        return data["choices"][0]["message"]["content"] or "", data["usage"]
    if protocol == "anthropic":
        return "".join(b.get("text", "") for b in data["content"]), data["usage"]
    text = "".join(c["text"] for item in data["output"] if item["type"] == "message" for c in item["content"])
    return text, data["usage"]


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def image_positions(vision: Vision, conversation: Case) -> list[int]:
    """Where the conversation's image tokens sit in its prompt (the processor's expansion)."""
    prompt = vision.processor.tokenizer.apply_chat_template(list(conversation.messages), add_generation_prompt=True,
                                                             tokenize=False)
    ids = vision.processor(text=[prompt], images=list(conversation.images), return_tensors="np")["input_ids"][0]
    return [i for i, t in enumerate(ids) if t == vision.image_token]


def messages_end(vision: Vision, conversation: Case) -> int:
    """Where the conversation's messages end in its prompt: before the template's generation prompt."""
    template = vision.processor.tokenizer.apply_chat_template
    messages = list(conversation.messages)
    prompt = template(messages, add_generation_prompt=True, tokenize=False)
    opening = prompt[len(template(messages, add_generation_prompt=False, tokenize=False)):]
    assert opening and prompt.endswith(opening)
    ids = vision.processor(text=[prompt], images=list(conversation.images), return_tensors="np")["input_ids"][0]
    return len(ids) - len(vision.processor.tokenizer.encode(opening, add_special_tokens=False))


def second_turn(first_answer: str) -> Case:
    return case(user(A, QUESTION), {"role": "assistant", "content": [{"type": "text", "text": first_answer}]},
                user("And the colours?"), images=(A,))


REPEATED = case(user("Another question first. ", A, QUESTION), images=(A,))
TWO = case(user(A, B, "Compare them."), images=(A, B))
SWAPPED = case(user(B, A, "Compare them."), images=(B, A))
CHANGED = case(user(A_CHANGED, QUESTION), images=(A_CHANGED,))
TEXT_FIRST = case(user(QUESTION, A), images=(A,))  # Ollama's shape: the message's text, then its images
TEXTS = tuple(case(user(f"Tell me a long story, number {i}."), images=()) for i in range(4))
C = picture(3, (64, 32))  # another size: another grid, another rope delta on a 3-D position model
MIXED = {"one": ONE, "two": TWO, "square": case(user("Describe it. ", C), images=(C,)),
         "pair": case(user(C, "then", B, "Which is wider?"), images=(C, B)),
         **{f"text{i}": text for i, text in enumerate(TEXTS)}}


@pytest.fixture(scope="module", params=PRESETS)
def vision(request: pytest.FixtureRequest) -> Iterator[Vision]:
    from mlx_vlm import load

    path: Path = ensure_tiny_model(request.param)
    model, processor = load(str(path))
    use_fast_gelu(model)  # as the server runs it: on the CPU, flow's GELU (its accuracy: test_cpu_activations)
    references = {name: reference(model, processor, conversation) for name, conversation in
                  {"repeated": REPEATED, "text_first": TEXT_FIRST, "swapped": SWAPPED, "changed": CHANGED,
                   **MIXED}.items()}
    first_text = references["one"][1]
    references["second"] = reference(model, processor, second_turn(first_text))
    token = int(getattr(model.config, "image_token_id", None) or model.config.image_token_index)
    del model
    tables = tables_with_model(path, name="vlm", **served_family(request.param))
    tables["stages"]["prepare"]["images"] = {
        "max_images": 3, "max_pixels": 1_000_000, "max_bytes": 200_000, "fetch_urls": True}
    with running_server(compile_tables(tables, "vision (test)")) as server:
        yield Vision(server, references, token, processor, request.param)


@pytest.mark.parametrize("protocol", ["chat", "anthropic", "responses"])
def test_greedy_output_equals_mlx_vlm_in_every_protocol(vision: Vision, protocol: str) -> None:
    tokens, text = vision.references["one"]
    assert 0 < len(tokens) <= MAX_TOKENS
    assert answer(vision, ONE, protocol)[0] == text
    assert answer(vision, ONE, protocol, stream=True)[0] == text


def test_an_image_request_among_text_streams_gives_the_same_output(vision: Vision) -> None:
    results: list[int] = []

    def text_stream(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Tell me a long story number {i}."}],
                "max_tokens": 48, "temperature": 0, "stream": True}
        results.append(vision.post("/v1/chat/completions", body).status_code)

    threads = [threading.Thread(target=text_stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        assert answer(vision, ONE, "chat")[0] == vision.references["one"][1]
        assert answer(vision, TWO, "chat")[0] == vision.references["two"][1]
    finally:
        for t in threads:
            t.join()
    assert results == [200] * 8


def test_image_and_text_rows_decode_together_as_each_alone(vision: Vision) -> None:
    """Eight requests at once — four image conversations (one image or two, of two sizes, before or after text) and
    four text ones, streamed and not, through three protocols — decode in one batch, rows joining as their prefills end
    and leaving as they stop: each answer equals mlx-vlm's for that conversation alone."""
    protocols = ("chat", "anthropic", "responses")
    got: dict[str, str] = {}

    def ask(i: int, name: str) -> None:
        got[name] = answer(vision, MIXED[name], protocols[i % 3], stream=i % 2 == 1)[0]

    threads = [threading.Thread(target=ask, args=(i, name)) for i, name in enumerate(MIXED)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {name: vision.references[name][1] for name in MIXED}
    assert vision.engine()["peak_batch"] >= 4
    # Two choices of one image prompt: prefilled once, the second row from copies of the first's cache and
    # positions.
    both = vision.post("/v1/chat/completions", {**chat_body(TWO), "n": 2}).json()["choices"]
    assert [c["message"]["content"] for c in both] == [vision.references["two"][1]] * 2


def test_the_next_turn_reads_the_image_from_the_prefix_cache(vision: Vision) -> None:
    first, _ = answer(vision, ONE, "chat")
    assert first == vision.references["one"][1]
    conversation = second_turn(first)
    text, usage = answer(vision, conversation, "chat")
    assert text == vision.references["second"][1]
    assert cached(usage) > image_positions(vision, conversation)[-1], usage
    if vision.preset == "tiny-qwen3.5-vl":
        # A hybrid's hit ends at a state snapshot: the one chat.prepare's turn point put where the first turn's
        # messages end (its generation prompt, re-rendered otherwise once the answer follows, is not repeated).
        assert cached(usage) == messages_end(vision, ONE), usage


def test_a_repeated_image_skips_the_tower_and_gives_the_same_output(vision: Vision) -> None:
    answer(vision, ONE, "chat")
    before = vision.stats()
    text, usage = answer(vision, REPEATED, "chat")
    after = vision.stats()
    assert text == vision.references["repeated"][1]
    assert cached(usage) < image_positions(vision, REPEATED)[0]  # the prefix differs before the image
    assert after["tower_passes"] == before["tower_passes"]
    assert after["feature_hits"] > before["feature_hits"]


def test_swapped_or_changed_images_never_match_the_cache(vision: Vision) -> None:
    answer(vision, TWO, "chat")
    text, usage = answer(vision, SWAPPED, "chat")
    assert text == vision.references["swapped"][1]
    assert cached(usage) <= image_positions(vision, SWAPPED)[0]
    answer(vision, ONE, "chat")
    text, usage = answer(vision, CHANGED, "chat")
    assert text == vision.references["changed"][1]
    assert cached(usage) <= image_positions(vision, CHANGED)[0]


def error_message(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return str(error["message"] if isinstance(error, dict) else error)


def chat_with(vision: Vision, *parts: dict[str, Any]) -> httpx.Response:
    return vision.post("/v1/chat/completions", {"max_tokens": 4, "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]})


def data_url(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


def test_every_image_limit_and_bad_input_is_a_400(vision: Vision) -> None:
    small = data_url(png(picture(3, (16, 16))))
    assert "max_images" in error_message(chat_with(vision, small, small, small, small))
    assert "max_pixels" in error_message(chat_with(vision, data_url(png(Image.new("RGB", (1200, 1000))))))
    noisy = png(picture(4, (400, 300)))
    assert len(noisy) > 200_000
    assert "max_bytes" in error_message(chat_with(vision, data_url(noisy)))
    broken = error_message(chat_with(vision, data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)))
    assert "image" in broken.lower()
    assert "PNG" in error_message(chat_with(vision, data_url(b"plain text, not a picture", "image/png")))
    refused = error_message(chat_with(vision, {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}))
    assert "file" in refused.lower() or "http" in refused.lower()
    anthropic = vision.post("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!not base64!!"}},
        {"type": "text", "text": QUESTION}]}]})
    assert anthropic.json()["type"] == "error" and anthropic.status_code == 400
    if "qwen" in vision.preset:  # the Qwen-VL processors refuse a side over 200 times the other
        strip = error_message(chat_with(vision, data_url(png(Image.new("RGB", (1000, 4))))))
        assert "image processor refused" in strip and "aspect ratio" in strip, strip


@pytest.mark.parametrize("vision", ["tiny-smolvlm"], indirect=True)  # the prepare stage's, whatever the model
async def test_a_url_to_a_loopback_port_is_refused(vision: Vision) -> None:
    import trio

    hits: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        hits.append(await stream.receive_some(1024))
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        url = f"http://127.0.0.1:{port}/secret.png"
        response = await trio.to_thread.run_sync(lambda: chat_with(vision, {"type": "image_url",
                                                                            "image_url": {"url": url}}))
        nursery.cancel_scope.cancel()
    message = error_message(response)
    assert "127.0.0.1" in message and not hits, message


def test_health_and_models_show_the_vision_kind(vision: Vision) -> None:
    health = httpx.get(vision.server.base_url + "/health", timeout=30).json()
    assert {m["id"]: m["kind"] for m in health["models"]} == {"vlm": "vision"}, health


def test_ollama_images_give_the_same_output(vision: Vision) -> None:
    data = base64.b64encode(png(A)).decode()
    body = {"model": "vlm", "stream": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS},
            "messages": [{"role": "user", "content": QUESTION, "images": [data]}]}
    response = httpx.post(vision.server.base_url + "/api/chat", timeout=120, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["message"]["content"] == vision.references["text_first"][1]
    streamed = httpx.post(vision.server.base_url + "/api/chat", timeout=120, json={**body, "stream": True})
    lines = [json.loads(line) for line in streamed.text.splitlines() if line]
    assert "".join(line["message"]["content"] for line in lines) == vision.references["text_first"][1]


def test_a_screenshot_in_an_anthropic_tool_result_reaches_the_model(vision: Vision) -> None:
    screenshot = picture(7)
    before = vision.stats()
    response = vision.post("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "Take a screenshot and tell me what you see."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "Here it is."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(screenshot)).decode()}}]}]}],
        "tools": [{"name": "screenshot", "description": "Capture the screen.",
                   "input_schema": {"type": "object", "properties": {}}}]})
    assert response.status_code == 200, response.text
    after = vision.stats()
    assert after["tower_passes"] == before["tower_passes"] + 1  # the image went through the vision tower
    alone = len(image_positions(vision, case(user(screenshot, "x"), images=(screenshot,))))
    usage = response.json()["usage"]  # Anthropic counts cached and cache-written prompt tokens apart
    total = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    assert total > alone, usage


def test_an_image_to_a_text_model_names_the_vision_models(tiny_qwen3: Path) -> None:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["vision"] = {"type": "model", "path": str(ensure_tiny_model("tiny-smolvlm")), "name": "vlm"}
    with running_server(compile_tables(tables, "text and vision (test)")) as server:
        body = {"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [data_url(png(A)), {"type": "text", "text": QUESTION}]}]}
        refused = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        message = error_message(refused)
        assert "reads text only" in message and "read images: vlm" in message, message
        served = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "model": "vlm"}, timeout=60)
        assert served.status_code == 200, served.text
        kinds = {m["id"]: m.get("kind") for m in httpx.get(server.base_url + "/health", timeout=30).json()["models"]}
        assert kinds == {"tiny": "text", "vlm": "vision"}, kinds


@pytest.fixture(scope="module", params=["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-mllama", "tiny-qwen3.5-vl"])
def speculating(request: pytest.FixtureRequest) -> Iterator[Vision]:
    """A 3-D position model served with n-gram speculative decoding (a verify pass carries several tokens per row,
    each at its own 3-D position; Qwen3.5's gated-delta states cut back to what each row accepted) and 16-token
    prefill chunks (image spans and Qwen3-VL's deepstack features cut across chunks)."""
    from mlx_vlm import load

    path: Path = ensure_tiny_model(request.param)
    model, processor = load(str(path))
    use_fast_gelu(model)
    references = {name: reference(model, processor, conversation, LONG) for name, conversation in SPECULATED.items()}
    del model
    tables = tables_with_model(path, name="vlm", **served_family(request.param))
    tables["resources"]["model"].update(speculative={"kind": "ngram", "max_draft": 4}, prefill_chunk=16)
    with running_server(compile_tables(tables, "vision, speculative (test)")) as server:
        yield Vision(server, references, int(processor.image_token_id), processor, request.param)


LONG = 48  # enough tokens for the tiny model's repetitions to give n-gram drafts
# Image rows that draft themselves (the tiny models fall into repeating themselves on these questions), alone: each
# verify pass holds a row's input and draft at their 3-D positions, and the accepted tokens' KV stays.
DRAFTING = {"yes": case(user(A, "Say yes. Yes yes yes yes yes"), images=(A,)),
            "count": case(user(A, "1 2 3 4 " * 6), images=(A,))}
# Then image rows beside a text row that drafts: every verify pass carries each row's input and the widest draft,
# so the other rows' windows hold several 3-D positions too (whether the measured costs let a step verify, beside
# three other rows on a CPU, varies: the output must not).
BESIDE = {"one": ONE, "two": TWO, "text": case(user("Say yes. Yes yes yes yes yes"), images=())}
SPECULATED = {**DRAFTING, **BESIDE}


def prompt_ids(vision: Vision, conversation: Case) -> list[int]:
    """The conversation's prompt as the server makes it: the template, then the processor (images) or the
    tokenizer (text)."""
    prompt = vision.processor.tokenizer.apply_chat_template(list(conversation.messages), add_generation_prompt=True,
                                                             tokenize=False)
    if not conversation.images:
        return list(vision.processor.tokenizer.encode(prompt, add_special_tokens=False))
    return [int(t) for t in vision.processor(text=[prompt], images=list(conversation.images),
                                             return_tensors="np")["input_ids"][0]]


def served_oracle(futures: list[tuple[list[int], list[int], int | None]]) -> Any:
    """A stand-in for the n-gram lookup (tests/runtime/test_speculative.py's ``oracle`` keyed by the whole prompt, not
    its length, as a server's rows are many): a row whose history starts with a prompt of ``futures`` gets that
    prompt's greedy continuation as its draft, with a wrong token after ``wrong_after`` correct ones when that is
    not None (the draft cut back in the verify pass); any other row no draft."""
    from runtime.speculative import DraftState

    def propose(self: DraftState, limit: int) -> list[int]:
        history = self.tokens[: self.count].tolist()
        for ids, future, wrong_after in futures:
            if history[: len(ids)] == ids:
                done = self.count - len(ids)  # generated tokens in the history, the current input included
                draft = future[done : done + min(limit, 4)]
                if wrong_after is not None and len(draft) > wrong_after:
                    draft = [*draft[:wrong_after], (draft[wrong_after] + 1) % 100, *draft[wrong_after + 1 :]]
                return draft
        return []
    return propose


def test_speculative_decoding_and_chunked_prefill_on_3d_position_rows_give_the_same_output(
        speculating: Vision, monkeypatch: pytest.MonkeyPatch) -> None:
    if speculating.preset == "tiny-qwen3.5-vl":
        # The random Qwen3.5 repeats itself too little for n-gram drafts: its rows draft their true continuation
        # (alone: accepted whole; beside each other: wrong after two tokens, each row's gated-delta states cut back
        # every step), and every step with drafts verifies them, whatever this machine's measured costs say.
        import runtime.speculative_step
        from runtime.speculative import DraftState

        futures = [(prompt_ids(speculating, SPECULATED[name]), speculating.references[name][0],
                    None if name in DRAFTING else 2) for name in SPECULATED]
        assert len({tuple(ids) for ids, _, _ in futures}) == len(futures)
        monkeypatch.setattr(DraftState, "propose", served_oracle(futures))
        monkeypatch.setattr(runtime.speculative_step, "worth_verifying",
                            lambda lengths, states, cost, draft_cost=None: max(lengths))
    got: dict[str, str] = {}

    def ask(name: str) -> None:
        body = {**chat_body(SPECULATED[name]), "max_tokens": LONG}
        got[name] = speculating.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]

    for name in DRAFTING:
        ask(name)
        assert got[name] == speculating.references[name][1], name
    engine = speculating.engine()
    assert engine["speculative_steps"] > 0 and engine["accepted_tokens"] > 0, engine
    if speculating.preset == "tiny-qwen3.5-vl":  # the true continuations, accepted whole
        assert engine["accepted_tokens"] == engine["draft_tokens"], engine
    threads = [threading.Thread(target=ask, args=(name,)) for name in BESIDE]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {name: text for name, (_, text) in speculating.references.items()}
    if speculating.preset == "tiny-qwen3.5-vl":  # the wrong drafts were verified and cut back
        after = speculating.engine()
        rejected = after["draft_tokens"] - after["accepted_tokens"]
        assert rejected > engine["draft_tokens"] - engine["accepted_tokens"], (engine, after)


def test_structured_output_on_an_image_row_follows_its_schema(speculating: Vision) -> None:
    """A grammar masks an image row's tokens as a text row's (its positions are the model's business, the mask
    the sampler's): the answer parses and validates, beside an unconstrained image row that keeps its output."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
              "additionalProperties": False}
    got: dict[str, Any] = {}

    def constrained() -> None:
        # No thinking block: the grammar holds from the first token (test_structured_output's requests do the same).
        body = {**chat_body(ONE), "max_tokens": 64, "reasoning_effort": "none", "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
        got["json"] = speculating.post("/v1/chat/completions", body).json()["choices"][0]

    def plain() -> None:
        body = {**chat_body(TWO), "max_tokens": LONG}
        got["two"] = speculating.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=constrained), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["json"]["finish_reason"] == "stop", got
    answer_json = json.loads(got["json"]["message"]["content"])
    assert set(answer_json) == {"colour"} and isinstance(answer_json["colour"], str)
    assert got["two"] == speculating.references["two"][1]
