#!/bin/bash
# vLLM release against release on one GPU, in one lease: the benchmark of record (bench.gpu)
# for each vLLM site in turn, layout detection off (capacity and convert; 96 pages) and on
# (the transformers stand-in on the GPU; 32 pages), every figure from the same card.
# Usage (on the GPU machine, from a snapshot of the checkout: the device replaces the working
# tree at every call, under a run that outlives one; bench/gpu/README.md, the lease):
#   setsid bash bench/gpu/vllm_versions.sh OUT LABEL=SITE [LABEL=SITE ...] &
#   e.g. OUT=/tmp/ab new=/tmp/site-new old=/tmp/site (the bundles of bench/gpu/bundle)
# Each run has a time limit (PART_S, default 330 s: vLLM's start is ~60-150 s); a version
# that does not start says so in OUT/LABEL-*.log and the next one runs. OUT/progress.txt has
# a line per part; OUT/LABEL-{off,on}.json the results (bench.gpu's --results).
set -u
OUT=$1; shift
PART_S=${PART_S:-330}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/cli PYTHONUNBUFFERED=1
# A newer torch beside the machine's cuDNN (ABI-compatible within 9.x; bundle README)
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0
say() { echo "$(date +%H:%M:%S) $*" | tee -a "$OUT/progress.txt"; }
# The stand-in layout model's weights, not just the folder: PaddleX makes it as its cache
# (ray_vs_local points it there) and leaves it without a model.
python3 -c 'import sys; from pathlib import Path; from testkit.layout_model import written
sys.exit(not written(Path("/tmp/lm")))' ||
  python3 -m testkit.layout_model /tmp/lm --format transformers > "$OUT/lm.log" 2>&1
for pair in "$@"; do
  label=${pair%%=*}; site=${pair#*=}
  say "$label: $(PYTHONPATH=$site python3 -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
done
# Mode by mode, each version in turn: a lease cut short still has a pair to compare.
for mode in off on; do
  for pair in "$@"; do
    label=${pair%%=*}; site=${pair#*=}
    args=(--only capacity,convert --rounds 1 --pages 96)
    [ "$mode" = on ] && args=(--layout --layout-engine transformers --layout-device gpu:0
                              --layout-cache /tmp/lm --only capacity,convert --pages 32)
    say "$label: layout $mode"
    timeout -k 30 "$PART_S" python3 -m bench.gpu --model-dir /tmp/model --vllm-pythonpath "$site" \
      "${args[@]}" --results "$OUT/$label-$mode.json" --log-dir "$OUT/$label-$mode-logs" \
      > "$OUT/$label-$mode.log" 2>&1
    say "$label: layout $mode ended ($?)"
  done
done
say "all done"
