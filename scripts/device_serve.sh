#!/usr/bin/env bash
# The embedded model served from the accelerator over unix sockets, as on the TPU host (no TCP there): start
# `gemma-serve up --uds`, put the official clients through every door (scripts/socket_clients.py), run the agent
# fleet at the given sizes while the background compiles, then again once the worker is at full speed (every
# program compiled), stop the stack. Uses the venv scripts/device_check.sh installs (VENV) and its cache. The
# stack's milestones (ready, full speed) and the background's progress at each fleet's start and end are printed
# on stdout too, so that a caller that gets only stdout back can still tell which fleet ran beside the compile.
#
#   scripts/device_serve.sh [AGENTS...]        (default: 1 8 32)
#
# Environment: OUT (default .device/results: serve.log, clients.jsonl, fleet.json and fleet.txt (beside the
# background), fleet-full.json and fleet-full.txt (at full speed)), SECOND (0: no full-speed fleet), FULL_WAIT_S
# (default 400: how long to wait for full speed before giving the second fleet up), VENV (default
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
compiled() {  # the background's progress so far, from the worker's log lines
  echo "$1 at $((SECONDS - t0)) s: $(grep -c 'compiled in the background [0-9]' "$OUT/serve.log") programs compiled in the" \
    "background$(grep -q "full speed in [0-9]" "$OUT/serve.log" && echo ', full speed reached')"
}
fleet() {  # fleet NAME: one fleet run at every size, bracketed by the background's progress
  compiled "fleet $1 starts"
  # shellcheck disable=SC2086
  "$PY" benchmarks/agent_fleet.py --uds "$SOCKETS/api.sock" --agents "${AGENTS[@]}" $FLEET_ARGS \
    --json "$OUT/$1.json" | tee "$OUT/$1.txt" | grep -A8 "== overview"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  compiled "fleet $1 ends"
}
fleet fleet
if [ "${SECOND:-1}" != 0 ]; then
  deadline=$((SECONDS + ${FULL_WAIT_S:-400}))
  until grep -q "full speed in [0-9]" "$OUT/serve.log" || [ $SECONDS -ge $deadline ]; do
    kill -0 $up 2>/dev/null || { echo "gemma-serve up exited:"; tail -30 "$OUT/serve.log"; exit 1; }
    sleep 2
  done
  if grep -q "full speed in [0-9]" "$OUT/serve.log"; then
    fleet fleet-full
  else
    compiled "no full speed within FULL_WAIT_S=${FULL_WAIT_S:-400} s: no second fleet;"
    status=1
  fi
fi
grep -E "ready in|full speed in [0-9]|compiled [0-9]+ programs in" "$OUT/serve.log" | cut -c1-200
kill -TERM $up
wait $up
echo "stopped (up exit $?); the stack's log: $OUT/serve.log"
trap - EXIT
exit $status
