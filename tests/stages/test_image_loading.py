"""``stages.images.load_images``: inline images decoded in prompt order, URLs fetched from a real HTTP server on
127.0.0.1 under the policy (off by default, SSRF-safe, deadline, byte cap, no redirects)."""

from __future__ import annotations

import datetime
import io
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from PIL import Image

import stages.images
from protocols.errors import ApiError
from protocols.images import decode_image
from protocols.ir import IMAGE_SLOT, ImageSource, Message
from stages.images import ImagePolicy, load_images


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 100, 50)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, "PNG")
    return out.getvalue()


def user(*sources: ImageSource, text: str = "see") -> Message:
    return Message("user", text + IMAGE_SLOT * len(sources), images=sources)


@dataclass
class ImageServer:
    """A tiny HTTP/1.1 server: each path answers one way; it records the Host header of each request."""

    port: int
    hosts: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


CAT = png(8, 6)


async def answer(server: ImageServer, stream: trio.abc.Stream) -> None:
    head = b""
    with trio.move_on_after(5):
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(4096)
            if not data:
                return
            head += data
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1]
    server.hosts.extend(line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("host:"))
    status, headers, body = "200 OK", [("Content-Length", str(len(CAT)))], CAT
    if path == "/slow.png":
        await trio.sleep(0.5)
    elif path == "/stuck.png":
        await trio.sleep(30)
    elif path == "/missing.png":
        status, headers, body = "404 Not Found", [("Content-Length", "0")], b""
    elif path == "/moved.png":
        status, headers, body = "302 Found", [("Location", "/cat.png"), ("Content-Length", "0")], b""
    elif path == "/declared-big.png":
        headers, body = [("Content-Length", str(10 * len(CAT)))], CAT * 10
    elif path == "/streamed-big.png":  # no length: the cap must hold while reading
        headers, body = [("Transfer-Encoding", "chunked")], b"".join(
            b"%x\r\n%s\r\n" % (len(CAT), CAT) for _ in range(10)) + b"0\r\n\r\n"
    elif path == "/text.png":
        headers, body = [("Content-Length", "5")], b"hello"
    response = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "Connection: close\r\n\r\n"
    try:
        await stream.send_all(response.encode() + body)
        await stream.aclose()
    except trio.BrokenResourceError:
        pass  # the client gave up (a cap or a deadline), as it should


@pytest.fixture
async def server(nursery: trio.Nursery) -> ImageServer:
    # Loopback only; the test's nursery stops it when the test ends.
    running = ImageServer(port=0)
    listeners = await nursery.start(partial(trio.serve_tcp, partial(answer, running), 0, host="127.0.0.1"))
    running.port = listeners[0].socket.getsockname()[1]
    return running


def allowing(server: ImageServer, **policy: Any) -> ImagePolicy:
    return ImagePolicy(fetch_urls=True, allow_hosts=[f"127.0.0.1:{server.port}"], **policy)


async def refused(messages: list[Message], policy: ImagePolicy, *needles: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await load_images(messages, policy)
    assert caught.value.status == 400
    for needle in needles:
        assert needle in caught.value.message, caught.value.message
    return caught.value


# --------------------------------------------------------------------------- inline images, order, limits


async def test_inline_images_come_back_in_prompt_order() -> None:
    first, second, third = (ImageSource(data=png(w, 1)) for w in (1, 2, 3))
    messages = [Message("system", "s"), user(first, second), Message("assistant", "ok"), user(third)]
    assert [image.width for image in await load_images(messages, ImagePolicy())] == [1, 2, 3]
    assert await load_images([Message("user", "no images")], ImagePolicy()) == []


async def test_decoding_runs_off_the_trio_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread())
        return decode_image(*args)

    monkeypatch.setattr(stages.images, "decode_image", recording)
    await load_images([user(ImageSource(data=CAT))], ImagePolicy())
    assert threads and threads[0] is not threading.current_thread()


