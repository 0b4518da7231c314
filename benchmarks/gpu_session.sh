#!/bin/bash
# One device call on a lent GPU machine (no registry): install the travelling wheels (benchmarks/wheels, carried),
# record the environment, then run gpu_smoke.py on the ~1B Qwen2.5-VL and on the ~1B ReferenceMLLM, each under its
# own time limit, logs and JSON under $OUT. Run from the repository root:
#     bash benchmarks/gpu_session.sh              # on the GPU machine (about 5 minutes)
#     DRY=--dry-run OUT=/tmp/out bash benchmarks/gpu_session.sh   # here, on the CPU, to check it first
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "$DRY" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    benchmarks/wheels/*.whl || exit 3
fi
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c "import torch, transformers, lightning
from omni_lightning.parallel.attention import attention_kernel
print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__,
      'kernel', attention_kernel('auto', 'cuda', torch.bfloat16))" 2>&1
  nproc; } | tee "$OUT/env.txt"
run() {  # name seconds arguments...
  local name=$1 seconds=$2; shift 2
  local started=$SECONDS
  timeout -k 5 "$seconds" python3 benchmarks/gpu_smoke.py --timeout $((seconds - 8)) --out "$OUT/$name.json" $DRY "$@" \
    > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - started)) s"
  grep "^device:\|^tokens/s\|failed\|Error" "$OUT/$name.log" | tail -5
}
run gpu_smoke_qwen2_5_vl_1b "${HF_SECONDS:-210}" --model qwen2_5_vl --steps 8 --warmup 3 --samples-per-step 128 \
  --dialogues 1536 --learning-rate 2e-5
run gpu_smoke "${REFERENCE_SECONDS:-150}" --steps 10 --warmup 3 --samples-per-step 32 --length-scale 0.5
