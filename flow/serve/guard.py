"""Who may talk to the server: Host and Origin on loopback binds, content type, the API key.

Theory of operation
-------------------
A server on 127.0.0.1 is reachable by every web page the user opens: a page can
POST to it (a "simple" cross-site request needs no CORS preflight when its body
is ``text/plain`` or form data) and, through DNS rebinding, even read its
answers under a hostile name (Ollama's CVE-2024-28224). So, by default:

* on a loopback bind only loopback ``Host`` values (``localhost``,
  ``127.x.x.x``, ``[::1]``, any port) and the configured ``allowed_hosts`` are
  served — a rebinding page's requests carry its own host name;
* a request with an ``Origin`` that is not a loopback origin (or allowed) is
  refused — browsers send one on every cross-site POST;
* a POST body must be JSON (``application/json``): what a page can send without
  a preflight is never that. A route whose entry stage takes file uploads (the
  audio transcription routes: ``multipart/form-data``, as the OpenAI SDK sends
  them) accepts that type too, on that route only; browsers send an ``Origin``
  with every cross-site form post, which the check above refuses;
* with an API key, every route but ``/health`` and public pages needs it
  (``x-api-key`` or ``Authorization: Bearer``), compared in constant time. A
  public page is a route whose entry stage says so (the console's shell: static
  HTML holding no server data, which asks the user for the key and sends it on
  every call it makes).

Servers bound to other addresses (``--host 0.0.0.0``) are meant to be reached by
name from elsewhere: they check the key, not the host.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from protocols.errors import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
UNGUARDED_PATHS = frozenset({"/health"})  # readiness probes carry no key
JSON_BODIES = frozenset({"application/json"})


@functools.lru_cache(maxsize=256)  # per request, and clients name few hosts (a bounded cache: a client cannot grow it)
def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, without port) is this machine's loopback."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a ``Host`` header value (``name:port``, ``[v6]:port``)."""
    value = value.strip()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """The checks for one server: its bind address, allowed hosts and API key."""

    def __init__(self, bind_host: str, allowed_hosts: Iterable[str] = (), api_key: str | None = None) -> None:
        self.check_host = is_loopback(bind_host)
        self.allowed = frozenset(h.lower().rstrip(".") for h in allowed_hosts)
        self.api_key = api_key

    def _allowed(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        return is_loopback(name) or name in self.allowed

    def check(self, method: str, path: str, headers: dict[str, str], public: bool = False,
              body_types: frozenset[str] = JSON_BODIES) -> None:
        """Raise the :class:`ApiError` a request gets before anything else happens to it. ``public``: the
        path is a public page (no key needed; host and origin are still checked). ``body_types``: the content
        types the route of ``path`` takes."""
        if self.check_host:
            host = host_name(headers.get("host", ""))
            if not self._allowed(host):
                raise ApiError("permission", f"Host {host!r} is not allowed: this server listens on a loopback "
                               "address and answers only to localhost names (add others to server.allowed_hosts).")
            origin = headers.get("origin")
            if origin and origin != "null" and not self._allowed(urlsplit(origin).hostname or ""):
                raise ApiError("permission", f"Origin {origin!r} is not allowed: web pages from other sites may "
                               "not call this server (add the host to server.allowed_hosts).")
            if origin == "null":  # sandboxed frames and file:// pages
                raise ApiError("permission", "Requests from opaque ('null') origins are not allowed.")
        if self.api_key is not None and path not in UNGUARDED_PATHS and not public and not self.key_ok(headers):
            raise ApiError("authentication", "Invalid or missing API key; send it as 'x-api-key: KEY' or "
                           "'Authorization: Bearer KEY'.")
        bodiless = headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
        if method == "POST" and not (bodiless and "content-type" not in headers):  # e.g. POST /admin/reload
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind not in body_types:
                wanted = ("JSON with 'Content-Type: application/json'" if body_types == JSON_BODIES else
                          "sent as " + " or ".join(f"'Content-Type: {t}'" for t in sorted(body_types)) + f" on {path}")
                raise ApiError("unsupported_media_type", f"POST bodies must be {wanted} (got "
                               f"{kind or 'no content type'!r}).")

    def key_ok(self, headers: dict[str, str]) -> bool:
        assert self.api_key is not None
        given = headers.get("x-api-key")
        auth = headers.get("authorization", "")
        if given is None and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())
