#!/bin/bash
# Carry any vLLM release, with the torch it needs, to the lent GPU machine (Python 3.12, torch
# 2.11 cu130, no package registry): the wheels `pip install vllm==VERSION` resolves for CPython
# 3.12 on x86_64, less the CUDA libraries the machine's torch already has (torch finds them on
# the machine's own sys.path; a newer cuDNN is not needed: PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1)
# and the video decoders and CUDA 12 kernels this model never loads, cut into chunks one device
# call carries each (<= 55 MiB: the working tree counts toward the 64).
# Usage: make_release_chunks.sh VERSION OUT_DIR   (needs PyPI; run on x86_64; e.g. 0.33.0 gpu_033)
# Result: OUT_DIR/c1 .. OUT_DIR/cN, each with its piece and step.sh. Carry them one call each,
# in order, running `bash OUT_DIR/cK/step.sh`: the last one installs the wheels into
# /tmp/site-TAG (TAG: the release's major and minor digits, 033 for 0.33.0), touches
# /tmp/ready-TAG and prints READY; then `--vllm-pythonpath /tmp/site-TAG` for the benches. The
# client and the model come from make_chunks.sh's bundles as for the pinned release.
set -euo pipefail
VERSION=$1; OUTD=$2; HERE=$(cd "$(dirname "$0")" && pwd); CHUNK_MIB=${CHUNK_MIB:-55}
TAG=$(echo "$VERSION" | awk -F. '{printf "%d%02d", $1, $2}')
. "$HERE/gpu_python.sh"
PY=$(py312) || exit 1
mkdir -p "$OUTD/whl"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none $PLATFORMS -d "$OUTD/whl" "vllm==$VERSION"
# What the machine's torch 2.11 cu130 brings (NCCL stays: torch pins its own), then what
# PaddleOCR-VL's serving never imports.
mkdir -p "$OUTD/left_out"
for name in nvidia_cudnn_cu13 nvidia_cublas nvidia_cufft nvidia_cusolver nvidia_cusparse \
            nvidia_cusparselt_cu13 nvidia_cuda_nvrtc nvidia_cuda_runtime nvidia_curand \
            nvidia_cufile nvidia_cuda_cupti nvidia_nvtx nvidia_nvjitlink nvidia_nvshmem_cu13 \
            nvidia_cutlass_dsl_libs_cu12 pynvvideocodec torchcodec; do
  for w in "$OUTD/whl/$name"-[0-9]*.whl; do [ -e "$w" ] && mv "$w" "$OUTD/left_out/"; done
done
rm -rf "$OUTD"/c[0-9]* "$OUTD/build"; mkdir -p "$OUTD/build"
tar -C "$OUTD" -cf - whl | split -b "${CHUNK_MIB}M" -d -a 3 - "$OUTD/build/whl.part"
pieces=("$OUTD"/build/whl.part*); n=${#pieces[@]}
for i in "${!pieces[@]}"; do mkdir -p "$OUTD/c$((i + 1))"; mv "${pieces[$i]}" "$OUTD/c$((i + 1))/"; done
cat > "$OUTD/step.sh" <<STEP
#!/bin/bash
# One chunk of vLLM $VERSION's wheels: keep its piece in /tmp/parts-$TAG; once all $n are
# there, install them into /tmp/site-$TAG (pip, no index, no dependency resolution).
set -e
D=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p /tmp/parts-$TAG
cp "\$D"/whl.part* /tmp/parts-$TAG/
echo "\$(ls /tmp/parts-$TAG | wc -l) of $n pieces"
if [ "\$(ls /tmp/parts-$TAG | wc -l)" = $n ] && [ ! -e /tmp/ready-$TAG ]; then
  cat /tmp/parts-$TAG/whl.part* | tar x -C /tmp/parts-$TAG
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-$TAG \\
    /tmp/parts-$TAG/whl/*.whl > /tmp/install-$TAG.log 2>&1 || { tail -5 /tmp/install-$TAG.log; exit 1; }
  rm -rf /tmp/parts-$TAG/whl
  touch /tmp/ready-$TAG; echo READY
  PYTHONPATH=/tmp/site-$TAG python3 -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>&1 | tail -1
fi
STEP
for d in "$OUTD"/c[0-9]*; do cp "$OUTD/step.sh" "$d/"; done
echo "$n chunks in $OUTD (left out: $(ls "$OUTD/left_out" | wc -l) wheels)"; du -sh "$OUTD/whl"
