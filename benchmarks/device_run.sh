#!/usr/bin/env bash
# The device benchmark in one run (sized for ~8 minutes on one H200): synthetic full-size Gemma 4 E2B checkpoints
# in bf16 and qat-w4a16-ct (scripts/make_synthetic_gemma4.py, ~10 GB and ~6.5 GB, written here), then
# benchmarks/decode_step.py and benchmarks/mixed_step.py on each at B = 1, 8, 32 with an 8K context, collected in
# one markdown file.
#
#   bash benchmarks/device_run.sh
#
# Steps: (1) a Python whose jax sees the GPU/TPU: $PYTHON, else .venv/bin/python, else python3, else
# `make install` plus the jax extra (`cuda`, or `tpu` on a TPU host; JAX_EXTRA overrides); (2) the checkpoints,
# written in parallel and kept for a rerun; (3) every program both benchmarks time compiled into JAX's persistent
# compilation cache by the four runs at once (`--compile-only`: compile time is most of a run; not on a TPU, which
# takes one process at a time), then (4) the four measured runs one after another (each loads its programs from
# the cache), each appending its table; (5) if 2 minutes are left, speculation on / off by turn type on the embedded
# model (benchmarks/speculation_turns.py --compare-off).
#
# Environment: OUT (results: device_bench.md, the runs' JSON, device_run.log; default $WORK/results), WORK
# (checkpoints and compilation cache, ~17 GB free needed; default /tmp/gemma-serve-device), TP (tensor-parallel
# degree, default 1), DEADLINE (seconds for the whole run, default 540: a phase that would pass it is cut short).
# For a dry run of this script on a CPU: ALLOW_CPU=1 SYNTHETIC_ARGS="--layers 10 --hidden 256 --vocab 4096"
# BATCHES="1 2" CONTEXT=1024 (the checkpoint overrides and the grid; defaults: none, "1 8 32", 8192).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-/tmp/gemma-serve-device}
OUT=${OUT:-$WORK/results}
TP=${TP:-1}
DEADLINE=${DEADLINE:-540}
BATCHES=${BATCHES:-1 8 32}
CONTEXT=${CONTEXT:-8192}
read -r -a SYNTHETIC <<<"${SYNTHETIC_ARGS:-}"
mkdir -p "$WORK" "$OUT"
LOG=$OUT/device_run.log
REPORT=$OUT/device_bench.md
: >"$LOG"

log() { printf '[%s +%3ds] %s\n' "$(date +%T)" "$SECONDS" "$*" | tee -a "$LOG"; }
left() { local s=$((DEADLINE - SECONDS - ${1:-0})); echo $((s > 30 ? s : 30)); }  # seconds, at least 30
die() { log "FAILED: $*"; exit 1; }

# ----- (1) Python -------------------------------------------------------------------------------------------------
# Prints the backend when the interpreter's jax runs on an accelerator and it has what the benchmarks import.
backend_of() {
  ALLOW_CPU=${ALLOW_CPU:-0} "$1" -c 'import os, jax, numpy, ml_dtypes, safetensors
b = jax.default_backend(); assert b != "cpu" or os.environ["ALLOW_CPU"] == "1"; print(b)' 2>/dev/null
}
PY=""
for candidate in ${PYTHON:-} "$ROOT/.venv/bin/python" python3; do
  if command -v "$candidate" >/dev/null 2>&1 && BACKEND=$(backend_of "$candidate"); then PY=$candidate; break; fi
done
if [ -z "$PY" ]; then
  if [ -z "${JAX_EXTRA:-}" ]; then
    if compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then JAX_EXTRA=tpu
    else JAX_EXTRA=cuda; fi
  fi
  log "no Python with an accelerator jax: make install, then the '$JAX_EXTRA' extra"
  make -C "$ROOT" install >>"$LOG" 2>&1 || die "make install (see $LOG)"
  "$ROOT/.venv/bin/python" -m pip install -q --no-compile -e "$ROOT[$JAX_EXTRA]" >>"$LOG" 2>&1 \
    || die "pip install -e '.[$JAX_EXTRA]' (see $LOG)"
  PY=$ROOT/.venv/bin/python
  BACKEND=$(backend_of "$PY") || die "jax in .venv does not see an accelerator"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Several processes share the GPU while compiling; each then takes only what it allocates.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$ROOT"
log "python $PY: jax $("$PY" -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)'), backend $BACKEND"

