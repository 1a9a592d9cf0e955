"""Grammar compilers on flow's workload: a new JSON schema per request, on a real 151k-token vocabulary.

    .venv/bin/python scripts/bench_grammar_compilers.py --tokenizer DIR   # a model directory with tokenizer.json

For llguidance (flow's choice) and, when importable, outlines-core (``pip install outlines-core``): the time
to prepare the vocabulary (once per model), to compile a schema (once per request with a new schema), and,
for llguidance, to compute one step's mask. xgrammar is not measured here: its wheel requires torch and
triton (gigabytes, no use to an MLX server).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
     "required": ["city", "days"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "price": {"type": "number"}, "tags": {"type": "array", "items": {
            "type": "string"}}}, "required": ["name", "price"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "value": {"anyOf": [
        {"type": "integer"}, {"type": "string"}, {"type": "null"}]}, "when": {"type": "string", "format": "date"}},
     "required": ["kind", "value"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]},
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3}},
     "required": ["user", "roles"]},
]


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return (time.perf_counter() - started) * 1000, out


def bench_llguidance(tokenizer: Any) -> dict[str, Any]:
    import llguidance
    import llguidance.hf

    vocab_ms, ll = timed(lambda: llguidance.hf.from_tokenizer(tokenizer))
    compile_ms, masks_ms = [], []
    for schema in SCHEMAS:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        ms, matcher = timed(lambda: llguidance.LLMatcher(ll, grammar))
        assert not matcher.is_error(), matcher.get_error()
        compile_ms.append(ms)
        for token in tokenizer.encode('{"', add_special_tokens=False):
            masks_ms.append(timed(matcher.compute_bitmask)[0])
            matcher.consume_token(token)
    return {"vocabulary_ms": round(vocab_ms, 1), "compile_ms_median": round(statistics.median(compile_ms), 2),
            "compile_ms_max": round(max(compile_ms), 2), "mask_ms_median": round(statistics.median(masks_ms), 3)}


def outlines_vocabulary(tokenizer: Any) -> Any:
    """outlines-core's vocabulary built from the local tokenizer (its from_pretrained needs the hub): each
    token's text as it decodes, the end token left out."""
    from outlines_core import Vocabulary

    by_text: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != tokenizer.eos_token_id:
            by_text.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(token_id)
    return Vocabulary(tokenizer.eos_token_id, by_text)


def bench_outlines_core(tokenizer: Any) -> dict[str, Any] | None:
    try:
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    vocab_ms, vocabulary = timed(lambda: outlines_vocabulary(tokenizer))
    compile_ms = []
    for schema in SCHEMAS:
        regex = build_regex_from_schema(json.dumps(schema))
        compile_ms.append(timed(lambda: Index(regex, vocabulary))[0])
    return {"vocabulary_ms": round(vocab_ms, 1), "compile_ms_median": round(statistics.median(compile_ms), 1),
            "compile_ms_max": round(max(compile_ms), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a model directory with its tokenizer files")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"vocabulary: {len(tokenizer)} tokens; {len(SCHEMAS)} schemas")
    print("llguidance:  ", bench_llguidance(tokenizer))
    print("outlines-core:", bench_outlines_core(tokenizer) or "not installed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
