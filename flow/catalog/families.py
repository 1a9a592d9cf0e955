"""Model families as data: ``graphs/families/*.toml``.

A family file says how to recognise a model and how to talk to it: detection
rules (``config.json`` ``model_type`` / ``architectures``, name patterns,
the chat template's fingerprint), how tools reach the model (the template's native
``tools=`` support, or a prompt injected into the system message), which
parsers read its output, how thinking is switched, extra stop tokens, and the
template's quirks (and forgiveness: ``tools.loose_calls`` takes calls that small
models write without the markup). Adding a family whose formats exist is one file here.

Resolution (:func:`resolve_family`): an explicit family id wins; ``"auto"``
scores every family's rules against the model and takes the best match (ties
go to the higher ``priority``); nothing matching gives ``default``.

The chat template is the best evidence of how a model talks: fine-tunes keep
their base's ``model_type`` but may change the template (SmolLM2 is a ``llama``
with a ChatML template), and renamed copies lose the name. So a family's
``template_contains`` markers are a fingerprint: a model whose template is known
and lacks one of them is not of that family, whatever its config says, and one
whose template has them all is, even without any other rule matching. Files may
``extends`` another family and override only what differs.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flow.catalog.bundled import family_dir
from protocols.parsers import REASONING_PARSERS, TOOL_PARSERS, reasoning_options_problem, tool_options_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FAMILY_DIR = family_dir()  # graphs/families, wherever flow is installed (flow/bundled.py)

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query. The functions are described here as JSON schemas:
{tools}

To call functions, answer with nothing but the calls, written as:
{call_format}"""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Detect(_Strict):
    model_types: list[str] = Field(default_factory=list, description="config.json model_type values")
    architectures: list[str] = Field(default_factory=list, description="config.json architectures entries")
    name_patterns: list[str] = Field(default_factory=list, description="regexes matched (case-insensitive) on the model's path or id")
    template_contains: list[str] = Field(
        default_factory=list, description="the template's fingerprint: markers it must all contain (a known "
        "template without one of them rules the family out)")
    template_required: bool = Field(
        default=False, description="match only a model whose template is known (and has the markers): for a "
        "family that shares its base's config and is told apart by the template alone (Hermes 4 in Llama 3 turns)")
    priority: int = Field(default=0, description="breaks ties between families that match equally well")


class Tools(_Strict):
    parser: str = Field(default="null", description="tool-call parser id")
    delivery: Literal["auto", "template", "injected", "system"] = Field(
        default="auto", description="template: pass tools= to the chat template; injected: describe them in the "
        "system message and write earlier calls as text; system: describe them in the system message, earlier "
        "calls still to the template; auto: template when it mentions tools, else injected")
    arguments: Literal["object", "string"] = Field(
        default="object", description="earlier calls' arguments as the template wants them: an object, or JSON "
        "text (templates that concatenate them)")
    prompt: str = Field(default=DEFAULT_TOOL_PROMPT, description="injected tool prompt ({tools}: one JSON function "
                        "a line, {tools_json}: a JSON list of them, {call_format})")
    call_format: str = Field(default='<tool_call>\n{"name": "NAME", "arguments": {ARGUMENTS}}\n</tool_call>',
                             description="how the injected prompt tells the model to write a call")
    call_ids: Literal["any", "alnum9"] = Field(default="any", description="alnum9: rewrite ids to 9 letters/digits (Mistral)")
    calls_as_text: bool = Field(
        default=False, description="write earlier calls into the assistant's text in the parser's syntax (templates "
        "that take tools but render no calls, Granite 3.x)")
    one_call_per_message: bool = Field(default=False, description="split multi-call assistant turns (Llama 3.1)")
    tool_role: Literal["tool", "user"] = Field(default="tool", description="user: tool results become user turns (templates without a tool role)")
    options: dict[str, Any] = Field(default_factory=dict, description="the parser's format options (markers)")
    loose_calls: bool = Field(
        default=False, description="also take a call written without the parser's markup (bare JSON or a ```json "
        "block naming a declared tool, as the whole rest of the output): small models that forget their format")


class Reasoning(_Strict):
    parser: str = Field(default="null", description="reasoning parser id")
    toggle: str | None = Field(default="enable_thinking", description="chat_template_kwargs key that switches thinking")
    switch: tuple[str, str] | None = Field(
        default=None, description="[on, off]: the words a template reads in the system message to switch thinking, "
        "for templates with no toggle key (Nemotron Nano 2: /think, /no_think); the request's choice is written there")
    open_tag: str = Field(default="<think>", description="when the prompt ends with this, output starts inside thinking")
    options: dict[str, Any] = Field(default_factory=dict, description="the parser's format options (tags)")
    effort: str | None = Field(default=None, description="chat_template_kwargs key that takes the request's "
                               "reasoning effort (low/medium/high), for templates that grade thinking")
    budget: str | None = Field(default=None, description="chat_template_kwargs key that takes the request's thinking "
                               "budget in tokens (0 when thinking is off), for templates that limit thinking")
    history_field: str = Field(default="reasoning_content", description="the assistant-message key the template "
                               "reads earlier reasoning from (gpt-oss: thinking)")


