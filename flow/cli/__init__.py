"""The ``flow`` command (``main``), with what only the command needs: ``flow bench`` (``bench``),
``flow probe`` (``probe``) and the OpenBLAS preload (``blas``; ``eval "$(python -m flow.cli.blas)"``).

May import everything; nothing imports it.
"""
