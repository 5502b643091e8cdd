#!/usr/bin/env bash
# Calibrate the planner on one CUDA GPU (prepared for an H200; under 8 minutes):
# DiT-XL/2 @256, bf16, precomputed latents, no checkpointing and 14 of 28 blocks checkpointed.
# For each: `dit-accel calibrate` (real steps of the trainer's step at micro-batches 16, 32, 64, then the
# largest micro-batch that fits, by bisection up to an OOM) and `dit-accel verify --device-autocast cuda`
# (the fake-tensor trace with CUDA's autocast op lists). Results go under $OUT (or benchmarks/results/).
# Afterwards copy the printed table into docs/planner-accuracy.md ("Planner vs GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-benchmarks/results/gpu_calibrate}"
mkdir -p "$out_dir"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
{ nvidia-smi || true; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; } \
    > "$out_dir/machine.txt" 2>&1
python benchmarks/gpu_calibrate.py plans "$out_dir"
for checkpointed in 0 14; do
    plan="$out_dir/plan-ckpt$checkpointed.json"
    # each configuration gets at most 3 minutes; a timeout still leaves the other one and the report
    timeout 180 dit-accel calibrate --plan "$plan" --micro-batches 16,32,64 --steps 3 --max-micro-batch 1024 \
        --out "$out_dir/calibration-ckpt$checkpointed.json" 2>&1 | tee "$out_dir/calibrate-ckpt$checkpointed.log" || true
    timeout 60 dit-accel verify "$plan" --device-autocast cuda --json "$out_dir/verify-ckpt$checkpointed.json" 2>&1 \
        | tee "$out_dir/verify-ckpt$checkpointed.log" || true
done
python benchmarks/gpu_calibrate.py report "$out_dir" | tee "$out_dir/summary.md"
