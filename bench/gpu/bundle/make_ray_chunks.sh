#!/bin/bash
# Carry Ray (the `cluster` extra) to the registry-less GPU machine (Python 3.12): Ray's cp312
# manylinux wheel and its dependencies, as-is, in one uncompressed tar cut into device-call
# chunks r1..rN (<= 55 MiB each), each with step.sh. There: `bash gpu_ray/rK/step.sh` for each
# K, one call each, any order; the call that completes the set installs them with
# pip --no-index --no-deps --target /tmp/site-ray and imports ray. Put /tmp/site-ray LAST on
# PYTHONPATH: where the machine (or /tmp/cli) has one of Ray's dependencies, its own wins.
# Usage: make_ray_chunks.sh OUT_DIR     (downloads with this checkout's .venv/bin/pip)
set -euo pipefail
OUTD=$1; CHUNK_MIB=${CHUNK_MIB:-55}
RAY=${RAY:-ray==2.60.0}
W=$(mktemp -d /tmp/raywhl.XXXX)
"$(dirname "$0")/../../../.venv/bin/pip" download -q --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$W" "$RAY"
(cd "$W" && sha256sum *.whl > SHA256SUMS && tar -cf "$W/ray.tar" SHA256SUMS *.whl)
rm -rf "$OUTD"/r[0-9]*
split -b "${CHUNK_MIB}M" -d -a 2 "$W/ray.tar" "$W/ray.tar.part"
n=0
for p in "$W"/ray.tar.part*; do n=$((n + 1)); mkdir -p "$OUTD/r$n"; mv "$p" "$OUTD/r$n/"; done
sed -e "s/@N@/$n/g" "$(dirname "$0")/ray_step.sh.in" > "$OUTD/step.sh"
for d in "$OUTD"/r[0-9]*; do cp "$OUTD/step.sh" "$d/step.sh"; done
(cd "$W" && ls *.whl) > "$OUTD/wheels.txt"
rm -rf "$W"
echo "ray: $n chunks in $OUTD"
