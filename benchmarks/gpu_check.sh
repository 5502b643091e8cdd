#!/usr/bin/env bash
# The GPU checks, in one command on a lent CUDA machine (prepared for one H200: about 7 minutes), most
# important first, each result written as soon as it is measured so that a timeout still returns it:
#   (a) the trainer eager: images/s, max allocated / reserved memory against the plan, at the micro-batch
#       `dit-plan --gpu h200 --gpus 1` plans for DiT-XL/2 @256 bf16 (synthetic latent cache);
#   (b) the same run compiled (--compile): images/s;
#   (b') the same compiled run with --fp8 (torchao float8 matmuls in the blocks): img/s, memory, loss;
#   (b'') the compiled step under torch.profiler (benchmarks/profile_step.py): time by kind (matmul, attention,
#       norms, elementwise, optimizer, EMA, communication, idle), the top kernels, the matmuls' TFLOP/s;
#   (c) LightningDiT-XL/1 on VA-VAE latents (a tiny random VA-VAE of the real geometry: 16x, 32 channels),
#       compiled, with the lightningdit-xl1-64ep recipe's losses, at the micro-batch its own plan picks:
#       images/s, memory against that plan;
#   (d) `dit-accel calibrate` of the DiT plan: the planner-vs-GPU points (then, if time is left, 14 of 28
#       blocks checkpointed).
# The machine runs the tree as it is: python3 with torch but without diffusers (carried as wheels in .whl/,
# from benchmarks/gpu_wheels.sh), the tree not installed (PYTHONPATH), no dit-plan / dit-accel / python.
#
#   bash benchmarks/gpu_wheels.sh                            # here, once: .whl/
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   bash benchmarks/gpu_check.sh --dry-run                   # any machine, on the CPU: tiny sizes, same flow
#
# Into $OUT (at most 8 files): summary.json, summary.md, log-tail.txt, plan.json, calibration.json,
# calibration-ckpt14.json, runs.tar.gz (metrics and logs, no weights). Everything else (data, plans, run
# folders) is made in a scratch folder outside $OUT: $GPU_CHECK_WORK, or a new one under /tmp.
# BUDGET_S (default 480) bounds the whole check; each stage gets its cap or what is left, whichever is less.
# SKIP=compiled,calibrate (stage names, comma-separated) leaves stages out, e.g. in a rerun on a warm machine.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
[[ "${1:-}" == "--dry-run" ]] && dry_run=1
out="${OUT:-${TMPDIR:-/tmp}/gpu_check_out}"
work="${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
budget_s="${BUDGET_S:-480}"
mkdir -p "$out" "$work"
: > "$work/stages.tsv"
log="$work/check.log"

say() { echo "[gpu_check +$SECONDS s] $*" | tee -a "$log"; }
summarise() { python3 benchmarks/gpu_check.py summary "$work" "$out" >> "$log" 2>&1 || say "summary failed (see the log)"; }

# After a run killed at its limit: until its processes have let go of the GPU (30 s at most), so that the
# next stage does not start beside their memory.
gpu_released() {
    command -v nvidia-smi > /dev/null || return 0
    local used
    for _ in $(seq 30); do
        used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2> /dev/null | head -1)
        [[ -z $used || $used -lt 2048 ]] && return 0
        sleep 1
    done
    say "the GPU still holds $used MiB 30 s after the stage ended"
}

# stage NAME CAP_S COMMAND...: at most CAP_S seconds or what is left of the budget; output to WORK/NAME.log
stage() {
    local name=$1 cap=$2 left=$((budget_s - SECONDS))
    shift 2
    local limit=$((cap < left ? cap : left))
    if [[ ",${SKIP:-}," == *",$name,"* ]] || ((limit < 20)); then
        say "$name: skipped (SKIP=${SKIP:-}; $left s of the ${budget_s} s budget left)"
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$work/stages.tsv"
        return 1
    fi
    say "$name: at most $limit s"
    local started=$SECONDS rc=0
    timeout -k 15 "$limit" "$@" > "$work/$name.log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" "$limit" >> "$work/stages.tsv"
    say "$name: exit $rc after $((SECONDS - started)) s$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
    ((rc == 124 || rc == 137)) && gpu_released
    summarise
    return "$rc"
}

say "work $work, out $out, budget $budget_s s, dry run $dry_run"
# 0. The carried wheels (diffusers) into a folder of their own; the tree itself on PYTHONPATH.
source benchmarks/gpu_site.sh
use_carried_wheels "$work/site" "$log" || say "installing .whl/*.whl failed (see the log)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$work/inductor"
if ((dry_run)); then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    plan_args=(--model DiT-S/2 --depth 2 --hidden 32 --heads 2 --resolution 32 --num-classes 4 --gpus 1
        --vram 8G --global-batch 8 --precision fp32)  # fp32: a CPU's bf16 matmuls are emulated and slow
    lightningdit_args=(--model LightningDiT-B/1 --depth 2 --hidden 32 --heads 2 --resolution 32 --num-classes 4
        --gpus 1 --vram 8G --global-batch 8 --precision fp32)
    resolution=32 per_class=4 steps="${STEPS:-4}" log_every="${LOG_EVERY:-2}" workers=0
    # Compiled with torch's aot_eager backend: the graphs are captured and their backward derived as on the
    # GPU, but no kernels are generated (inductor's C++ build of the block takes 80 s on 2 cores).
    ((${DRY_RUN_INDUCTOR:-0})) || export TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager"
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
    plan_args=(--gpu "${GPU:-h200}" --gpus 1 --model DiT-XL/2 --resolution 256 --precision bf16)
    # the DiT plan's global batch (256), not the recipe's 1024: 30 steps of 1024 on one GPU are minutes
    lightningdit_args=(--gpu "${GPU:-h200}" --gpus 1 --model LightningDiT-XL/1 --resolution 256 --precision bf16)
    resolution=256 per_class=64 steps="${STEPS:-30}" log_every="${LOG_EVERY:-6}" workers=4
