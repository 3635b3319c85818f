#!/usr/bin/env bash
# The device benchmark in one run, ending with the targets' table: a synthetic full-size Gemma 4 E2B checkpoint
# (bf16, scripts/make_synthetic_gemma4.py, ~10 GB, written here and kept), then one process per phase (a TPU takes
# one process at a time), each phase's JSON in $OUT, and a table of every target against what was measured:
#
#   bash benchmarks/device_run.sh                          # every phase (~12 minutes on one TPU v5e, cold)
#   PHASES="decode int8" bash benchmarks/device_run.sh     # some phases; the table reads every JSON in $OUT
#
# Phases (PHASES, space-separated; default all, in this order):
#   decode      benchmarks/decode_step.py, bf16 weights, B = 1, 8, 32 at an 8K context, the worker's default
#               attention (`--attention-kernel auto`): step time and the fraction of the copy bandwidth, also
#               with each step dispatched before the last one's token reaches the host (`--ahead`), and the
#               serving loop's own step, planned and with async scheduling (`--loop`)
#   int8        the same with int8 weights (`--matmul-precision int8`): the step as a ratio of bf16's
#   mixed       benchmarks/mixed_step.py, bf16, the same batches beside a 64-token chunk at position 7900: the mixed
#               step against the chunk then the decode step alone
#   compile     benchmarks/compile_grid.py: the worker's program grid for E2B (32 slots, 8K) compiled cold with one
#               thread per host core, then loaded from the executable cache (the warm start)
#   throughput  decode_step.py, int8 weights, 256 rows of a 2K context: output tok/s at the largest batch measured
#   qat         decode_step.py on a qat-w4a16-ct checkpoint (written first, ~6.5 GB): B = 1, 8, 32
#   profile     the decode phase again with `--profile`: each row's steps traced, the device's time per op
#               (benchmarks/trace_summary.py) and its busy share of the step; traces in $WORK/profile
# A phase that would pass DEADLINE is skipped and says so; a phase's JSON from an earlier run in $OUT stays in the
# table (so a short session can run the phases over several calls with the same OUT and WORK).
#
# Steps: (1) a Python whose jax sees the GPU/TPU: $PYTHON, else .venv/bin/python, else python3, else
# `make install` plus the jax extra (`cuda`, or `tpu` on a TPU host; JAX_EXTRA overrides); (2) the checkpoint(s);
# (3) the phases; (4) the targets' table (benchmarks/device_targets.py), also appended to device_bench.md.
#
# Environment: OUT (results: device_bench.md, the phases' JSON, device_run.log; default $WORK/results), WORK
# (checkpoints and compilation cache, ~11 GB free needed, ~17 GB with qat; default /tmp/gemma-serve-device), TP
# (tensor-parallel degree, default 1), DEADLINE (seconds for the whole run, default 900), BATCHES, CONTEXT (the
# decode and mixed phases' grid; defaults "1 8 32", 8192), STEPS (timed steps per row, default 20).
# For a dry run of this script on a CPU: ALLOW_CPU=1 SYNTHETIC_ARGS="--layers 10 --hidden 256 --vocab 4096"
# BATCHES="1 2" CONTEXT=1024 PHASES="decode int8 mixed".
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-/tmp/gemma-serve-device}
OUT=${OUT:-$WORK/results}
TP=${TP:-1}
DEADLINE=${DEADLINE:-900}
BATCHES=${BATCHES:-1 8 32}
CONTEXT=${CONTEXT:-8192}
STEPS=${STEPS:-20}
PHASES=${PHASES:-decode int8 mixed compile throughput}
read -r -a SYNTHETIC <<<"${SYNTHETIC_ARGS:-}"
mkdir -p "$WORK" "$OUT"
LOG=$OUT/device_run.log
REPORT=$OUT/device_bench.md
touch "$LOG"
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
FORMATS=(bf16)
[[ " $PHASES " == *" qat "* ]] && FORMATS+=(qat-w4a16-ct)
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

# ----- (3) phases -------------------------------------------------------------------------------------------------
read -r -a B <<<"$BATCHES"
COMMON=(--cache-dir "$WORK/cache" --tensor-parallel "$TP")
BF16=$WORK/gemma4-e2b-bf16
{
  echo "# gemma-serve device benchmark: synthetic Gemma 4 E2B"
  echo
  device=$("$PY" -c 'import jax; print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")')
  commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "$(date -u +%FT%TZ); $device; tensor parallel $TP; commit $commit; phases: $PHASES."
  echo
} >>"$REPORT"
DECODE=("$PY" benchmarks/decode_step.py --steps "$STEPS" "${COMMON[@]}" --markdown "$REPORT")
phase() {  # NAME ESTIMATE_S COMMAND...: runs the phase unless it would pass the deadline
  local name=$1 estimate=$2; shift 2
  if [ $((DEADLINE - SECONDS)) -lt "$estimate" ]; then
    log "SKIPPED $name: ~${estimate} s left needed"; status=1; return
  fi
  log "phase $name"
  timeout "$(left)" "$@" 2>&1 | grep -v -i 'warning' | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || { log "FAILED: $name"; status=1; }
}
status=0
for p in $PHASES; do
  case $p in
    decode) phase decode 60 "${DECODE[@]}" --model "$BF16" --json "$OUT/decode-bf16.json" --batches "${B[@]}" \
              --kv "$CONTEXT" --matmul-precision bfloat16 --attention-kernel auto --ahead --loop ;;
    int8) phase int8 60 "${DECODE[@]}" --model "$BF16" --json "$OUT/decode-int8.json" --batches "${B[@]}" \
            --kv "$CONTEXT" --matmul-precision int8 --attention-kernel auto ;;
    # decode rows at CONTEXT - 292 + 7r (r < 32) and the 64-token chunk there: every program reads the last bucket
    mixed) phase mixed 90 "$PY" benchmarks/mixed_step.py --model "$BF16" --batches "${B[@]}" --chunk 64 \
             --position $((CONTEXT - 292)) --max-model-len "$CONTEXT" --iterations 10 --matmul-precision bfloat16 \
             --attention-kernel auto "${COMMON[@]}" --markdown "$REPORT" --json "$OUT/mixed-bf16.json" ;;
    compile) phase compile 120 "$PY" benchmarks/compile_grid.py --model "$BF16" --num-slots 32 \
               --max-model-len "$CONTEXT" --threads "$(nproc)" --json "$OUT/compile.json" ;;
    throughput) phase throughput 60 "${DECODE[@]}" --model "$BF16" --json "$OUT/throughput-int8.json" \
                  --batches 256 --kv 2048 --matmul-precision int8 --attention-kernel auto --bandwidth-mib 256 ;;
    profile) phase profile 60 "${DECODE[@]}" --model "$BF16" --json "$OUT/profile-bf16.json" --batches "${B[@]}" \
               --kv "$CONTEXT" --matmul-precision bfloat16 --attention-kernel auto --profile "$WORK/profile" ;;
    qat) phase qat 60 "${DECODE[@]}" --model "$WORK/gemma4-e2b-qat-w4a16-ct" --json "$OUT/decode-qat.json" \
           --batches "${B[@]}" --kv "$CONTEXT" --attention-kernel auto ;;
    *) log "unknown phase $p (decode int8 mixed compile throughput qat profile)"; status=1 ;;
  esac
done

# ----- (4) the targets' table -------------------------------------------------------------------------------------
"$PY" benchmarks/device_targets.py "$OUT" | tee -a "$REPORT"
log "done: $REPORT"
exit $status
