#!/usr/bin/env bash
# llama.cpp's llama-server as a reference server for benchmarks/agent_fleet.py.
#
# The llama.cpp sources come from the llama-cpp-python source distribution on PyPI (it vendors llama.cpp
# under vendor/llama.cpp), so nothing but a package registry is needed. Everything lands in
# benchmarks/.llama.cpp/ (git-ignored by a `*` .gitignore the script writes there).
#
# Usage:
#   benchmarks/llama_cpp_server.sh build                      # download the sdist, build llama-server (once)
#   benchmarks/llama_cpp_server.sh serve N                    # serve the embedded GGUF with N slots (foreground)
#   benchmarks/llama_cpp_server.sh bench [N ...] [-- ARGS]    # per N: start a server with N slots, wait for
#                                                             # /health, run agent_fleet.py --agents N ARGS, stop it
#   benchmarks/llama_cpp_server.sh gguf                       # print the GGUF path it serves
#
# Examples:
#   benchmarks/llama_cpp_server.sh bench 1 8 -- --quick      # the smoke run: ~35 s on an idle 2-core machine
#   benchmarks/llama_cpp_server.sh bench                      # N = 1 2 4 8 with agent_fleet.py's defaults
#   LLAMA_SERVER_ARGS="--swa-full" benchmarks/llama_cpp_server.sh serve 8   # then point agent_fleet.py at it
#
# One server per N: llama-server's slot count (-np) is fixed at start, so `bench` restarts it for each N
# (which also starts every N with a cold prompt cache). Results: $RESULTS_DIR/llama_cpp_N<N>.json.
#
# Build time (2-core x86_64, GGML_NATIVE, -j2, only the llama-server target): 420 s measured, plus ~45 s for
# the 77 MB sdist download and ~5 s to unpack; build-time.txt next to the build records it. The build is
# skipped when the binary exists. The work dir takes ~380 MB.
#
# llama.cpp notes (0.3.36's vendored llama.cpp):
# - The GGUF has no chat template, and llama.cpp's Jinja mode (on by default) would take `--chat-template
#   gemma` as Jinja *source*; so --no-jinja, which selects the built-in Gemma template (system message merged
#   into the first user turn, every message content trimmed).
# - Prefix caching across turns (cache_prompt) is on by default; --cache-reuse is passed, but llama.cpp
#   disables it for Gemma 3's sliding-window KV cache ("cache_reuse is not supported by this context").
# - Slots do not share prefixes: with N slots the shared system prompt is prefilled N times.
# - Cached tokens are reported in usage.prompt_tokens_details.cached_tokens and in its own `timings`
#   (cache_n, prompt_n = tokens actually computed) on the final streamed chunk.
#
# Environment knobs (defaults in brackets):
#   LLAMA_CPP_PYTHON_VERSION [0.3.36]   which llama-cpp-python sdist to take llama.cpp from
#   LLAMA_CPP_DIR   [benchmarks/.llama.cpp]  work dir (sdist, sources, build, logs, results)
#   LLAMA_PORT      [18080]             port on 127.0.0.1
#   CTX_PER_SLOT    [8192]              context per slot; -c = N * CTX_PER_SLOT
#   LLAMA_THREADS   [2]                 -t and -tb
#   CACHE_REUSE     [256]               --cache-reuse (min chunk for KV-shift reuse; prefix caching is on anyway)
#   LLAMA_SERVER_ARGS ['']              extra llama-server flags (e.g. "--swa-full")
#   JOBS            [2]                 make -j for the build
#   RESULTS_DIR     [$LLAMA_CPP_DIR/results]
#   PYTHON          [.venv/bin/python]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WORK="${LLAMA_CPP_DIR:-$HERE/.llama.cpp}"
SRC_ROOT="$WORK/llama_cpp_python-$VERSION"
SRC="$SRC_ROOT/vendor/llama.cpp"
BUILD="$WORK/build-$VERSION"
BIN="$BUILD/bin/llama-server"
PORT="${LLAMA_PORT:-18080}"
CTX_PER_SLOT="${CTX_PER_SLOT:-8192}"
THREADS="${LLAMA_THREADS:-2}"
CACHE_REUSE="${CACHE_REUSE:-256}"
JOBS="${JOBS:-2}"
RESULTS_DIR="${RESULTS_DIR:-$WORK/results}"
MODEL_ALIAS="gemma-3-270m"

