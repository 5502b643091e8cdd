#!/usr/bin/env bash
# The real trainer's speed on one CUDA GPU (prepared for an H200; under 8 minutes): DiT-XL/2 @256, bf16,
# precomputed latents (synthetic: demo images through a tiny 8x-downsampling VAE, so the cache holds the
# 4x32x32 latents DiT-XL/2 @256 trains on) at the micro-batch `dit-plan --gpu h200 --gpus 1` plans, run by
# `dit-accel train` twice: eager (--no-compile) and compiled (--compile). Reports images/s, MFU (the
# planner's FLOPs per image, planner.search.image_step_flops, over the GPU's bf16 matmul peak), and the
# measured max allocated / max reserved memory (the trainer's metrics.jsonl) against the plan's tensors and
# peak. Results: $OUT (or benchmarks/results/gpu_train_speed): machine.txt, plan/, run-*/, *.log,
# summary.md, summary.json. Copy summary.md into docs/benchmarks.md ("GPU").
#
#   bash benchmarks/gpu_train_speed.sh            # on the GPU machine
#   bash benchmarks/gpu_train_speed.sh --dry-run  # any machine: a DiT-S/2 @64 fp32 plan, global batch 8, 4
#                                                 # steps each, on the CPU when there is no GPU (checks the
#                                                 # plumbing, not the speed)
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0
[[ "${1:-}" == "--dry-run" ]] && dry_run=1
out_dir="${OUT:-benchmarks/results/gpu_train_speed}"
if ((dry_run)); then
    model="DiT-S/2" resolution=64 precision=fp32 steps=4 log_every=2 per_class=8 run_timeout=300
    plan_args=(--global-batch 8)  # fp32: a CPU's bf16 matmuls are emulated and slow
    out_dir="${OUT:-/tmp/gpu_train_speed_dry_run}"
else
    model="${MODEL:-DiT-XL/2}" resolution="${RESOLUTION:-256}" precision=bf16 steps="${STEPS:-60}"
    log_every="${LOG_EVERY:-15}"
    per_class=64 run_timeout="${RUN_TIMEOUT:-200}" plan_args=()
fi
mkdir -p "$out_dir"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
{ nvidia-smi || true; python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (CPU)')"; } \
    > "$out_dir/machine.txt" 2>&1

# 1. The plan: what the planner picks for one H200 (its micro-batch, checkpointing, AdamW); PLAN=plan.json
#    uses a plan made before instead.
if [[ -n "${PLAN:-}" ]]; then
    mkdir -p "$out_dir/plan" && cp "$PLAN" "$out_dir/plan/plan.json"
else
    dit-plan --gpu h200 --gpus 1 --model "$model" --resolution "$resolution" --precision "$precision" \
        --latents precomputed "${plan_args[@]}" --out "$out_dir/plan" > "$out_dir/plan.log" 2>&1
fi

# 2. Synthetic precomputed latents at the plan's resolution (4 classes; the plan's model keeps its own).
data="$out_dir/data"
if [[ ! -d "$data/latents" ]]; then  # made once per results folder
    rm -rf "$data" && mkdir -p "$data"
    dit-accel demo-data "$data/images" --classes 4 --per-class "$per_class" --resolution "$resolution" > /dev/null
    python - "$data/vae" <<'EOF'
import sys

import torch
from diffusers import AutoencoderKL

torch.manual_seed(0)  # 4 down blocks: latents of 1/8 the side, 4 channels, as the SD VAE's
AutoencoderKL(
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 8, 8),
    latent_channels=4,
    norm_num_groups=8,
    layers_per_block=1,
).save_pretrained(sys.argv[1])
EOF
    dit-accel extract-latents --data-path "$data/images" --vae "$data/vae" --resolution "$resolution" \
        --out "$data/latents" --num-workers 2 > "$out_dir/extract.log" 2>&1
fi

