#!/usr/bin/env bash
# The test command: makes the virtual environment if needed, installs flow with its test extra,
# preloads OpenBLAS when the machine has it (much faster MLX on Linux CPUs), runs pytest on two workers
# (pytest-xdist; a file's tests stay together on one worker, so module fixtures start once; FLOW_TEST_WORKERS=0
# runs them in this process, as plain pytest does).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
eval "$(.venv/bin/python -m flow.cli.blas)"
exec .venv/bin/python -m pytest -n "${FLOW_TEST_WORKERS:-2}" --dist loadfile "$@"