# ----- (2) checkpoints --------------------------------------------------------------------------------------------
FORMATS=(bf16 qat-w4a16-ct)
pids=()
for fmt in "${FORMATS[@]}"; do
  dir=$WORK/gemma4-e2b-$fmt
  if [ -f "$dir/config.json" ]; then log "reusing $dir"; continue; fi  # config.json is written last
  rm -rf "$dir"
  timeout "$(left)" "$PY" scripts/make_synthetic_gemma4.py "$dir" --format "$fmt" ${SYNTHETIC[@]+"${SYNTHETIC[@]}"} \
    >"$WORK/write-$fmt.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { cat "$WORK"/write-*.log >>"$LOG"; die "writing a checkpoint"; }; done
cat "$WORK"/write-*.log 2>/dev/null | grep '^wrote' | tee -a "$LOG"
log "checkpoints ready in $WORK"

# ----- (3) compile, (4) measure -----------------------------------------------------------------------------------
read -r -a B <<<"$BATCHES"
# --verify-tokens 8: each row also times a verify step (speculative decoding: the pending token and 7 drafts per
# row), so the table shows what checking drafts costs against a plain decode step on the device
DECODE=(benchmarks/decode_step.py --batches "${B[@]}" --kv "$CONTEXT" --steps 20 --verify-tokens 8)
# decode rows at 7900 + 7r (r < 32) and the 64-token chunk at 7900 (for 8192): every program reads the last bucket
MIXED=(benchmarks/mixed_step.py --batches "${B[@]}" --chunk 64 --position $((CONTEXT - 292)) --max-model-len "$CONTEXT"
       --iterations 10)
COMMON=(--cache-dir "$WORK/cache" --tensor-parallel "$TP")

run_bench() {  # NAME FORMAT SECONDS EXTRA_ARGS...: one benchmark on one checkpoint
  local name=$1 fmt=$2 seconds=$3; shift 3
  local args=("${DECODE[@]}")
  [ "$name" = mixed ] && args=("${MIXED[@]}")
  timeout "$seconds" "$PY" "${args[@]}" --model "$WORK/gemma4-e2b-$fmt" "${COMMON[@]}" "$@"
}

if [ "$BACKEND" != tpu ]; then  # a TPU takes one process at a time: there each measured run compiles its own
  log "compiling the programs of the 4 runs at once"
  pids=()
  for fmt in "${FORMATS[@]}"; do
    for name in decode mixed; do
      run_bench "$name" "$fmt" "$(left 150)" --compile-only >"$WORK/compile-$name-$fmt.log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || log "a compile run failed or ran out of time (its measured run compiles what is missing)"
  done
  for f in "$WORK"/compile-*.log; do
    cat "$f" >>"$LOG"
    log "$(basename "$f" .log): $(grep 'compiled in' "$f" || echo 'no programs compiled')"
  done
fi

{
  echo "# gemma-serve device benchmark: synthetic Gemma 4 E2B, decode and mixed steps"
  echo
  device=$("$PY" -c 'import jax; print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")')
  commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "$(date -u +%FT%TZ); $device; tensor parallel $TP; commit $commit."
  echo
} >"$REPORT"
status=0
for fmt in "${FORMATS[@]}"; do
  for name in decode mixed; do
    if [ $((DEADLINE - SECONDS)) -lt 30 ]; then log "SKIPPED $name $fmt: out of time"; status=1; continue; fi
    budget=$(left)
    log "measuring: $name step, $fmt"
    run_bench "$name" "$fmt" "$budget" --markdown "$REPORT" --json "$OUT/$name-$fmt.json" 2>&1 | tee -a "$LOG" \
      || { log "FAILED: $name $fmt"; status=1; }
  done
done
# ----- (5) speculation on and off on the device ---------------------------------------------------------------------
# The embedded Gemma 3 270M (synthetic weights draft nothing worth measuring): benchmarks/speculation_turns.py starts
# our stack with speculation auto, then off, and prints tok/s on / off, acceptance and whether the answers are the
# same, by turn type (tool calls, JSON, code echoed, chat). Skipped when less than 2 minutes are left.
if [ $((DEADLINE - SECONDS)) -ge 120 ]; then
  log "measuring: speculation on / off by turn type (embedded model)"
  {
    echo
    echo "## Speculation on / off by turn type (embedded Gemma 3 270M, one request at a time)"
    echo
    echo '```'
    timeout "$(left)" "$PY" benchmarks/speculation_turns.py --compare-off --variants 2 --startup-timeout "$(left 30)" \
      --ours-args "--num-slots 4" --json "$OUT/speculation-turns.json" 2>&1 | tee -a "$LOG" | sed -n '/^turn type/,$p'
    echo '```'
  } >>"$REPORT" || { log "FAILED: speculation on / off"; status=1; }
else
  log "SKIPPED speculation on / off: out of time"
fi
log "done: $REPORT"
cat "$REPORT"
exit $status