log() { printf '[llama_cpp_server] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The work dir, git-ignored from the inside so nothing in it is ever committed.
ensure_workdir() {
  mkdir -p "$WORK"
  [[ -f "$WORK/.gitignore" ]] || printf '*\n' >"$WORK/.gitignore"
}

# Download (pip, source only) and unpack the llama-cpp-python sdist unless already unpacked.
fetch_source() {
  ensure_workdir
  if [[ -f "$SRC/CMakeLists.txt" ]]; then return; fi
  local sdist="$WORK/sdist/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    log "downloading llama-cpp-python==$VERSION (sdist) from the package index"
    "$PYTHON" -m pip download --no-binary :all: --no-deps --disable-pip-version-check \
      -d "$WORK/sdist" "llama-cpp-python==$VERSION" >&2
  fi
  log "unpacking $sdist"
  tar -xzf "$sdist" -C "$WORK"
  [[ -f "$SRC/CMakeLists.txt" ]] || die "no vendor/llama.cpp in the sdist ($SRC)"
}

# Configure and build only the llama-server target; records the wall time in $WORK/build-time.txt.
build() {
  if [[ -x "$BIN" ]]; then log "already built: $BIN"; return; fi
  fetch_source
  local t0 t1
  t0=$(date +%s)
  # AMX off: GGML_NATIVE enables it on a CPU that advertises it, and a VM that does not enable the AMX tiles then
  # kills llama-server with SIGILL in an AMX kernel (seen on a 2-vCPU Xeon).
  # LLAMA_CURL is deprecated in recent llama.cpp (warning only); HTTPS and the web UI are not needed, and the
  # prebuilt web UI would be downloaded from Hugging Face, so both are off.
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
  cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS" >&2
  t1=$(date +%s)
  [[ -x "$BIN" ]] || die "build finished but $BIN is missing"
  printf 'llama-cpp-python %s: llama-server built in %d s with -j%s on %s (%s cores)\n' \
    "$VERSION" $((t1 - t0)) "$JOBS" "$(uname -m)" "$(nproc)" | tee "$WORK/build-time.txt" >&2
}

# The embedded Gemma 3 270M Q4_K_M GGUF our stack serves by default (assembled into the user cache if needed).
gguf_path() {
  (cd "$REPO" && "$PYTHON" -c \
    "from gemma_serve.models import embedded_gguf, default_cache_dir; print(embedded_gguf(default_cache_dir()))")
}

# The llama-server command line for N slots, one argument per line.
server_args() {
  local n="$1" gguf="$2"
  # --no-jinja: see the notes at the top (with Jinja on, "gemma" would be a template that renders "gemma").
  # shellcheck disable=SC2206
  local extra=(${LLAMA_SERVER_ARGS:-})
  printf '%s\n' "$BIN" -m "$gguf" --alias "$MODEL_ALIAS" --host 127.0.0.1 --port "$PORT" \
    -np "$n" -c $((n * CTX_PER_SLOT)) -t "$THREADS" -tb "$THREADS" \
    --no-jinja --chat-template gemma --cache-reuse "$CACHE_REUSE" --no-webui --metrics "${extra[@]}"
}

# serve N: run llama-server in the foreground.
serve() {
  local n="${1:?serve needs the slot count N}"
  [[ -x "$BIN" ]] || build
  local gguf; gguf="$(gguf_path)"
  local -a cmd; mapfile -t cmd < <(server_args "$n" "$gguf")
  log "${cmd[*]}"
  exec "${cmd[@]}"
}

# Wait until GET /health answers 200 (llama-server answers 503 while loading); fail if the server died.
wait_health() {
  local pid="$1" deadline=$((SECONDS + ${HEALTH_TIMEOUT:-300}))
  while ((SECONDS < deadline)); do
    kill -0 "$pid" 2>/dev/null || die "llama-server exited during startup (see $WORK/server-*.log)"
    if "$PYTHON" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code != 200)" \
      2>/dev/null; then return; fi
    sleep 1
  done
  die "llama-server not healthy after ${HEALTH_TIMEOUT:-300}s"
}

SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" && wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}

# bench [N ...] [-- agent_fleet args]: one server per N, one agent_fleet.py run against it.
bench() {
  local -a ns=() fleet_args=()
  while (($#)); do
    if [[ "$1" == "--" ]]; then shift; fleet_args=("$@"); break; fi
    ns+=("$1"); shift
  done
  ((${#ns[@]})) || ns=(1 2 4 8)
  [[ -x "$BIN" ]] || build
  local gguf; gguf="$(gguf_path)"
  mkdir -p "$RESULTS_DIR"
  trap stop_server EXIT
  for n in "${ns[@]}"; do
    local -a cmd; mapfile -t cmd < <(server_args "$n" "$gguf")
    local slog="$WORK/server-N$n.log"
    log "starting llama-server with $n slots (log: $slog)"
    "${cmd[@]}" >"$slog" 2>&1 &
    SERVER_PID=$!
    wait_health "$SERVER_PID"
    "$PYTHON" "$HERE/agent_fleet.py" --base-url "http://127.0.0.1:$PORT/v1" --model "$MODEL_ALIAS" \
      --agents "$n" --label "llama.cpp $VERSION" --json "$RESULTS_DIR/llama_cpp_N$n.json" "${fleet_args[@]}"
    stop_server
  done
}

# The comment block at the top of this file.
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

main() {
  local mode="${1:-}"; shift || true
  case "$mode" in
    build) build ;;
    serve) serve "$@" ;;
    bench) bench "$@" ;;
    gguf) gguf_path ;;
    *) usage; [[ "$mode" == "-h" || "$mode" == "--help" ]] ;;
  esac
}

main "$@"
