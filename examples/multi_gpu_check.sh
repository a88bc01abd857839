#!/usr/bin/env bash
# Step-1 loss of the pretraining example: 1 GPU with global batch 2B vs DDP and FSDP (FULL_SHARD) on
# 2 GPUs with B per GPU. With --data-order sequential both see the same 2B examples at step 1
# (accelerate hands batch 0 to rank 0 and batch 1 to rank 1), so the logged losses must agree to
# within 1e-3. Each run is time-limited so that a hung collective fails the check instead of waiting.
#   bash examples/multi_gpu_check.sh OUT_DIR
set -euo pipefail
out=${1:-multi_gpu_out}
mkdir -p "$out"
common=(--model-type rat --steps 3 --hidden-size 256 --layers 4 --heads 4 --set chunk_size=16 --data-order sequential)
# One visible GPU: with several, a plain (non-launched) Trainer wraps the model in DataParallel and its
# batch becomes B x num_gpus.
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 examples/pretrain.py "${common[@]}" --batch-size 16 --output-dir "$out/single" | tail -n 1 > "$out/single.json"
for mode in ddp fsdp; do
  timeout 240 accelerate launch --config_file "examples/accelerate/$mode.yaml" examples/pretrain.py "${common[@]}" \
    --batch-size 8 --output-dir "$out/$mode" | tail -n 1 > "$out/$mode.json"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = {name: json.load(open(f"{out}/{name}.json")) for name in ("single", "ddp", "fsdp")}
for name, run in runs.items():
    print(f"{name:>6}: step-1 loss {run['first_loss']:.6f}  last loss {run['last_loss']:.6f}")
for name in ("ddp", "fsdp"):
    diff = abs(runs[name]["first_loss"] - runs["single"]["first_loss"])
    print(f"{name} vs single step-1 |diff| = {diff:.2e} -> {'OK' if diff < 1e-3 else 'MISMATCH'}")
    assert diff < 1e-3
PY