async def test_a_requests_images_together_are_limited_before_any_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[bytes] = []

    def recording(*args: Any) -> Any:
        decoded.append(args[0])
        return decode_image(*args)

    monkeypatch.setattr(stages.images, "decode_image", recording)
    big = png(300, 200)  # 60,000 pixels each
    policy = ImagePolicy(max_total_pixels=100_000)
    assert len(await load_images([user(ImageSource(data=big))], policy)) == 1
    decoded.clear()
    await refused([user(ImageSource(data=big), ImageSource(data=big))], policy, "max_total_pixels",
                  "100000 pixels together")
    assert len(decoded) <= 1  # the second image's header already said too much


async def test_image_limits_come_from_the_policy() -> None:
    many = [user(*(ImageSource(data=CAT) for _ in range(3)))]
    error = await refused(many, ImagePolicy(max_images=2), "3 images", "max_images = 2")
    assert error.param == "messages"
    await refused([user(ImageSource(data=CAT))], ImagePolicy(max_pixels=47), "messages[0].images[0]",
                  "max_pixels = 47")
    await refused([Message("s", "x"), user(ImageSource(data=CAT))],  # type: ignore[arg-type]
                  ImagePolicy(max_bytes=10), "messages[1].images[0]", "max_bytes = 10")
    await refused([user(ImageSource(data=b"not an image"))], ImagePolicy(), "PNG, JPEG, WebP")


def test_the_policy_is_checked_as_configuration() -> None:
    assert ImagePolicy(max_bytes=1000).fetch_max_bytes == 1000  # follows max_bytes unless set
    assert ImagePolicy(max_bytes=1000, fetch_max_bytes=50).fetch_max_bytes == 50
    assert ImagePolicy().fetch_urls is False and ImagePolicy().fetch_max_bytes == 20 * 2**20
    with pytest.raises(pydantic.ValidationError, match="fetch_url"):
        ImagePolicy(fetch_url=True)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError, match="is not a host"):
        ImagePolicy(allow_hosts=["https://images.example.com/"])


# --------------------------------------------------------------------------- fetching


async def test_fetching_is_off_by_default(server: ImageServer) -> None:
    await refused([user(ImageSource(url=server.url("/cat.png")))], ImagePolicy(), "fetch_urls = false", "data: URL")
    assert server.hosts == []


async def test_an_allow_listed_host_is_fetched(server: ImageServer) -> None:
    inline, fetched = ImageSource(data=png(2, 2)), ImageSource(url=server.url("/cat.png"))
    images = await load_images([user(inline, fetched)], allowing(server))
    assert [(i.width, i.height) for i in images] == [(2, 2), (8, 6)]
    assert images[1].digest == decode_image(CAT, ImagePolicy().limits, "x").digest
    # A host entry without a port allows every port.
    assert len(await load_images([user(fetched)], ImagePolicy(fetch_urls=True, allow_hosts=["127.0.0.1"]))) == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
async def test_loopback_is_refused_unless_allow_listed(server: ImageServer, host: str) -> None:
    """The SSRF guard: with fetching on and no allow list, an internal address is never fetched."""
    await refused([user(ImageSource(url=server.url("/cat.png", host)))], ImagePolicy(fetch_urls=True),
                  "internal address", "allow_hosts")
    assert server.hosts == []


@pytest.mark.parametrize("url", [
    "http://10.0.0.1/x.png", "http://192.168.1.1/x.png", "http://169.254.169.254/latest/meta-data",
    "http://[::1]/x.png", "http://[fe80::1]/x.png", "http://224.0.0.1/x.png", "http://0.0.0.0/x.png",
    "http://100.64.0.1/x.png", "http://240.0.0.1/x.png", "http://[2002:7f00:1::]/x.png", "http://[64:ff9b::7f00:1]/",
])
async def test_internal_addresses_are_refused_before_connecting(url: str) -> None:
    await refused([user(ImageSource(url=url))], ImagePolicy(fetch_urls=True, fetch_timeout_seconds=2),
                  "internal address")


