#!/bin/bash
# Build both bundles and cut them into chunks that one device call carries each (the device
# tool carries at most 64 MiB a call, the working tree included: chunks of 55 MiB leave room).
# Usage: make_chunks.sh /path/to/ocrvl-checkout OUT_DIR   (needs PyPI; run on x86_64)
# Result: OUT_DIR/c1 .. OUT_DIR/cN, each with its piece and step.sh. Carry them one call each,
# in order, running `bash OUT_DIR/cK/step.sh`: the last one unpacks vLLM to /tmp/site and the
# client to /tmp/cli, compiles the client and writes the random-weight model to /tmp/model
# (from the working tree the call runs in), then prints READY.
set -euo pipefail
SRC=$1; OUTD=$2; HERE=$(cd "$(dirname "$0")" && pwd); CHUNK_MIB=${CHUNK_MIB:-55}
mkdir -p "$OUTD/build"
[ -e "$OUTD/build/site.tar.xz" ] || bash "$HERE/prepare_vllm_bundle.sh" "$OUTD/build"
[ -e "$OUTD/build/cli.tar.xz" ] || bash "$HERE/make_client_bundle.sh" "$SRC" "$OUTD/build"
rm -rf "$OUTD"/c[0-9]*
split -b "${CHUNK_MIB}M" -d -a 2 "$OUTD/build/site.tar.xz" "$OUTD/build/site.part"
pieces=("$OUTD"/build/site.part*); n=${#pieces[@]}
for i in "${!pieces[@]}"; do mkdir -p "$OUTD/c$((i + 1))"; mv "${pieces[$i]}" "$OUTD/c$((i + 1))/"; done
# the client goes with the smallest piece if both fit one call, else in a chunk of its own
last="$OUTD/c$n"; cli_mib=$(( $(stat -c %s "$OUTD/build/cli.tar.xz") / 1048576 + 1 ))
last_mib=$(( $(du -sm "$last" | cut -f1) ))
if [ $((last_mib + cli_mib)) -gt "$CHUNK_MIB" ]; then last="$OUTD/c$((n + 1))"; mkdir -p "$last"; fi
cp "$OUTD/build/cli.tar.xz" "$last/"
cat > "$OUTD/step.sh" <<STEP
#!/bin/bash
# One chunk of the GPU bundles: keep its pieces in /tmp/parts; once all $n pieces of vLLM and
# the client are there, unpack them (/tmp/site, /tmp/cli) and write /tmp/model.
set -e
D=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p /tmp/parts
cp "\$D"/site.part* "\$D"/cli.tar.xz /tmp/parts/ 2>/dev/null || true
ls /tmp/parts | tr '\n' ' '; echo
if [ -e /tmp/parts/cli.tar.xz ] && [ "\$(ls /tmp/parts/site.part* | wc -l)" = $n ] && [ ! -e /tmp/ready ]; then
  cat /tmp/parts/site.part* | xz -d -T0 | tar x -C /tmp
  tar xJf /tmp/parts/cli.tar.xz -C /tmp
  python3 -m compileall -q -j 0 /tmp/cli >/dev/null 2>&1 || true
  PYTHONPATH=\$PWD:/tmp/cli python3 -m bench.gpu.dummy_model /tmp/model > /tmp/model.log 2>&1
  touch /tmp/ready; echo READY; tail -1 /tmp/model.log
fi
STEP
for d in "$OUTD"/c[0-9]*; do cp "$OUTD/step.sh" "$d/"; done
du -sh "$OUTD"/c[0-9]*
