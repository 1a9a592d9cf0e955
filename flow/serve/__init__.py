"""The HTTP shell over a live graph.

Lives here: the live graph and its reload by diff (``live``), the server and its lifecycle (``server``,
``lifecycle``), a run's exit to the connection (``exit``), the graph's HTTP routes served from ASGI
(``graph_routes``), admission pacing (``pacing``), the quart-trio app for the shell's own routes (``http``),
hypercorn's changes (``hypercorn_fixes``), WebSocket, health, stats
and metrics (``observe``, ``stats_feed``, ``loop_watch``), the host and key guard (``guard``), and a server
in a thread for tests and benchmarks (``embedded``).

Never imports: ``flow.builtins`` or ``flow.cli``, nor any stage or resource type by name: it serves whatever
graph it is given. May import every layer below (``viz``, ``stages``, ``flow.resources``,
``flow.catalog``, ``flow.graph``, ``runtime``, ``protocols``).
"""