async def test_a_host_outside_the_allow_list_is_refused(server: ImageServer) -> None:
    policy = ImagePolicy(fetch_urls=True, allow_hosts=["images.example.com", f"127.0.0.1:{server.port + 1}"])
    await refused([user(ImageSource(url=server.url("/cat.png")))], policy, "'127.0.0.1' is not one",
                  "images.example.com")
    await refused([user(ImageSource(url="https://example.com.evil.test/x.png"))], policy, "is not one")


async def test_names_are_resolved_checked_and_pinned(server: ImageServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A public-looking name is resolved once, every address checked, and the connection made to the checked
    address with the name in the Host header (a second DNS answer could not swap in an internal one)."""
    answers = fake_dns(monkeypatch, "127.0.0.1")
    url = server.url("/cat.png", "images.test")
    await refused([user(ImageSource(url=url))], ImagePolicy(fetch_urls=True), "resolves to) 127.0.0.1")
    answers[:] = ["93.184.215.14", "10.1.2.3"]  # one internal answer among public ones is enough to refuse
    await refused([user(ImageSource(url=url))], ImagePolicy(fetch_urls=True), "10.1.2.3")
    answers[:] = ["127.0.0.1"]
    loopback_is_public(monkeypatch)
    assert len(await load_images([user(ImageSource(url=url))], ImagePolicy(fetch_urls=True))) == 1
    assert server.hosts == [f"images.test:{server.port}"]
    assert answers.resolved.count("images.test") == 3  # once per fetch: the connection did not ask again


class Answers(list[str]):
    resolved: list[str]


def fake_dns(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> Answers:
    """``images.test`` resolves to ``addresses`` (changeable); every name asked for is recorded."""
    answers = Answers(addresses)
    answers.resolved = []

    async def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        answers.resolved.append(host)
        found = answers if host == "images.test" else [host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in found]

    monkeypatch.setattr(trio.socket, "getaddrinfo", resolve)
    return answers


def loopback_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend 127.0.0.1 is a public address, to see where a pinned connection goes and what it says."""
    real: Callable[[Any], bool] = stages.images._internal
    monkeypatch.setattr(stages.images, "_internal", lambda address: str(address) != "127.0.0.1" and real(address))


def certificates() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for ``images.test`` only, and a client context trusting its CA."""
    now = datetime.datetime.now(datetime.timezone.utc)
    span = (now - datetime.timedelta(days=1), now + datetime.timedelta(days=1))

    def issue(subject: str, key: ec.EllipticCurvePrivateKey, signer: ec.EllipticCurvePrivateKey, issuer: str,
              ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(span[0]).not_valid_after(span[1])
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = issue("test CA", ca_key, ca_key, "test CA", ca=True)
    leaf = issue("images.test", leaf_key, ca_key, "test CA", ca=False)
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as folder:
        cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
        cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        key.write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        server.load_cert_chain(cert, key)
    return server, client


async def test_https_to_a_pinned_address_still_checks_the_name(nursery: trio.Nursery,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Connecting to the checked address, TLS still names the host (SNI) and checks the certificate against it."""
    server_context, client_context = certificates()
    running = ImageServer(port=0)
    listeners = await nursery.start(partial(trio.serve_ssl_over_tcp, partial(answer, running), 0, server_context,
                                            host="127.0.0.1"))
    running.port = listeners[0].transport_listener.socket.getsockname()[1]
    fake_dns(monkeypatch, "127.0.0.1")
    loopback_is_public(monkeypatch)
    monkeypatch.setattr(httpx, "AsyncClient", partial(httpx.AsyncClient, verify=client_context))
    images = await load_images([user(ImageSource(url=f"https://images.test:{running.port}/cat.png"))],
                               ImagePolicy(fetch_urls=True))
    assert len(images) == 1 and running.hosts == [f"images.test:{running.port}"]


async def test_only_http_and_https_are_fetched() -> None:
    await refused([user(ImageSource(url="ftp://example.com/x.png"))], ImagePolicy(fetch_urls=True),
                  "only http and https")


async def test_a_fetch_past_the_deadline_is_a_400(server: ImageServer) -> None:
    with trio.fail_after(5):
        await refused([user(ImageSource(url=server.url("/stuck.png")))], allowing(server, fetch_timeout_seconds=0.3),
                      "longer than 0.3 s", "fetch_timeout_seconds")


async def test_the_byte_cap_holds_declared_or_not(server: ImageServer) -> None:
    policy = allowing(server, fetch_max_bytes=len(CAT) * 3)
    await refused([user(ImageSource(url=server.url("/declared-big.png")))], policy,
                  f"declares {10 * len(CAT)} bytes", f"at most {3 * len(CAT)} bytes", "fetch_max_bytes")
    await refused([user(ImageSource(url=server.url("/streamed-big.png")))], policy, "sent more",
                  "fetch_max_bytes")


async def test_other_answers_are_400s(server: ImageServer) -> None:
    await refused([user(ImageSource(url=server.url("/missing.png")))], allowing(server), "HTTP 404")
    await refused([user(ImageSource(url=server.url("/moved.png")))], allowing(server), "answered 302",
                  "redirects are not followed", "/cat.png")
    assert server.hosts.count(f"127.0.0.1:{server.port}") == 2  # the redirect's target was not asked for
    await refused([user(ImageSource(url=server.url("/text.png")))], allowing(server), "not an image")
    await refused([user(ImageSource(url=f"http://127.0.0.1:{server.port + 1 if server.port < 65535 else 1}/x"))],
                  ImagePolicy(fetch_urls=True, allow_hosts=["127.0.0.1"]), "could not be fetched")


async def test_several_urls_are_fetched_at_once(server: ImageServer) -> None:
    sources = [ImageSource(url=server.url("/slow.png")) for _ in range(4)]
    started = trio.current_time()
    images = await load_images([user(*sources)], allowing(server))
    assert len(images) == 4 and trio.current_time() - started < 1.5  # one after another: 2 s or more


async def test_one_failure_stops_the_others(server: ImageServer) -> None:
    sources = [ImageSource(url=server.url("/stuck.png")), ImageSource(url=server.url("/missing.png"))]
    started = trio.current_time()
    await refused([user(*sources)], allowing(server, fetch_timeout_seconds=20), "HTTP 404")
    assert trio.current_time() - started < 5


async def test_requests_wait_for_room_in_the_pixel_budget() -> None:
    from stages.images import PixelBudget

    budget = PixelBudget(100_000)
    big = [user(ImageSource(data=png(300, 200)))]  # 60,000 pixels
    order: list[str] = []

    async def request(name: str, hold: trio.Event) -> None:
        async with budget.reserve() as share:
            await load_images(big, ImagePolicy(), budget=share)
            order.append(f"{name} decoded")
            await hold.wait()
        order.append(f"{name} done")

    async def until(length: int) -> None:
        with trio.fail_after(10):
            while len(order) < length:
                await trio.sleep(0.01)

    first_done, second_done = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "first", first_done)
        await until(1)
        nursery.start_soon(request, "second", second_done)
        await trio.sleep(0.3)  # time enough to decode, had it room
        assert order == ["first decoded"] and budget.used == 60_000  # the second waits for room
        first_done.set()
        await until(3)
        assert order == ["first decoded", "first done", "second decoded"]
        second_done.set()
    assert budget.used == 0
    alone = PixelBudget(10)  # a request larger than the whole budget still runs when it is alone
    async with alone.reserve() as share:
        assert len(await load_images(big, ImagePolicy(), budget=share)) == 1
    assert alone.used == 0
