#!/usr/bin/env bash
# The second GPU check, after benchmarks/gpu_check.sh: `dit-accel calibrate` of DiT-XL/2 @256 in each matmul
# mode the planner rates separately (presets/mfu.yaml: mixed, tf32, IEEE fp32, and the VAE encoder of online
# latents), and in the configurations of the public runs docs/planner-accuracy.md compares against (fast-DiT:
# fp16, every block checkpointed, fixed allocator segments; DiT issue #22: TF32 at micro-batch 32, online).
# Each point is measured at the given micro-batches only (no search for the largest fit, except in the last two
# modes, which search it on the allocator capped at an 80 GB card's size: `calibrate --vram`), about 4 minutes
# in all on one H200, most important first; a stage stopped at its cap keeps the points it wrote.
#
#   run(command="bash benchmarks/gpu_modes.sh", carry=[".whl"], timeout_s=480)   # .whl: benchmarks/gpu_wheels.sh
#   bash benchmarks/gpu_modes.sh --dry-run      # any machine: makes the plans only (calibrate needs a GPU)
#
# Into $OUT: modes.tar.gz (each stage's plan.json and calibration.json) and modes.log (what calibrate printed).
# BUDGET_S (default 400) bounds the whole check; each stage gets at most 90 s. ONLY=NAME,... runs those modes.
# The two small-batch modes at the end run only when ONLY names them (ONLY=small-batch-warmup1,small-batch-warmup4):
# the same points with 1 and 4 untimed steps first, which tell the warm-up's cost apart from the step's.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
[[ "${1:-}" == "--dry-run" ]] && dry_run=1
out="${OUT:-${TMPDIR:-/tmp}/gpu_modes_out}"
work="${GPU_MODES_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_modes.XXXXXX")}"
budget_s="${BUDGET_S:-400}"
mkdir -p "$out" "$work"
log="$out/modes.log"
: > "$log"
source benchmarks/gpu_site.sh
use_carried_wheels "$work/site" "$log" || echo "installing .whl/*.whl failed" >> "$log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# mode NAME MICRO_BATCHES ALLOC_CONF CALIBRATE_ARGS PLAN_ARGS...: plan DiT-XL/2 @256 on one H200 so, then
# calibrate it there (CALIBRATE_ARGS: "" = these micro-batches only, no search for the largest fit)
mode() {
    local name=$1 micro_batches=$2 alloc=$3 extra=$4 left=$((budget_s - SECONDS))
    shift 4
    [[ -z ${ONLY:-} || ",$ONLY," == *",$name,"* ]] || return 0
    local dir="$work/$name" cap=$((left < 90 ? left : 90))
    [[ -n $extra ]] || extra="--max-micro-batch ${micro_batches##*,}"
    mkdir -p "$dir"
    echo "=== $name: dit-plan $* ; calibrate at $micro_batches $extra, PYTORCH_CUDA_ALLOC_CONF=$alloc" | tee -a "$log"
    python3 -m planner.cli --gpu h200 --gpus 1 --model DiT-XL/2 --resolution 256 "$@" --out "$dir" \
        > "$dir/plan.txt" 2>&1 || { tail -3 "$dir/plan.txt" | tee -a "$log"; return 1; }
    ((dry_run)) && return 0
    ((cap >= 30)) || { echo "$name: skipped, $left s of the budget left" | tee -a "$log"; return 1; }
    PYTORCH_CUDA_ALLOC_CONF=$alloc timeout -k 10 "$cap" python3 -m dit_accel.cli calibrate \
        --plan "$dir/plan.json" --micro-batches "$micro_batches" --steps 2 $extra \
        --out "$dir/calibration.json" >> "$log" 2>&1
    echo "$name: exit $? after $SECONDS s of the budget" | tee -a "$log"
}

expandable=expandable_segments:True fixed=expandable_segments:False
mode tf32 32,64,128 $expandable "" --precision tf32 --latents precomputed --global-batch 128 --checkpointing none
mode bf16-online 32,64,128 $expandable "" --precision bf16 --latents online --global-batch 128 --checkpointing none
mode dit22-tf32-online 16,32,64 $expandable "" --precision tf32 --latents online --global-batch 32 \
    --checkpointing none
mode fastdit-fp16-fixed 32,64,128 $fixed "" --precision fp16 --latents precomputed --global-batch 128 \
    --checkpointing all --assume allocator_segments=fixed
mode fastdit-fp16-online-fixed 64,128,180 $fixed "" --precision fp16 --latents online --global-batch 128 \
    --checkpointing all --assume allocator_segments=fixed
mode fastdit-tf32-online-fixed 32,64,128 $fixed "" --precision tf32 --latents online --global-batch 128 \
    --checkpointing all --assume allocator_segments=fixed
mode ieee-fp32 16,32 $expandable "" --precision fp32 --latents precomputed --global-batch 32 --checkpointing none
# fast-DiT's online rows as on its 80 GB A100 (the allocator capped there: release-and-retry, then OOM): the
# largest micro-batch that fits, which the public runs at 128 (fp16 and TF32) say is at least 128
mode fastdit-fp16-online-fixed-80g 64,128 $fixed "--max-micro-batch 512 --vram 80GiB" --precision fp16 \
    --latents online --global-batch 128 --checkpointing all --assume allocator_segments=fixed
mode fastdit-tf32-online-fixed-80g 64,128 $fixed "--max-micro-batch 512 --vram 80GiB" --precision tf32 \
    --latents online --global-batch 128 --checkpointing all --assume allocator_segments=fixed
# The small-batch end of the step model (half_efficiency_tokens): 6 timed steps a point, after 1 or 4 warm-ups
if [[ ",${ONLY:-}," == *",small-batch-"* ]]; then
    for warmup in 1 4; do
        mode small-batch-warmup$warmup 8,16,32,64 $expandable \
            "--max-micro-batch 64 --steps 6 --warmup-steps $warmup" --precision bf16 --latents precomputed \
            --global-batch 64 --checkpointing none
    done
fi
tar -czf "$out/modes.tar.gz" -C "$work" --exclude site $(cd "$work" && ls -d */ | grep -v site) 2>> "$log"
echo "done after $SECONDS s" | tee -a "$log"
