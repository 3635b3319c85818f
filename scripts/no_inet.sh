#!/usr/bin/env bash
# Run a command where no internet socket can be opened, not even on loopback (unix sockets work), as on the TPU
# host: `scripts/no_inet.sh make test`. Builds scripts/no_inet.c (gcc) into a temporary folder and preloads it
# into the command and every process it starts.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
lib="$(mktemp -d)/no_inet.so"
gcc -shared -fPIC -O2 -o "$lib" "$here/no_inet.c" -ldl
export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
exec "$@"