# 3. The trainer, eager then compiled. Each run gets at most $run_timeout s; a timeout leaves the other.
for mode in eager compiled; do
    flag=$([[ $mode == compiled ]] && echo --compile || echo --no-compile)
    run="$out_dir/run-$mode"
    rm -rf "$run"
    timeout "$run_timeout" dit-accel train --plan "$out_dir/plan/plan.json" --latents "$data/latents" \
        --output-dir "$run" --max-steps "$steps" --log-every "$log_every" --checkpoint-every 1000000 \
        --keep-last 1 --no-tensorboard --no-progress-bar "$flag" > "$out_dir/train-$mode.log" 2>&1 \
        || echo "$mode: exit $? (see $out_dir/train-$mode.log)" | tee -a "$out_dir/failures.txt"
    rm -rf "$run/checkpoints"  # the final checkpoint (11 GB for XL/2) is not what is measured
done

# 4. The report: windows after the first (which holds start-up and compilation).
python - "$out_dir" <<'EOF' | tee "$out_dir/summary.md"
import json
import statistics
import sys
from pathlib import Path

from planner.hardware import gpu_preset
from planner.planfile import read_plan
from planner.search import image_step_flops

out = Path(sys.argv[1])
plan = read_plan(out / "plan" / "plan.json")
spec, decision = plan.spec(), plan.decision
flops_per_image = image_step_flops(spec, decision)
peak_flops = gpu_preset(plan.cluster.gpu or "h200").matmul_peak_flops(decision.precision)
gib = 2**30
memory = plan.memory
summary = {
    "machine": (out / "machine.txt").read_text().strip().splitlines()[-1],
    "plan": {
        "model": spec.name,
        "micro_batch": decision.micro_batch,
        "grad_accum": decision.grad_accum,
        "checkpointed_blocks": decision.checkpointed_blocks,
        "precision": decision.precision,
        "flops_per_image": flops_per_image,
        "peak_flops": peak_flops,
        "tensor_bytes": memory.tensor_bytes if memory else None,
        "peak_bytes": memory.peak_bytes if memory else None,
    },
    "runs": {},
}
print(f"{spec.name} @{spec.resolution}, {decision.precision}, micro-batch {decision.micro_batch} x accumulation "
      f"{decision.grad_accum}, {decision.checkpointed_blocks}/{spec.depth} blocks checkpointed; "
      f"{summary['machine']}\n")
print("| run | images/s (median of windows 2+) | MFU | max allocated | max reserved | plan: tensors / peak |")
print("|---|---|---|---|---|---|")
for mode in ("eager", "compiled"):
    metrics_path = out / f"run-{mode}" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    timed = lines[1:] or lines
    if not timed:
        print(f"| {mode} | no metrics (see train-{mode}.log) | | | | |")
        continue
    images_per_s = statistics.median(line["images_per_s"] for line in timed)
    allocated = max((line.get("peak_allocated_bytes") or 0) for line in lines) or None
    reserved = max((line.get("peak_reserved_bytes") or 0) for line in lines) or None
    mfu = images_per_s * flops_per_image / peak_flops
    summary["runs"][mode] = {
        "images_per_s": images_per_s,
        "images_per_s_windows": [line["images_per_s"] for line in lines],
        "mfu": mfu,
        "max_allocated_bytes": allocated,
        "max_reserved_bytes": reserved,
    }
    plan_text = f"{memory.tensor_bytes / gib:.2f} / {memory.peak_bytes / gib:.2f} GiB" if memory else "-"
    shown = lambda b: f"{b / gib:.2f} GiB" if b else "n/a (CPU)"  # noqa: E731
    print(f"| {mode} | {images_per_s:.1f} | {mfu:.1%} | {shown(allocated)} | {shown(reserved)} | {plan_text} |")
if len(summary["runs"]) == 2:
    speedup = summary["runs"]["compiled"]["images_per_s"] / summary["runs"]["eager"]["images_per_s"]
    print(f"\ncompiled / eager: {speedup:.3f}x")
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
EOF
