"""Request contents built to cost the server as much as possible for their size, for the hardening tests.

``shared_stream_pdf``: a PDF whose pages all draw one zlib-compressed content stream of thousands of text
operators — a few KB that pypdf needs a minute of CPU to read (pages and bytes do not bound its cost).
``empty_fields_form``: a multipart form of hundreds of thousands of empty fields.
"""

from __future__ import annotations

import zlib


def pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of ``objects`` (numbered from 1; object 1 is the catalog), offsets and xref computed."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def shared_stream_pdf(pages: int = 100, operators: int = 4000) -> bytes:
    """``pages`` pages sharing one compressed content stream of ``operators`` text-showing operators."""
    content = b"BT /F1 9 Tf 72 700 Td " + b"(word) Tj 1 0 Td " * operators + b"ET"
    stream = zlib.compress(content, 9)
    kids = " ".join(f"{4 + i} 0 R" for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode(),
               f"<< /Length {len(stream)} /Filter /FlateDecode >>\nstream\n".encode() + stream + b"\nendstream"]
    font = 4 + pages
    objects += [f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R "
                f"/Resources << /Font << /F1 {font} 0 R >> >> >>".encode() for _ in range(pages)]
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    return pdf_file(objects)


def empty_fields_form(fields: int = 350_000, boundary: str = "hostileboundary") -> tuple[bytes, str]:
    """A multipart body of ``fields`` empty fields, and its Content-Type."""
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="f"\r\n\r\n\r\n'.encode()
    return part * fields + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"
