#!/usr/bin/env bash
# The embedded model served from the accelerator over unix sockets, as on the TPU host (no TCP there): start
# `gemma-serve up --uds`, put the official clients through every door (scripts/socket_clients.py), run the agent
# fleet at the given sizes, stop the stack. Uses the venv scripts/device_check.sh installs (VENV) and its cache.
#
#   scripts/device_serve.sh [AGENTS...]        (default: 1 8 32)
#
# Environment: OUT (default .device/results: serve.log, clients.jsonl, fleet.json, fleet.txt), VENV (default
# .device/venv), GEMMA_SERVE_CACHE (default .device/cache), SERVE_ARGS (more `up` flags; default
# "--num-slots 32 --max-model-len 4096"), FLEET_ARGS (more agent_fleet.py flags; default "--quick").
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/.device/results}"
VENV="${VENV:-$REPO/.device/venv}"
export GEMMA_SERVE_CACHE="${GEMMA_SERVE_CACHE:-$REPO/.device/cache}" PYTHONUNBUFFERED=1
SERVE_ARGS="${SERVE_ARGS:---num-slots 32 --max-model-len 4096}"
FLEET_ARGS="${FLEET_ARGS:---quick}"
AGENTS=("$@")
[ ${#AGENTS[@]} -eq 0 ] && AGENTS=(1 8 32)
mkdir -p "$OUT"
SOCKETS="$(mktemp -d /tmp/gs-XXXXXX)" || exit 1
SOCKETS="$SOCKETS/run"  # short: a socket path holds at most 107 bytes
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3

t0=$SECONDS
: > "$OUT/serve.log"  # emptied before the start: the wait below must not read an earlier run's "ready"
# shellcheck disable=SC2086
"$PY" -m gemma_serve.cli up --uds "$SOCKETS" $SERVE_ARGS > "$OUT/serve.log" 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up' EXIT
until grep -q "gemma-serve is ready" "$OUT/serve.log"; do
  kill -0 $up 2>/dev/null || { echo "gemma-serve up exited:"; tail -30 "$OUT/serve.log"; exit 1; }
  sleep 1
done
echo "ready after $((SECONDS - t0)) s: $(grep -m1 'gemma-serve is ready' "$OUT/serve.log")"
status=0
"$PY" scripts/socket_clients.py "$SOCKETS/api.sock" | tee "$OUT/clients.jsonl" || status=1
# shellcheck disable=SC2086
"$PY" benchmarks/agent_fleet.py --uds "$SOCKETS/api.sock" --agents "${AGENTS[@]}" $FLEET_ARGS \
  --json "$OUT/fleet.json" | tee "$OUT/fleet.txt" || status=1
kill -TERM $up
wait $up
echo "stopped (up exit $?); the stack's log: $OUT/serve.log"
trap - EXIT
exit $status
