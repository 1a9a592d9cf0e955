"""The console: the live graph in a browser, served by the graph like any route.

Two stage types, both entry-and-exit in one (they answer by themselves):

* ``console.page`` (``GET /``): one self-contained HTML page — its style sheet
  and script are inlined from ``viz/static``, nothing is fetched from elsewhere.
  The page holds no server data, so it is public (``EntryStage.public``): a
  browser cannot send an API key when it opens a URL. The page's script asks
  for the key when the server wants one, keeps it in ``sessionStorage`` and
  sends it on every call it makes: the drawing, ``/stats/events``, the playground's
  ``/v1/chat/completions``.
* ``console.graph`` (``GET /console/graph.svg``): the live graph drawn by
  :func:`viz.svg.render_svg` — the drawing ``flow viz --format svg|html`` writes —
  with the ids the page's script fills with the ``/stats`` figures. Key-guarded like
  every route.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import TYPE_CHECKING, ClassVar

import trio
from pydantic import Field

from flow.graph.stage import Outbox, StageConfig
from protocols import openai_chat
from protocols.ir import HttpRequest, WireFrame
from stages.protocol import EndpointStage
from viz.svg import render_svg

if TYPE_CHECKING:
    from flow.graph.compiled import CompiledGraph

# The page runs only its own inline script and talks only to this server; no other site may frame it.
PAGE_HEADERS = (
    ("content-type", "text/html; charset=utf-8"),
    ("cache-control", "no-store"),
    ("content-security-policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
     "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
)
SVG_HEADERS = (("content-type", "image/svg+xml; charset=utf-8"), ("cache-control", "no-store"))


def _static(name: str) -> str:
    return files("viz").joinpath("static", name).read_text(encoding="utf-8")


class ConsolePageConfig(StageConfig):
    graph_path: str = Field(default="/console/graph.svg", description="where the console.graph stage answers")
    stats_feed_path: str = Field(default="/stats/events",
                                 description="the server's live figures: /stats as server-sent events")
    chat_path: str = Field(default="/v1/chat/completions", description="the playground's chat route (OpenAI)")
    models_path: str = Field(default="/v1/models", description="the model list the playground offers")
    library_path: str = Field(default="/library", description="the model library with fit (panel hidden if absent)")
    downloads_path: str = Field(default="/downloads", description="downloads: the library's pull button")
    # Each update is one frame the browser paints, on the machine that decodes: on a 2-core CPU a frame a second
    # takes about 2.5 % of decode speed, one every 2 s about half that (scripts/bench_console.py).
    update_seconds: float = Field(default=2.0, ge=0.2, le=60, description="how often the server sends the figures")


class ConsolePage(EndpointStage):
    type_name: ClassVar[str] = "console.page"
    monitoring_methods: ClassVar[frozenset[str]] = frozenset({"GET", "HEAD"})
    description = "the console: a page drawing the live graph, the model pool, recent requests and a playground"
    Config = ConsolePageConfig
    codec = openai_chat.ChatCodec
    public: ClassVar[bool] = True

    def setup(self) -> None:
        super().setup()
        config = self.config
        assert isinstance(config, ConsolePageConfig)
        settings = json.dumps(config.model_dump()).replace("<", "\\u003c")  # cannot close the script element
        self.page = (_static("console.html")
                     .replace("/*GRAPH_CSS*/", _static("graph.css"))
                     .replace("/*CONSOLE_CSS*/", _static("console.css"))
                     .replace("/*CONSOLE_CONFIG*/", settings)
                     .replace("/*CONSOLE_JS*/", _static("console.js"))).encode()

    async def run(self, inbox: trio.MemoryReceiveChannel[HttpRequest], outbox: Outbox[WireFrame]) -> None:
        async for _ in inbox:
            await outbox.send(WireFrame(self.page, headers=PAGE_HEADERS))


class ConsoleGraph(EndpointStage):
    type_name: ClassVar[str] = "console.graph"
    monitoring_methods: ClassVar[frozenset[str]] = frozenset({"GET", "HEAD"})
    description = "the graph this stage belongs to, drawn as SVG (what flow viz --format svg writes)"
    codec = openai_chat.ChatCodec

    def setup(self) -> None:
        super().setup()
        self.svg = b""

    def bind_graph(self, graph: CompiledGraph) -> None:
        self.svg = render_svg(graph).encode()

    async def run(self, inbox: trio.MemoryReceiveChannel[HttpRequest], outbox: Outbox[WireFrame]) -> None:
        async for _ in inbox:
            await outbox.send(WireFrame(self.svg, headers=SVG_HEADERS))