class Family(_Strict):
    name: str
    description: str = ""
    extends: str | None = None
    detect: Detect = Detect()
    tools: Tools = Tools()
    reasoning: Reasoning = Reasoning()
    stop_tokens: list[str] = Field(default_factory=list, description="extra tokens that end generation")
    mid_system: Literal["keep", "user"] = Field(
        default="user", description="system messages after the first: keep them as system turns (templates that "
        "render a system turn anywhere), or fold them into the neighbouring user turn (templates that reject them)")

    def score(self, model_type: str | None, architectures: list[str], name: str, template: str) -> int:
        """How well this family's rules match a model (0: not at all)."""
        d = self.detect
        if template and d.template_contains and not all(s in template for s in d.template_contains):
            return 0  # the template says otherwise
        if d.template_required and not template:
            return 0  # without the template, the config is its base's: the base's family decides
        score = 0
        # A name is the most specific evidence (a fine-tune keeps its base's model_type).
        if any(re.search(p, name, re.IGNORECASE) for p in d.name_patterns):
            score += 16
        if model_type and model_type in d.model_types:
            score += 8
        if set(architectures) & set(d.architectures):
            score += 4
        if template and d.template_contains:
            score += 2  # a fingerprint match alone beats the default family
        return score


class FamilyError(ValueError):
    """A family file that does not validate, or an unknown family id; the message says which."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_families(*directories: Path) -> dict[str, Family]:
    """Every family file in ``directories``, validated, with ``extends`` applied."""
    raw: dict[str, dict[str, Any]] = {}
    for path in [p for d in directories or (FAMILY_DIR,) for p in sorted(d.glob("*.toml"))]:
        with path.open("rb") as f:
            table = tomllib.load(f)
        table.setdefault("name", path.stem)
        raw[table["name"]] = table
    families: dict[str, Family] = {}
    errors: list[str] = []

    def build(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
        table = raw[name]
        parent = table.get("extends")
        if parent is None:
            return table
        if parent not in raw or parent in seen:
            errors.append(f"family {name!r}: extends {parent!r}, which is {'a cycle' if parent in seen else 'unknown'}")
            return table
        return _merge({k: v for k, v in build(parent, (*seen, name)).items() if k not in ("name", "description")}, table)

    for name in raw:
        try:
            family = Family.model_validate(build(name))
        except ValidationError as exc:
            errors += [f"family {name!r}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            continue
        if family.tools.parser not in TOOL_PARSERS:
            errors.append(f"family {name!r}: tools.parser {family.tools.parser!r} is unknown; "
                          f"valid: {', '.join(sorted(TOOL_PARSERS))}")
        elif (problem := tool_options_problem(family.tools.parser, family.tools.options)) is not None:
            errors.append(f"family {name!r}: tools.options: {problem}")
        if family.reasoning.parser not in REASONING_PARSERS:
            errors.append(f"family {name!r}: reasoning.parser {family.reasoning.parser!r} is unknown; "
                          f"valid: {', '.join(sorted(REASONING_PARSERS))}")
        elif (problem := reasoning_options_problem(family.reasoning.parser, family.reasoning.options)) is not None:
            errors.append(f"family {name!r}: reasoning.options: {problem}")
        families[name] = family
    if errors:
        raise FamilyError("; ".join(errors))
    if "default" not in families:
        families["default"] = Family(name="default", description="no tool or reasoning markup")
    return families


def family_dirs() -> list[Path]:
    """The built-in family directory, then any in ``$FLOW_FAMILY_PATH`` (later files win)."""
    extra = [Path(p) for p in os.environ.get("FLOW_FAMILY_PATH", "").split(os.pathsep) if p]
    return [FAMILY_DIR, *extra]


@lru_cache(maxsize=1)
def builtin_families() -> dict[str, Family]:
    """Every family the server knows (cached; ``builtin_families.cache_clear()`` re-reads)."""
    return load_families(*family_dirs())


def model_facts(path: Path) -> tuple[str | None, list[str]]:
    """``model_type`` and ``architectures`` from a model directory's config.json."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None, []
    return config.get("model_type"), list(config.get("architectures") or [])


def template_text(template: object) -> str | None:
    """A chat template as one text to look for markers in. Repositories may ship named templates (Hermes 3:
    ``default`` and ``tool_use``, which transformers picks when tools are passed): transformers then gives a
    mapping, tokenizer_config.json a list of ``{"name", "template"}``; the fingerprint is in all of them."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, Mapping):
        texts = [t for t in template.values() if isinstance(t, str)]
        return "\n".join(texts) if texts else None
    return None


def resolve_family(choice: str, path: Path, name: str, template: object,
                   families: dict[str, Family] | None = None) -> Family:
    """The family for a model: ``choice`` if it names one, else the best-scoring match (``template``: the
    model's chat template, text or named templates)."""
    families = families if families is not None else builtin_families()
    if choice != "auto":
        if choice not in families:
            raise FamilyError(f"unknown family {choice!r}; known: auto, {', '.join(sorted(families))}")
        return families[choice]
    model_type, architectures = model_facts(path)
    best, best_key = families["default"], (0, 0)
    for family in families.values():
        score = family.score(model_type, architectures, f"{name} {path}", template_text(template) or "")
        key = (score, family.detect.priority)
        if score > 0 and key > best_key:
            best, best_key = family, key
    return best
