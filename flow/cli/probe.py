"""``flow probe MODEL``: find out how a model takes tools and thinking, and remember it.

The probe loads the model and asks it, greedily, to call a tool:

1. **tool delivery** — render the request with ``tools=`` through the chat
   template; if the template shows the tool, delivery is ``template``,
   otherwise the family's injected prompt (``injected``);
2. **tool parser** — parse the answer with the family's parser, then with
   every parser; the first that finds a call (the family's own first) wins;
3. **thinking** — whether the family's switch changes the rendered prompt, and
   whether a thinking-on answer contains ``<think>…</think>`` markup;
4. the context length from the model's config.

A vision model is probed as a text model and for its images (:func:`vision_profile`): whether its template
and processor take several images in one message, how many tokens an image costs at two sizes, and the
image limit its files declare.

An embedding model is probed for what it gives instead: its vector size, pooling, length limit and
Matryoshka sizes (:mod:`runtime.embedding_profile`), checked by embedding three sentences (or, for a
cross-encoder, scoring two pairs).

The result goes to the :mod:`flow.catalog.capabilities` store, which serving reads
before falling back to family detection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from flow.catalog.capabilities import Capabilities, CapabilityStore
from flow.catalog.families import Family, resolve_family
from protocols.errors import ApiError
from protocols.ir import ChatRequest, Message, ToolCallDelta
from protocols.parsers import TOOL_PARSERS, make_response_parser, make_tool_parser
from runtime.device import shared_device
from runtime.engine_config import EngineConfig
from runtime.model_kinds import detect_kind_of
from runtime.models import LoadedModel, load_model, resolve_model_path
from stages.chat import render_prompt

log = logging.getLogger("flow.cli.probe")

PROBE_TOOLS: tuple[dict[str, Any], ...] = ({"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}},)
PROBE_MESSAGES = (
    Message("system", "You are a helpful assistant. Use the tools you are given."),
    Message("user", "What is the weather in Paris right now? Call the get_weather tool."),
)


def _with(family: Family, **tools: Any) -> Family:
    return family.model_copy(update={"tools": family.tools.model_copy(update=tools)})


def _generate(loaded: LoadedModel, prompt: str, max_tokens: int) -> str:
    from mlx_lm import generate

    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    return str(shared_device().call(lambda: generate(loaded.model, loaded.tokenizer, prompt=ids,
                                                     max_tokens=max_tokens)))


def _calls(parser_id: str, text: str, options: Mapping[str, Any] | None = None) -> list[str]:
    parser = make_tool_parser(parser_id, PROBE_TOOLS, options=options)
    return [e.name or "" for e in parser.parse(text) if isinstance(e, ToolCallDelta) and e.name]


def probe(ref: str, *, family_choice: str = "auto", max_tokens: int = 160,
          store: CapabilityStore | None = None) -> Capabilities:
    path: Path = resolve_model_path(ref)
    device = shared_device()
    device.start()
    kind = detect_kind_of(path)
    if kind == "embeddings":
        return probe_embedder(path, store or CapabilityStore())
    loaded = load_model(path.name, path, device, EngineConfig(max_batch=1), vision=kind == "vision")
    try:
        return _probe(loaded, path, ref, family_choice, max_tokens, store or CapabilityStore())
    finally:
        loaded.engine.close()


IMAGE_LIMIT_KEYS = ("max_images", "max_num_images", "max_image_count", "max_images_per_prompt")


def vision_profile(loaded: LoadedModel) -> dict[str, Any]:
    """A vision model's image capabilities: two images in one message through its template and processor
    (each image's tokens found apart: ``multi_image``), the image tokens of a small and a large image, and the
    most images per prompt its config or processor declares (None: none declared)."""
    from PIL import Image

    from runtime.vision import prompt_inputs

    sizes = ((64, 48), (1024, 768))
    images = [Image.new("RGB", size, (40 * i + 100, 60, 200 - 40 * i)) for i, size in enumerate(sizes)]
    digests = [bytes([i]) * 32 for i in range(len(images))]
    model_type = str(loaded.config.get("model_type", ""))
    token = loaded.model.image_token_id

    def rendered(count: int) -> str:
        parts: list[dict[str, Any]] = [{"type": "image"}] * count + [{"type": "text", "text": "Describe."}]
        return str(loaded.tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                                         add_generation_prompt=True, tokenize=False))

    tokens: dict[str, int] = {}
    for (width, height), image, digest in zip(sizes, images, digests):
        _, alone = prompt_inputs(loaded.processor, model_type, rendered(1), [image], [digest], token)
        tokens[f"{width}x{height}"] = sum(span.end - span.start for span in alone.spans)
    try:
        _, both = prompt_inputs(loaded.processor, model_type, rendered(2), images, digests, token)
        multi = {span.digest for span in both.spans} == set(digests)
    except (ValueError, TypeError):
        multi = False
    declared = {**loaded.config, **loaded.config.get("vision_config", {}),
                **{k: getattr(loaded.processor, k, None) for k in IMAGE_LIMIT_KEYS}}
    limit = next((int(declared[k]) for k in IMAGE_LIMIT_KEYS if isinstance(declared.get(k), int)), None)
    return {"multi_image": multi, "image_tokens": tokens, "max_images": limit, "image_token_id": token}


PROBE_SENTENCES = ("The cat sits on the mat.", "A cat is sitting on a mat.", "Stock prices fell sharply today.")


def probe_embedder(path: Path, store: CapabilityStore) -> Capabilities:
    """An embedding model's capabilities: what its files declare (pooling, length, Matryoshka sizes), checked
    by embedding three sentences — the vector size, and that the vectors are unit length — or, for a
    cross-encoder, by scoring two pairs."""
    from runtime.embeddings import load_embedder

    loaded = load_embedder(path.name, path, shared_device(), pass_tokens=4096)
    try:
        ids = [list(row) for row in loaded.tokenizer(list(PROBE_SENTENCES))["input_ids"]]
        if loaded.profile.task == "score":
            ids = [list(row) for row in loaded.tokenizer([PROBE_SENTENCES[0]] * 2, list(PROBE_SENTENCES[1:]))[
                "input_ids"]]
        out = loaded.embedder.submit(ids).result(timeout=600)
    finally:
        loaded.embedder.close()
    evidence: dict[str, Any] = {"smoke_test": loaded.smoke_test, "detected_family": "-"}
    profile = loaded.profile.as_json()
    if loaded.profile.task == "score":
        evidence["pair_scores"] = [round(float(x), 4) for x in out[:, 0]]
    else:
        norms = np.linalg.norm(out, axis=1)
        profile["normalized"] = bool(np.allclose(norms, 1.0, atol=1e-3))
        evidence["similarity"] = {"paraphrase": round(float(out[0] @ out[1]), 4),
                                  "unrelated": round(float(out[0] @ out[2]), 4)}
    caps = Capabilities(model=str(path), family="-", tool_parser="null", reasoning_parser="null",
                        tool_delivery="-", thinking=False, context_length=loaded.max_length, evidence=evidence,
                        kind="embeddings", profile=profile)
    store.put(caps)
    return caps


def _probe(loaded: LoadedModel, path: Path, ref: str, family_choice: str, max_tokens: int,
           store: CapabilityStore) -> Capabilities:
    tokenizer = loaded.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    family = resolve_family(family_choice, path, ref, template)
    evidence: dict[str, Any] = {"detected_family": family.name, "smoke_test": loaded.smoke_test}
    request = ChatRequest(model=ref, messages=PROBE_MESSAGES, tools=PROBE_TOOLS)

    try:
        templated = render_prompt(tokenizer, request, _with(family, delivery="template"))
        delivery = "template" if "Get the current weather in a city." in templated else "injected"
    except ApiError as exc:
        evidence["template_tools_error"] = exc.message
        delivery = "injected"
    chosen = _with(family, delivery=delivery)
    answer = _generate(loaded, render_prompt(tokenizer, request, chosen), max_tokens)
    evidence["tool_answer"] = answer[:2000]
    # The family's parser with its markers, then every parser with its defaults.
    found = {pid: _calls(pid, answer, family.tools.options if pid == family.tools.parser else None)
             for pid in TOOL_PARSERS if pid != "null"}
    evidence["calls_by_parser"] = found
    order = [family.tools.parser, *sorted(p for p in found if p != family.tools.parser)]
    tool_parser = next((p for p in order if found.get(p)), family.tools.parser)

    toggle = family.reasoning.toggle
    thinking = False
    if toggle:
        plain = ChatRequest(model=ref, messages=PROBE_MESSAGES[1:])
        on = render_prompt(tokenizer, ChatRequest(**{**plain.__dict__, "thinking": True}), family)
        off = render_prompt(tokenizer, ChatRequest(**{**plain.__dict__, "thinking": False}), family)
        thinking = on != off
        if thinking:
            thought = _generate(loaded, on, max_tokens)
            evidence["thinking_answer"] = thought[:2000]
    reasoning_parser = family.reasoning.parser
    if reasoning_parser == "null" and "</think>" in (evidence.get("thinking_answer") or answer):
        reasoning_parser = "think_tag"
    if reasoning_parser != "null":
        options = family.reasoning.options if reasoning_parser == family.reasoning.parser else {}
        parsed = make_response_parser(reasoning_parser=reasoning_parser, reasoning_options=options).parse(
            evidence.get("thinking_answer") or answer)
        evidence["reasoning_seen"] = any(type(e).__name__ == "ReasoningDelta" for e in parsed)

    vision = loaded.processor is not None
    caps = Capabilities(model=str(path), family=family.name, tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser, tool_delivery=delivery, thinking=thinking,
                        context_length=loaded.context_length, tool_calls_verified=bool(found.get(tool_parser)),
                        evidence=evidence, kind="vision" if vision else "text",
                        profile=vision_profile(loaded) if vision else {})
    store.put(caps)
    return caps
