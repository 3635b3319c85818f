#!/usr/bin/env bash
# Wheels for an accelerator host that reaches no package registry (the TPU VM of scripts/device_check.sh): run it
# here, on a machine with the registries and `make install-test` done, then bring the folder along.
#
#   scripts/device_wheels.sh [DEST] [HAVE]
#
# DEST (default .device/wheels) receives, for CPython 3.11 on manylinux x86_64, one wheel per package the test venv
# (.venv) holds at its exact version, the embedded model's four parts included, except JAX and what comes with it
# on the host (jax, jaxlib, libtpu, numpy, scipy, ml-dtypes, opt-einsum), torch (the host's /opt/wheels has its CPU
# build) and the packages HAVE holds at the very version the venv has: HAVE is a file of `name==version` entries,
# one per line or whitespace (what the host already has: its `pip list --format=freeze`, and one entry per wheel of
# its package index, e.g. `ls /opt/pypi/simple/*/ | sed -n 's/^\([^-]*\)-\([^-]*\)-.*\.whl$/\1==\2/p'`;
# device_check.sh installs from both). A name without its version, or at another version, is brought along: an index
# that offers a package only older than what the project pins (schemathesis needs harfile >= 0.6, a v5e's index
# had 0.3.0) stops the whole install.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$REPO/.device/wheels}"
HAVE="${2:-}"
mkdir -p "$DEST"
norm() { tr 'A-Z_.' 'a-z--'; }
skip="jax jaxlib libtpu numpy scipy ml-dtypes opt-einsum torch gemma-serve"
have=""  # name==version entries, names normalised
[ -n "$HAVE" ] && have=" $(tr ' ' '\n' < "$HAVE" | grep '==' | awk -F'==' '{print $1 "==" $2}' | \
  while IFS= read -r entry; do echo "$(echo "${entry%%==*}" | norm)==${entry#*==}"; done | tr '\n' ' ')"
reqs="$(mktemp)"
"$REPO/.venv/bin/python" -m pip list --format=freeze --exclude-editable 2>/dev/null | while IFS= read -r line; do
  name="$(echo "${line%%==*}" | norm)"
  case " $skip " in *" $name "*) continue ;; esac
  case "$have " in *" $name==${line#*==} "*) continue ;; esac
  echo "$line"
done > "$reqs"
echo "downloading $(wc -l < "$reqs") wheels into $DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform linux_x86_64 --platform any \
  -d "$DEST" -r "$reqs" "setuptools>=77"
rm -f "$reqs"
du -sh "$DEST"