fi

python3 benchmarks/gpu_check.py machine > "$work/machine.json" 2>> "$log"
if ! grep -q '"diffusers": "' "$work/machine.json"; then
    say "diffusers (or torch) is not importable here (log-tail.txt): run 'bash benchmarks/gpu_wheels.sh' where pip works, carry .whl"
    summarise
    exit 2
fi

# 1. The plan, and the synthetic latent cache (demo images through a tiny 8x VAE: latents of the plan's shape).
stage plan 60 python3 -m planner.cli "${plan_args[@]}" --latents precomputed --out "$work/plan" &&
    stage images 60 python3 -m dit_accel.cli demo-data "$work/images" --classes 4 --per-class "$per_class" \
        --resolution "$resolution" --vae "$work/vae" &&
    stage latents 60 python3 -m dit_accel.cli extract-latents --data-path "$work/images" --vae "$work/vae" \
        --resolution "$resolution" --out "$work/latents" --num-workers "$workers" || {
    say "no plan or no latent cache: nothing to train on"
    exit 1
}

# 2. The trainer, eager then compiled, at the plan's micro-batch.
# every run of the check: its length and logging, no checkpoint (10 GiB for DiT-XL/2), killed without a save
run_flags=(--max-steps "$steps" --log-every "$log_every" --checkpoint-every 1000000 --no-final-checkpoint
    --report-to none --no-progress-bar --preempt-signals '' --num-workers "$workers")
train=(python3 -m dit_accel.cli train --plan "$work/plan/plan.json" --latents "$work/latents" "${run_flags[@]}")
stage eager 120 "${train[@]}" --output-dir "$work/run-eager" --no-compile
stage compiled 170 "${train[@]}" --output-dir "$work/run-compiled" --compile

# 2b. FP8 matmuls (torchao float8 training, carried as a wheel): the compiled run again with --fp8, the same
# data and seed, beside it: img/s, memory and the loss. Its plan is the same bf16 one (the dry run's fp32
# plan, for a CPU's sake, gets a bf16 twin here: --fp8 trains beside bf16 only).
stage plan-fp8 30 python3 -m planner.cli "${plan_args[@]}" --precision bf16 --latents precomputed \
    --out "$work/plan-fp8" &&
    stage fp8 170 python3 -m dit_accel.cli train --plan "$work/plan-fp8/plan.json" --latents "$work/latents" \
        "${run_flags[@]}" --output-dir "$work/run-fp8" --compile --fp8

# 2c. Where the compiled step's time goes: a few steps under torch.profiler, summarised by kind.
stage profile 120 python3 benchmarks/profile_step.py --plan "$work/plan/plan.json" --out "$work/profile" \
    --warmup 2 --steps 3

# 3. LightningDiT-XL/1 compiled on VA-VAE latents (the recipe's cosine term and lognormal t), for its own plan.
stage plan-lightningdit 30 python3 -m planner.cli "${lightningdit_args[@]}" --latents precomputed \
    --out "$work/plan-lightningdit" &&
    stage images-vavae 60 python3 -m dit_accel.cli demo-data "$work/images-vavae" --classes 4 \
        --per-class "$per_class" --resolution "$resolution" --vae "$work/vavae" --vae-family va-vae &&
    stage latents-vavae 60 python3 -m dit_accel.cli extract-latents --data-path "$work/images-vavae" \
        --vae "$work/vavae" --resolution "$resolution" --out "$work/latents-vavae" --num-workers "$workers" &&
    stage lightningdit 150 python3 -m dit_accel.cli train --config lightningdit-xl1-64ep \
        --plan "$work/plan-lightningdit/plan.json" --latents "$work/latents-vavae" "${run_flags[@]}" \
        --sample-every 0 --output-dir "$work/run-lightningdit" --compile

# 4. The calibration points, written after each one (on the CPU calibrate refuses in one line: exit 2).
if ((dry_run)); then
    stage calibrate 60 python3 -m dit_accel.cli calibrate --plan "$work/plan/plan.json" --micro-batches 2,4 \
        --steps 1 --out "$out/calibration.json"
else
    stage calibrate 150 python3 -m dit_accel.cli calibrate --plan "$work/plan/plan.json" \
        --micro-batches 32,64,128 --steps 2 --max-micro-batch 1024 --out "$out/calibration.json"
    if ((budget_s - SECONDS >= 90)); then
        stage plan-ckpt14 30 python3 -m planner.cli "${plan_args[@]}" --latents precomputed --checkpointing 14 \
            --out "$work/plan-ckpt14" &&
            stage calibrate-ckpt14 150 python3 -m dit_accel.cli calibrate --plan "$work/plan-ckpt14/plan.json" \
                --micro-batches 32,64,128 --steps 2 --max-micro-batch 2048 --out "$out/calibration-ckpt14.json"
    fi
fi
say "done"
summarise
