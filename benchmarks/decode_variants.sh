#!/usr/bin/env bash
# The decode step of one checkpoint under each attention kernel and matmul precision, one process each (a TPU
# takes one process at a time), then each variant's step time as a ratio of the first's, per batch:
#
#   bash benchmarks/decode_variants.sh                      # a synthetic Gemma 4 E2B bf16 written to $WORK first
#   MODEL=/path/to/checkpoint BATCHES="1 8 32" CONTEXT=8192 bash benchmarks/decode_variants.sh
#
# Variants (VARIANTS, ";"-separated "name:flags"): xla-bf16 (XLA's decode attention, bfloat16 weights),
# pallas-bf16 (--attention-kernel pallas), xla-int8 and pallas-int8 (--matmul-precision int8: int8 weights, one
# scale per output row), pallas-int8k (both Pallas kernels: attention and --matmul-kernel pallas, the int8 weights'
# products). Not in the default list: --attention-kernel auto (the worker's default on one TPU) and pallas-full (the
# kernel for the full layers only, sliding rings on XLA's loop). Output: $OUT/decode_variants.md (each run's table) and the ratio
# table on stdout. A dry run on a CPU: MODEL=<a small synthetic checkpoint> BATCHES="1 2" CONTEXT=512.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-/tmp/gemma-serve-device}
OUT=${OUT:-$WORK/results}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
BATCHES=${BATCHES:-1 8 32}
CONTEXT=${CONTEXT:-8192}
STEPS=${STEPS:-20}
VARIANTS=${VARIANTS:-"xla-bf16:--attention-kernel xla --matmul-precision bfloat16;pallas-bf16:--attention-kernel pallas --matmul-precision bfloat16;xla-int8:--attention-kernel xla --matmul-precision int8;pallas-int8:--attention-kernel pallas --matmul-precision int8;pallas-int8k:--attention-kernel pallas --matmul-precision int8 --matmul-kernel pallas"}
mkdir -p "$WORK" "$OUT"
cd "$ROOT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

MODEL=${MODEL:-$WORK/gemma4-e2b-bf16}
if [ ! -f "$MODEL/config.json" ]; then
  echo "writing a synthetic Gemma 4 E2B (bf16) to $MODEL"
  "$PY" scripts/make_synthetic_gemma4.py "$MODEL" --format bf16 || exit 1
fi
REPORT=$OUT/decode_variants.md
echo "# decode step variants: $MODEL, batches $BATCHES, context $CONTEXT" >"$REPORT"
read -r -a B <<<"$BATCHES"
IFS=';' read -r -a list <<<"$VARIANTS"
names=()
for v in "${list[@]}"; do
  name=${v%%:*}
  read -r -a flags <<<"${v#*:}"
  echo "== $name: ${flags[*]}"
  "$PY" benchmarks/decode_step.py --model "$MODEL" --batches "${B[@]}" --kv "$CONTEXT" --steps "$STEPS" \
    --cache-dir "$WORK/cache" "${flags[@]}" --markdown "$REPORT" --json "$OUT/variant-$name.json" \
    || { echo "FAILED: $name"; continue; }
  names+=("$name")
done
[ ${#names[@]} -gt 0 ] || exit 1
"$PY" - "$OUT" "${names[@]}" <<'EOF'
import json, pathlib, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {n: {r["batch"]: r for r in json.loads((out / f"variant-{n}.json").read_text())["rows"]} for n in names}
base = runs[names[0]]
print(f"\nstep time / {names[0]}'s, per batch (one run each; bw = fraction of the measured copy bandwidth)")
print(f"{'variant':>14} " + " ".join(f"{f'B={b}':>16}" for b in base))
for n in names:
    cells = [f"{runs[n][b]['step_ms'] / base[b]['step_ms']:.2f}x ({runs[n][b]['bandwidth_fraction']:.0%})"
             if b in runs[n] else "-" for b in base]
    print(f"{n:>14} " + " ".join(f"{c:>16}" for c in cells))
EOF
