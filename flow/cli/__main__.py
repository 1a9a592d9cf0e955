"""``python -m flow.cli``: the ``flow`` command."""

from flow.cli.main import run

run()
