#!/usr/bin/env bash
# The first minute as a new user lives it: a fresh clone, `make serve`, and the time from the command to the first
# answer (a one-token completion polled every second) and to full speed (/health reports no program compiling).
#
#   bash benchmarks/first_minute.sh                  # pip's cache emptied too (a new machine)
#   KEEP_PIP_CACHE=1 bash benchmarks/first_minute.sh # pip's cache kept (only the program and model caches empty)
#   SERVE_ARGS="--max-model-len 32768" bash benchmarks/first_minute.sh
#   FIRST_ONLY=1 bash benchmarks/first_minute.sh      # stop at the first answer
#
# Prints the phases from `gemma-serve up`'s log (model files, worker SERVING, full speed) and the two times, in
# seconds from the command. Environment: WORK (default: a new temporary folder; removed after), PORT (default 18000),
# SERVE_ARGS (added to `make serve`), BRANCH (the branch to clone, for an A/B; default the checked-out one). Needs the package registry (pip) unless KEEP_PIP_CACHE holds every wheel.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-$(mktemp -d)}
PORT=${PORT:-18000}
export GEMMA_SERVE_CACHE="$WORK/cache"
[ -n "${KEEP_PIP_CACHE:-}" ] || export PIP_CACHE_DIR="$WORK/pip-cache"
git clone -q ${BRANCH:+-b "$BRANCH"} "$ROOT" "$WORK/clone" || exit 1
cd "$WORK/clone" || exit 1
ports=(--http-port "$PORT" --gateway-grpc-port $((PORT + 1)) --tokenizer-port $((PORT + 2)) --worker-port $((PORT + 3))
       --worker-metrics-port $((PORT + 4)))
t0=$(date +%s.%N)
setsid make serve SERVE_ARGS="${ports[*]} ${SERVE_ARGS:-}" > "$WORK/serve.log" 2>&1 &
pid=$!
since() { python3 -c "import sys,time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0"; }
first="" full=""
body='{"model":"gemma-3-270m","prompt":"Hello","max_tokens":1,"temperature":0}'
while kill -0 "$pid" 2>/dev/null; do
  if [ -z "$first" ] && curl -sf -o /dev/null -H 'content-type: application/json' -d "$body" \
       "http://127.0.0.1:$PORT/v1/completions"; then
    first=$(since); echo "first answer: $first s"
    [ -n "${FIRST_ONLY:-}" ] && break
  fi
  if [ -n "$first" ] && curl -sf "http://127.0.0.1:$PORT/health" | grep -q '"programs_compiling": *0'; then
    full=$(since); echo "full speed: $full s"; break
  fi
  [ "$(since | cut -d. -f1)" -gt 900 ] 2>/dev/null && { echo "gave up after 900 s"; break; }
  sleep 1
done
kill -INT -- -"$pid" 2>/dev/null; wait "$pid" 2>/dev/null
echo "--- phases (gemma-serve up's log)"
grep -E "installed|model files|prepar|SERVING|full speed|serving while|compiled [0-9]+ programs|early|weights loaded" "$WORK/serve.log" | cut -c1-200
[ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK"
