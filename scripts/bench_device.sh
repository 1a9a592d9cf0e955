#!/usr/bin/env bash
# The device benchmarks of docs/benchmarks.md in one command, on whatever accelerator MLX sees (CUDA on Linux
# with mlx[cuda], Metal on a Mac, else the CPU), writing one markdown file:
#
#   scripts/bench_device.sh                     # tiny:bench-80m, under 8 minutes; writes bench-device.md
#   scripts/bench_device.sh --out FILE --model tiny:PRESET-or-DIR
#   scripts/bench_device.sh --quick             # a smoke run of every step (the tiny model, small loads)
#
# Steps, each under its own time limit (a step that fails or runs out of time is reported, the rest still run):
#   1. flow bench: single-stream decode, raw mlx-lm against the server;
#   2. scripts/bench_concurrency.py at 1/8/32/64 streams: flow, mlx_lm.server, flow's engine alone, raw batch_generate;
#   3. scripts/bench_pipeline.py: flow's own CPU per token (generate.echo, every chat protocol): the host's
#      figure beside the device's;
#   4. scripts/bench_prefix.py: an agent's conversation with and without the prefix cache.
# The file names the device, the host's CPUs, MLX's version and the commit measured.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
OUT=bench-device.md
MODEL=tiny:bench-80m
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bench_device: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# OpenBLAS speeds MLX's CPU work on Linux; elsewhere the helper prints nothing.
eval "$("$PY" -m flow.cli.blas 2>/dev/null || true)"

if [ "$QUICK" = 1 ]; then
  [ "$MODEL" = tiny:bench-80m ] && MODEL=tiny:tiny-qwen3
  BENCH=(--max-tokens 32 --rounds 1)
  CONCURRENCY=(--levels 1,8 --max-tokens 16 --systems flow,mlx_lm.server,raw)
  PIPELINE=(--quick --protocols openai,anthropic --modes stream)
  PREFIX=(--turns 2 --system-tokens 300 --answer-tokens 8 --no-mlx-lm)
  LIMITS=(120 240 240 240)
else
  BENCH=(--max-tokens 128 --rounds 3)
  CONCURRENCY=(--levels 1,8,32,64 --max-tokens 64 --systems flow,mlx_lm.server,engine,raw)
  PIPELINE=(--levels 1,8,64,256 --min-tokens 10000)
  PREFIX=(--turns 6)
  LIMITS=(75 150 135 100)  # seconds: 7.7 minutes at most, with the servers' starts
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/flow-bench-device-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

DEVICE=$("$PY" - <<'EOF'
import mlx.core as mx
info = mx.device_info()
kind = "CUDA" if mx.cuda.is_available() else "Metal" if mx.metal.is_available() else "CPU"
print(f"{info.get('device_name', '?')} ({kind}, {mx.default_device()}), MLX {mx.__version__}")
EOF
)
STARTED=$(date +%s)

# step NAME LIMIT COMMAND...: its stdout (a markdown table) into the report, or what went wrong.
step() {
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS status=0
  echo "bench_device: $name (at most ${limit}s)" >&2
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$WORK/$name.md" 2>"$WORK/$name.log" || status=$?
  {
    echo "## $name"
    echo
    echo "\`$*\` ($((SECONDS - began)) s)"
    echo
    if [ "$status" = 0 ]; then
      cat "$WORK/$name.md"
    elif [ "$status" = 124 ] || [ "$status" = 130 ]; then
      echo "**Stopped at its time limit (${limit} s).** Its last lines:"
      echo; echo '```'; tail -n 15 "$WORK/$name.log"; echo '```'
    else
      echo "**Failed (exit $status).** Its last lines:"
      echo; echo '```'; tail -n 15 "$WORK/$name.log"; echo '```'
    fi
    echo
  } >>"$WORK/report.md"
}

step "flow bench" "${LIMITS[0]}" "$PY" -m flow.cli bench --model "$MODEL" "${BENCH[@]}"
step "concurrency" "${LIMITS[1]}" "$PY" scripts/bench_concurrency.py --model "$MODEL" "${CONCURRENCY[@]}"
step "pipeline" "${LIMITS[2]}" "$PY" scripts/bench_pipeline.py "${PIPELINE[@]}"
step "prefix cache" "${LIMITS[3]}" "$PY" scripts/bench_prefix.py --model "$MODEL" "${PREFIX[@]}"

{
  echo "# Device benchmarks: $DEVICE"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(nproc) CPUs ($(uname -sm)); model \`$MODEL\`;" \
       "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $((($(date +%s) - STARTED) / 60)) min" \
       "$((($(date +%s) - STARTED) % 60)) s in all$([ "$QUICK" = 1 ] && echo '; quick run')."
  echo
  cat "$WORK/report.md"
} >"$OUT"
echo "bench_device: wrote $OUT" >&2
