#!/usr/bin/env bash
# The test command: makes the virtual environment if needed, installs flow with its test extra,
# preloads OpenBLAS when the machine has it (much faster MLX on Linux CPUs), runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
eval "$(.venv/bin/python -m flow.cli.blas)"
exec .venv/bin/python -m pytest "$@"
