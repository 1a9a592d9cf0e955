"""A request's images as pixels: inline bytes decoded, http(s) URLs fetched under the server's policy.

Theory of operation
-------------------
Protocol decoding only records where each image comes from (:class:`~protocols.ir.ImageSource`);
:func:`load_images` does the IO once a vision model is to read them. It counts the request's images against
``max_images`` first, then loads them all concurrently — fetching a URL and decoding bytes (off the trio thread:
a large PNG takes 100 ms of CPU) — and answers them in prompt order.

Fetching is off unless ``fetch_urls`` is set, and is SSRF-safe when it is on: only http and https, the host
resolved once and every address it resolves to checked (loopback, private, link-local, multicast, reserved and
unspecified addresses are refused unless the host is in ``allow_hosts``), the connection made to the address
that was checked (a second DNS answer cannot swap in an internal one), no redirects followed, no proxy taken
from the environment, a deadline over the whole fetch and a byte cap on the streamed body.

Every failure is an :class:`~protocols.errors.ApiError` (400) that says what happened and what the policy
allows.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocols.errors import ApiError
from protocols.images import DecodedImage, ImageLimits, MiB, declared_size, decode_image
from protocols.ir import ImageSource, Message

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_DEFAULT = ImageLimits()


class ImagePolicy(BaseModel):
    """What a server accepts as images: limits per image and per request, and whether (and from where) it
    fetches image URLs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(default=_DEFAULT.max_bytes, ge=1, description="bytes per image (encoded)")
    max_pixels: int = Field(default=_DEFAULT.max_pixels, ge=1, description="width × height per image")
    max_images: int = Field(default=_DEFAULT.max_images, ge=0, description="images per request")
    max_total_pixels: int = Field(default=_DEFAULT.max_total_pixels, ge=1,
                                  description="width × height of all of a request's images together")
    max_inflight_pixels: int = Field(default=400_000_000, ge=1,
                                     description="pixels being decoded and preprocessed across requests at once "
                                                 "(about 1.2 GB); more requests wait for room")
    fetch_urls: bool = Field(default=False, description="fetch http(s) image URLs (off: images must be inline)")
    allow_hosts: list[str] = Field(
        default_factory=list,
        description="hosts (and their subdomains) fetched from, optionally host:port; empty: any public host. "
                    "A host named here may resolve to a private or loopback address")
    fetch_timeout_seconds: float = Field(default=10.0, gt=0, description="deadline for one whole fetch")
    fetch_max_bytes: int = Field(default=_DEFAULT.max_bytes, ge=1,
                                 description="bytes read from a URL (default: max_bytes)")

    @model_validator(mode="before")
    @classmethod
    def _fetch_cap_follows_max_bytes(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fetch_max_bytes" not in data and "max_bytes" in data:
            return {**data, "fetch_max_bytes": data["max_bytes"]}
        return data

    @field_validator("allow_hosts")
    @classmethod
    def _hosts_not_urls(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if not host or "/" in host or "@" in host or host != host.strip():
                raise ValueError(f"{host!r} is not a host: write a name ('images.example.com', which also allows "
                                 "its subdomains), an address ('127.0.0.1') or either with a port ('127.0.0.1:8080')")
        return [host.lower().rstrip(".") for host in hosts]

    @property
    def limits(self) -> ImageLimits:
        return ImageLimits(max_bytes=self.max_bytes, max_pixels=self.max_pixels, max_images=self.max_images,
                           max_total_pixels=self.max_total_pixels)


class DecodedImages:
    """Recently decoded images by the digest of their encoded bytes, up to ``max_pixels`` pixels in all: an agent
    resends the same screenshot every turn, and decoding a large PNG costs more than the rest of the request's
    preparation. A hit is checked against the limits again (they are the caller's)."""

    def __init__(self, max_pixels: int = 64_000_000) -> None:
        self.max_pixels = max_pixels
        self._images: OrderedDict[bytes, DecodedImage] = OrderedDict()
        self._pixels = 0
        self._lock = threading.Lock()
        self.hits = 0

    def decode(self, data: bytes, limits: ImageLimits, where: str) -> DecodedImage:
        key = hashlib.sha256(data).digest()
        with self._lock:
            found = self._images.get(key)
            if found is not None:
                self._images.move_to_end(key)
        if (found is not None and len(data) <= limits.max_bytes
                and found.width * found.height <= limits.max_pixels):
            self.hits += 1
            return found
        image = decode_image(data, limits, where)
        with self._lock:
            if key not in self._images:
                self._images[key] = image
                self._pixels += image.width * image.height
            while self._pixels > self.max_pixels and self._images:
                _, old = self._images.popitem(last=False)
                self._pixels -= old.width * old.height
        return image


class PixelBudget:
    """Decoded pixels in flight across a stage's requests (decoding and preprocessing hold them): a request waits
    for room rather than many large ones together exhausting memory. Used from the trio thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._released = trio.Event()

    async def take(self, pixels: int) -> None:
        while self.used and self.used + pixels > self.limit:  # alone, a request always gets its pixels
            await self._released.wait()
        self.used += pixels

    def give(self, pixels: int) -> None:
        self.used -= pixels
        self._released.set()
        self._released = trio.Event()

    @asynccontextmanager
    async def reserve(self) -> AsyncIterator[Reservation]:
        """What one request takes, given back when it leaves the block (done, failed or cancelled)."""
        reservation = Reservation(self)
        try:
            yield reservation
        finally:
            self.give(reservation.taken)


class Reservation:
    """One request's share of a :class:`PixelBudget`."""

    def __init__(self, budget: PixelBudget) -> None:
        self.budget = budget
        self.taken = 0

    async def take(self, pixels: int) -> None:
        await self.budget.take(pixels)
        self.taken += pixels


async def load_images(messages: Sequence[Message], policy: ImagePolicy,
                      decoded: DecodedImages | None = None, budget: Reservation | None = None) -> list[DecodedImage]:
    """Every image of ``messages`` as RGB pixels, in prompt order (messages in order, each message's images in
    slot order). Errors name the image as ``messages[i].images[k]`` (positions in the request's IR). ``decoded``:
    recently decoded images to reuse; ``budget``: the request's share of the pixels in flight (all its images'
    header sizes, taken at once before any is decoded)."""
    found = [(f"messages[{m}].images[{k}]", source)
             for m, message in enumerate(messages) for k, source in enumerate(message.images)]
    if len(found) > policy.max_images:
        raise ApiError("invalid_request", f"The request holds {len(found)} images, more than this server's limit "
                       f"max_images = {policy.max_images}.", param="messages")
    urls = [(where, source.url) for where, source in found if source.data is None and source.url is not None]
    if urls and not policy.fetch_urls:  # refused before any decoding work
        raise _not_fetched(urls[0][1], urls[0][0])
    if not found:
        return []
    limits = policy.limits
    # Bytes first (inline, or fetched concurrently); then every header, so the request's pixels are counted and
    # taken from the budget at once (a request holding part of its share while waiting for more could deadlock
    # with another); then the decoding, concurrently, off the trio thread.
    datas: list[bytes] = [b""] * len(found)

    async def fetch(index: int, where: str, source: ImageSource, client: httpx.AsyncClient | None) -> None:
        if source.data is not None:
            datas[index] = source.data
        elif source.url is None:
            raise ApiError("invalid_request", f"'{where}' has neither bytes nor a URL.", param=where)
        else:
            assert client is not None  # fetching is on (checked above)
            datas[index] = await _fetch(client, source.url, policy, where)

    async with _client(policy) if urls else _NoClient() as client:
        await _each(found, lambda i, where, source: fetch(i, where, source, client))
    total = 0
    for (where, _), data in zip(found, datas):
        size = declared_size(data)  # the header only
        if size is not None:
            total += size[0] * size[1]
            if total > limits.max_total_pixels:
                raise ApiError("invalid_request", f"The request's images hold more than {limits.max_total_pixels} "
                               f"pixels together (max_total_pixels); send fewer or smaller images.", param=where)
    if budget is not None:
        await budget.take(total)
    results: list[DecodedImage | None] = [None] * len(found)
    decode = decode_image if decoded is None else decoded.decode

    async def decode_one(index: int, where: str, _: ImageSource) -> None:
        results[index] = await trio.to_thread.run_sync(decode, datas[index], limits, where)

    await _each(found, decode_one)
    return [image for image in results if image is not None]


async def _each(found: list[tuple[str, ImageSource]],
                work: Callable[[int, str, ImageSource], Awaitable[None]]) -> None:
    """``work`` on every image concurrently; the first 400 stops the others and is raised."""
    failures: list[ApiError] = []

    async def one(index: int, where: str, source: ImageSource, cancel: trio.CancelScope) -> None:
        try:
            await work(index, where, source)
        except ApiError as exc:
            failures.append(exc)
            cancel.cancel()  # one bad image fails the request: stop the others' work

    async with trio.open_nursery() as nursery:
        for index, (where, source) in enumerate(found):
            nursery.start_soon(one, index, where, source, nursery.cancel_scope)
    if failures:
        raise failures[0]


# --------------------------------------------------------------------------- fetching


class _NoClient:
    """Stands for the HTTP client when the request has no image URL."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _client(policy: ImagePolicy) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment would make the connection, not the checked address.
    # The deadline over the whole fetch (trio's) is the one that fires; httpx's own is a backstop.
    return httpx.AsyncClient(follow_redirects=False, trust_env=False,
                             timeout=httpx.Timeout(policy.fetch_timeout_seconds + 1),
                             # identity: images are compressed already, and a compressed body could hide its size
                             headers={"user-agent": "flow-server (image fetch)", "accept": "image/*",
                                      "accept-encoding": "identity"})


def _not_fetched(url: str, where: str) -> ApiError:
    return ApiError("invalid_request", f"'{where}' is an image URL ({_short(url)}), and this server "
                    "does not fetch image URLs (image policy: fetch_urls = false). Send the image inline: a data: "
                    "URL (data:image/png;base64,...) or base64.", param=where)


async def _fetch(client: httpx.AsyncClient, url: str, policy: ImagePolicy, where: str) -> bytes:
    """The body of ``url``, if the policy allows the host, within the deadline and the byte cap."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")
    if scheme not in ("http", "https") or not host:
        raise ApiError("invalid_request", f"'{where}' is not an http(s) URL with a host ({_short(url)}); only "
                       "http and https image URLs are fetched.", param=where)
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise ApiError("invalid_request", f"'{where}' has an invalid port ({_short(url)}).", param=where) from None
    listed = _allow_listed(host, port, policy.allow_hosts)
    if policy.allow_hosts and not listed:
        raise ApiError("invalid_request", f"'{where}': the host {host!r} is not one this server fetches images "
                       f"from (image policy allow_hosts: {', '.join(policy.allow_hosts)}).", param=where)
    try:
        request = client.build_request("GET", url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ApiError("invalid_request", f"'{where}' is not a valid URL ({exc}).", param=where) from None
    with trio.move_on_after(policy.fetch_timeout_seconds) as deadline:
        if not listed:
            address = await _public_address(host, port, where)
            request = _pinned(client, request, address, host, scheme)
        return await _read(client, request, policy.fetch_max_bytes, url, where)
    assert deadline.cancelled_caught
    raise ApiError("invalid_request", f"'{where}': fetching {_short(url)} took longer than "
                   f"{policy.fetch_timeout_seconds:g} s (image policy fetch_timeout_seconds).", param=where)


async def _read(client: httpx.AsyncClient, request: httpx.Request, cap: int, url: str, where: str) -> bytes:
    try:
        response = await client.send(request, stream=True)
        try:
            if response.is_redirect:
                raise ApiError("invalid_request", f"'{where}': {_short(url)} answered {response.status_code}, a "
                               f"redirect to {_short(response.headers.get('location', '?'))}; redirects are not "
                               "followed: send the image's final URL.", param=where)
            if response.status_code != 200:
                raise ApiError("invalid_request", f"'{where}': {_short(url)} answered HTTP {response.status_code}, "
                               "not 200 with an image.", param=where)
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise _too_big(url, where, cap, f"declares {declared} bytes")
            body = bytearray()
            async for chunk in response.aiter_bytes():  # counted as decoded, should a server compress anyway
                body += chunk
                if len(body) > cap:
                    raise _too_big(url, where, cap, "sent more")
            return bytes(body)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise ApiError("invalid_request", f"'{where}': {_short(url)} could not be fetched "
                       f"({type(exc).__name__}: {str(exc)[:120] or 'no detail'}).", param=where) from None


def _too_big(url: str, where: str, cap: int, what: str) -> ApiError:
    return ApiError("invalid_request", f"'{where}': {_short(url)} {what}; at most {cap} bytes "
                    f"({cap / MiB:.1f} MiB, image policy fetch_max_bytes) are read.", param=where)


def _allow_listed(host: str, port: int, allowed: list[str]) -> bool:
    """Whether ``host`` (at ``port``) is named by an entry: ``name`` (with its subdomains), an address, or
    either with ``:port``."""
    host = host.lower()
    for entry in allowed:
        name, entry_port = _split_entry(entry)
        if entry_port is not None and entry_port != port:
            continue
        name = name.lstrip(".")
        if host == name or (not _is_address(host) and host.endswith("." + name)):
            return True
    return False


def _split_entry(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port
        name, _, rest = entry[1:].partition("]")
        return name, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    name, colon, port = entry.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        return name, int(port)
    return entry, None


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _public_address(host: str, port: int, where: str) -> IPAddress:
    """The address to connect to for ``host``: every address it resolves to must be public."""
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ApiError("invalid_request", f"'{where}': the host {host!r} could not be resolved ({exc}).",
                           param=where) from None
        addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]
    for address in addresses:
        if _internal(address):
            raise ApiError("invalid_request", f"'{where}': the host {host!r} is (or resolves to) {address}, an "
                           "internal address (loopback, private, link-local, multicast, reserved or unspecified); "
                           "this server fetches those only from hosts named in its image policy allow_hosts.",
                           param=where)
    if not addresses:
        raise ApiError("invalid_request", f"'{where}': the host {host!r} resolves to no address.", param=where)
    return addresses[0]


def _internal(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        # An IPv4 address inside an IPv6 one reaches that IPv4 host.
        embedded = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
        if any(inner is not None and _internal(inner) for inner in embedded):
            return True
    return (address.is_loopback or address.is_private or address.is_link_local or address.is_multicast
            or address.is_reserved or address.is_unspecified or not address.is_global)


def _pinned(client: httpx.AsyncClient, request: httpx.Request, address: IPAddress, host: str,
            scheme: str) -> httpx.Request:
    """``request`` sent to the checked ``address``, still naming ``host`` (Host header, TLS SNI and certificate
    check), so that resolving the name again cannot lead somewhere else."""
    headers = request.headers.copy()
    headers["host"] = request.url.netloc.decode("ascii")
    extensions = {"sni_hostname": host} if scheme == "https" else {}
    return client.build_request("GET", request.url.copy_with(host=str(address)), headers=headers,
                                extensions=extensions)


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
