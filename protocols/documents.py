"""Documents a client attaches, as text the model reads — one way for every protocol.

Anthropic ``document`` blocks (``text``, ``base64`` and ``content`` sources), OpenAI Chat ``file`` parts and
Responses ``input_file`` items (``file_data`` as a ``data:`` URL) all come here. Plain-text types are decoded as
UTF-8; PDFs are converted to text with pypdf, within limits (size, pages); anything else — a URL or a file id
this server cannot fetch, another media type, a broken or encrypted PDF — is a 400 that names what is accepted.
The text goes into the message inside ``<document>`` tags, with its title and context when the client gave them.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
from collections.abc import Callable
from contextvars import ContextVar
from html import escape

from protocols.errors import ApiError

MAX_DOCUMENT_BYTES = 32 * 1024 * 1024  # Anthropic's request limit: a bigger document could not arrive anyway
MAX_PDF_PAGES = 100  # as Anthropic's PDF support
# Pages and bytes do not bound a PDF's cost (pages may share one content stream of thousands of operators):
# the documents of one request get this much CPU time, in all, to be read.
PDF_CPU_SECONDS = 10.0
TEXT_TYPES = ("text/plain", "text/markdown", "text/csv", "text/html", "text/xml", "application/json",
              "application/xml", "application/x-yaml", "text/x-python")
ACCEPTED = "plain text (text/*, JSON, XML, YAML) or application/pdf, inline (base64 or a data: URL)"
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)

logging.getLogger("pypdf").setLevel(logging.ERROR)  # pypdf warns about every quirk of real-world files

MEDIA_MARKER = "[{kind} omitted: this model reads text only]"


def media_marker(kind: str) -> str:
    """What stands in a message's text for an image (or audio) the served model cannot read. Every protocol
    writes the same marker; an image in the message a request asks about now is refused instead (chat.prepare,
    naming the models that read images), one sent earlier in the conversation keeps the agent going."""
    return MEDIA_MARKER.format(kind=kind)


def render(text: str, title: str | None = None, context: str | None = None) -> str:
    """A document as the model sees it."""
    head = f'<document title="{escape(title)}">' if title else "<document>"
    body = f"{context.strip()}\n\n{text.strip()}" if context and context.strip() else text.strip()
    return f"{head}\n{body}\n</document>"


def decode_base64(data: str, where: str) -> bytes:
    if len(data) * 3 // 4 > MAX_DOCUMENT_BYTES:
        raise ApiError("request_too_large", f"'{where}' is larger than {MAX_DOCUMENT_BYTES // 2**20} MiB.",
                       param=where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("invalid_request", f"'{where}' is not valid base64.", param=where) from None


def from_data_url(url: str, where: str) -> tuple[str, bytes]:
    """A ``data:`` URL's media type and bytes."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ApiError("invalid_request", f"'{where}' must be a data: URL (data:MEDIA_TYPE;base64,...); files are "
                       f"not fetched. Accepted: {ACCEPTED}.", param=where)
    payload = url[match.end():]
    media_type = (match.group("type") or "text/plain").lower()
    if match.group("b64"):
        return media_type, decode_base64(payload, where)
    from urllib.parse import unquote_to_bytes

    return media_type, unquote_to_bytes(payload)


def file_text(media_type: str, data: bytes, where: str, filename: str | None = None) -> str:
    """The text of an attached file of ``media_type``."""
    media_type = media_type.split(";")[0].strip().lower()
    if media_type == "application/octet-stream" and filename:
        media_type = _guess(filename)
    if media_type == "application/pdf":
        return pdf_text(data, where)
    if media_type.startswith("text/") or media_type in TEXT_TYPES:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError("invalid_request", f"'{where}' is not UTF-8 text.", param=where) from None
    raise ApiError("invalid_request", f"'{where}' is {media_type}; documents may be {ACCEPTED}.", param=where)


def _guess(filename: str) -> str:
    import mimetypes

    return mimetypes.guess_type(filename)[0] or "application/octet-stream"


class NeedsWorker(Exception):
    """Raised by the reader a decode on the event loop sets: this request carries work that must run elsewhere
    (a PDF), so its decoder starts again on a worker thread. Decoding is pure, so starting again is safe."""


PdfReader = Callable[[bytes, str], str]
# How this decode reads a PDF's text: unset, in this thread (tools, tests); the server sets a reader that
# runs each PDF in a child process within the request's CPU budget, or one that raises NeedsWorker.
pdf_reader: ContextVar[PdfReader | None] = ContextVar("pdf_reader", default=None)


def pdf_text(data: bytes, where: str) -> str:
    """A PDF's text, page by page, by the reader this decode has: a 400 for a file that is not a readable
    PDF, a 413 for one that is too big."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ApiError("request_too_large", f"'{where}' is larger than {MAX_DOCUMENT_BYTES // 2**20} MiB.",
                       param=where)
    return (pdf_reader.get() or extract_pdf_text)(data, where)


def extract_pdf_text(data: bytes, where: str) -> str:
    """The text of a PDF with pypdf, here and now: call it through :func:`pdf_text`."""
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            raise ApiError("invalid_request", f"'{where}' is an encrypted PDF; send it decrypted.", param=where)
        if len(reader.pages) > MAX_PDF_PAGES:
            raise ApiError("invalid_request", f"'{where}' has {len(reader.pages)} pages; at most {MAX_PDF_PAGES} "
                           "are read.", param=where)
        pages = [page.extract_text() or "" for page in reader.pages]
    except ApiError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        raise ApiError("invalid_request", f"'{where}' is not a readable PDF ({type(exc).__name__}: "
                       f"{str(exc)[:120]}).", param=where) from None
    return "\n\n".join(text.strip() for text in pages if text.strip())


def attached_file(file_data: str | None, filename: str | None, where: str, *, has_reference: bool) -> str:
    """An OpenAI ``file`` part or Responses ``input_file`` item as rendered text: ``file_data`` (a data: URL, or
    bare base64 with a ``filename`` saying its type); a ``file_id`` or ``file_url`` cannot be read here."""
    if not file_data:
        what = "a file_id or file_url" if has_reference else "no file_data"
        raise ApiError("invalid_request", f"'{where}' has {what}: this server has no file store and fetches no "
                       f"URLs; send the file inline as file_data. Accepted: {ACCEPTED}.", param=where)
    if file_data.startswith("data:"):
        media_type, data = from_data_url(file_data, f"{where}.file_data")
    else:
        media_type, data = _guess(filename or ""), decode_base64(file_data, f"{where}.file_data")
    return render(file_text(media_type, data, where, filename), title=filename)
