#!/usr/bin/env bash
# On a lent GPU machine with no package index: install the wheels scripts/device_wheels.py prepared (every part
# carried so far, joined) into a folder of their own, then run scripts/bench_device.sh with the machine's python3.
# Arguments go to bench_device.sh. See docs/benchmarks.md, "On a lent GPU".
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=${DEVICE_SITE:-/tmp/flow-device-site}
parts=(.device-wheels/part*/wheels.tar.*)
if [ ! -e "${parts[0]}" ]; then
  echo "device_run: no .device-wheels/part*/wheels.tar.* here (carry them; scripts/device_wheels.py makes them)" >&2
  exit 2
fi
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
# The parts' names sort in the order they were cut (wheels.tar.000, .001, ...), whichever folder holds each.
printf '%s\n' "${parts[@]}" | sort -t/ -k3 | xargs cat | tar -x -C "$unpacked"
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$unpacked"/*.whl
# MLX's CUDA library looks for CUDA's (cuBLAS, NVRTC, cuDNN, NCCL, ...) beside its own package, in ../../nvidia,
# where pip puts the nvidia-* packages: the image has them in its own site-packages.
nvidia=$("$PY" -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
if [ -n "$nvidia" ]; then
  ln -sfn "$nvidia" "$SITE/nvidia"
else
  echo "device_run: no nvidia-* packages in $PY's environment: MLX's CUDA library may not find CUDA's" >&2
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF'
import mlx.core as mx
import flow.cli.main  # noqa: F401  (every package the server imports at its start resolves)
print(f"device_run: MLX {mx.__version__} on {mx.default_device()}", flush=True)
EOF
PYTHON="$PY" exec bash scripts/bench_device.sh "$@"
