"""Attached documents read the same way in every protocol, through the real server: Anthropic ``document``
blocks (text, base64 PDF, content sources), OpenAI Chat ``file`` parts and Responses ``input_file`` items become
the document's text in the prompt. The graph swaps ``generate`` for ``generate.echo``, so the answer is the user
message exactly as the model read it; bad documents are 400s in each protocol's own shape."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from flow.builtins import compile_tables
from tests.harness import RunningServer, running_server, tables_with_model


def make_pdf(pages: list[str]) -> bytes:
    """A minimal PDF with one line of Helvetica text per page (offsets computed, as a writer would)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{' '.join(f'{3 + 2 * i} 0 R' for i in range(len(pages)))}] "
               f"/Count {len(pages)} >>"]
    font = 3 + 2 * len(pages)
    for i, text in enumerate(pages):
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
                       f"/Resources << /Font << /F1 {font} 0 R >> >> >>")
        stream = f"BT /F1 18 Tf 72 700 Td ({text}) Tj ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
    objects.append("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


PDF = make_pdf(["The keeper lit the lamp", "Ships passed safely"])
PDF_B64 = base64.b64encode(PDF).decode()
PDF_TEXT = "The keeper lit the lamp\n\nShips passed safely"


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["stages"]["generate"]["type"] = "generate.echo"  # answers with the user message the model read
    with running_server(compile_tables(tables, "documents (test)")) as running:
        yield running


def messages_answer(server: RunningServer, content: list[dict[str, Any]]) -> str:
    answer = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).messages.create(
        model="tiny", max_tokens=600, messages=[{"role": "user", "content": content}])  # type: ignore[typeddict-item]
    return "".join(block.text for block in answer.content if block.type == "text")


def test_anthropic_documents_in_every_source(server: RunningServer) -> None:
    text_doc = {"type": "document", "title": "Log", "context": "From the keeper's desk.",
                "source": {"type": "text", "media_type": "text/plain", "data": "Lamp lit at dusk."}}
    assert messages_answer(server, [text_doc, {"type": "text", "text": "Summarize."}]) == (
        '<document title="Log">\nFrom the keeper\'s desk.\n\nLamp lit at dusk.\n</document>Summarize.')
    pdf_doc = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF_B64}}
    assert messages_answer(server, [pdf_doc]) == f"<document>\n{PDF_TEXT}\n</document>"
    content_doc = {"type": "document", "title": "Notes", "source": {"type": "content", "content": [
        {"type": "text", "text": "First note."}, {"type": "text", "text": "Second note."}]}}
    assert messages_answer(server, [content_doc]) == '<document title="Notes">\nFirst note.\nSecond note.\n</document>'


def test_openai_chat_file_parts(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    content: Any = [{"type": "file", "file": {"filename": "story.pdf",
                                              "file_data": f"data:application/pdf;base64,{PDF_B64}"}},
                    {"type": "text", "text": "What happened?"}]
    answer = client.chat.completions.create(model="tiny", max_tokens=600, messages=[{"role": "user", "content": content}])
    assert answer.choices[0].message.content == f'<document title="story.pdf">\n{PDF_TEXT}\n</document>What happened?'
    with pytest.raises(openai.BadRequestError, match="file_id"):
        client.chat.completions.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "file", "file": {"file_id": "file-abc"}}]}])  # type: ignore[list-item]


def test_responses_input_files(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    notes = base64.b64encode(b"# Notes\nThe fog came in.").decode()
    answer = client.responses.create(model="tiny", max_output_tokens=600, input=[{"role": "user", "content": [
        {"type": "input_file", "filename": "notes.md", "file_data": f"data:text/markdown;base64,{notes}"},
        {"type": "input_text", "text": "And?"}]}])
    assert answer.output_text == '<document title="notes.md">\n# Notes\nThe fog came in.\n</document>And?'
    with pytest.raises(openai.BadRequestError, match="file_url"):
        client.responses.create(model="tiny", max_output_tokens=10, input=[{"role": "user", "content": [
            {"type": "input_file", "file_url": "https://example.com/a.pdf"}]}])


@pytest.mark.parametrize(("source", "message"), [
    ({"type": "url", "url": "https://example.com/a.pdf"}, "never by URL"),
    ({"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(b"%PDF-1.4 broken").decode()},
     "not a readable PDF"),
    ({"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(
        make_pdf([f"page {i}" for i in range(101)])).decode()}, "at most 100"),
    ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"\x89PNG").decode()}, "application/pdf"),
    ({"type": "base64", "media_type": "application/pdf", "data": "not base64!"}, "not valid base64"),
])
def test_bad_documents_are_400s_naming_the_problem(server: RunningServer, source: dict[str, Any],
                                                   message: str) -> None:
    answer = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 10,
        "messages": [{"role": "user", "content": [{"type": "document", "source": source}]}]})
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["type"] == "error" and message in body["error"]["message"], body
    assert httpx.get(server.base_url + "/health", timeout=10).json()["status"] == "ok"
