"""A SLURM batch script for a plan, ready to submit once its marked placeholders are filled in: one task per
node, each running `accelerate launch` with its node's rank; the first node of the allocation is the
rendezvous host unless the plan names one.

Preemption: SLURM signals the batch shell (`--signal=B:USR1@...`) before the time limit; the shell forwards
the signal to the training step, every rank saves the step it is at and exits 4 (dit_accel.errors), and the
shell requeues the job (`--requeue`, `scontrol requeue`), which resumes from that checkpoint (`--resume
auto`). `accelerate launch` reports any failed rank as 1, so the shell reads the ranks' own exit codes from
DIT_ACCEL_EXIT_DIR, a folder beside the plan.
"""

from __future__ import annotations

import shlex

from planner.units import count

SIGNAL_LEAD_S = 300  # USR1 this long before the time limit: time to finish a step and save one checkpoint
EXIT_PREEMPTED = 4  # dit_accel.errors.EXIT_PREEMPTED; the planner does not import dit_accel
PLACEHOLDERS = ("FILL_IN_PARTITION", "FILL_IN_HH:MM:SS", "FILL_IN_CPUS")
DATA_EXAMPLES = {  # plan decision.latents -> the trainer's data flags in the script's example
    "precomputed": "--latents /data/latents256",
    "online": "--data-path /data/imagenet/train --vae /models/sd-vae-ft-ema",
    "pixel": "--data-path /data/imagenet/train",
}


def slurm_script(
    plan: dict, config_name: str = "accelerate_config.yaml", plan_name: str = "plan.json"
) -> str:
    cluster, model = plan["cluster"], plan["model"]
    nodes, gpus, world = cluster["nodes"], cluster["gpus_per_node"], cluster["world_size"]
    port = int(cluster.get("main_process_port") or 29500)
    fixed_ip = cluster.get("main_process_ip")
    main_ip = (
        shlex.quote(fixed_ip) if fixed_ip else '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    )
    job = f"dit-{model['name'].replace('/', '').replace('DiT-', '').lower()}"
    data = DATA_EXAMPLES.get(plan.get("decision", {}).get("latents", "precomputed"), DATA_EXAMPLES["pixel"])
    partition, time_limit, cpus = PLACEHOLDERS
    return f"""#!/bin/bash
# SLURM job written by dit-plan: {model["name"]} @ {model["resolution"]} px on {count(nodes, "node")} x {count(gpus, "GPU")}.
# Before submitting, replace the three FILL_IN values below (sbatch refuses them as they are):
#   --partition, --time (the limit, e.g. 48:00:00) and --cpus-per-task (the node's CPUs for the loaders).
# Submit from the plan directory:   sbatch launch.slurm {data} --output-dir runs/{job}
# Arguments after the script name go to dit_accel.train, after --resume auto (a requeued job continues).
# Preemption: USR1 {SIGNAL_LEAD_S} s before the limit is forwarded to the step; every rank saves the step it
# is at and exits {EXIT_PREEMPTED}; the job then requeues itself and resumes from that checkpoint. A step that
# such a signal ended before a rank could say so (the launcher or the ranks still starting) requeues too.
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --partition={partition}
#SBATCH --time={time_limit}
#SBATCH --cpus-per-task={cpus}
#SBATCH --exclusive
#SBATCH --signal=B:USR1@{SIGNAL_LEAD_S}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -uo pipefail  # not -e: the training step's exit code decides what happens next
export PLAN_DIR="${{PLAN_DIR:-$SLURM_SUBMIT_DIR}}"
export MAIN_PROCESS_IP="{main_ip}"
export MAIN_PROCESS_PORT={port}
# Each rank writes its exit code here (accelerate launch itself reports 1 for any failed rank).
export DIT_ACCEL_EXIT_DIR="$PLAN_DIR/exit-codes/${{SLURM_JOB_ID:-local}}.${{SLURM_RESTART_COUNT:-0}}"
mkdir -p "$DIT_ACCEL_EXIT_DIR"
# torch elastic forwards these to the ranks, and waits this long for them to save before killing them.
export TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$(( {SIGNAL_LEAD_S} - 30 ))

# One task per node; each starts {count(gpus, "process")}. SLURM_NODEID is this node's rank (0 = the main node).
srun --ntasks={nodes} --ntasks-per-node=1 bash -c '
  exec accelerate launch \\
    --config_file "$PLAN_DIR/{config_name}" \\
    --num_machines {nodes} \\
    --num_processes {world} \\
    --machine_rank "$SLURM_NODEID" \\
    --main_process_ip "$MAIN_PROCESS_IP" \\
    --main_process_port "$MAIN_PROCESS_PORT" \\
    --rdzv_backend static \\
    --same_network \\
    -m dit_accel.train --plan "$PLAN_DIR/{plan_name}" --resume auto "$@"
' dit-plan-launch "$@" &
step_pid=$!

# SLURM signals only this shell (B:); pass the signal on to the step, whose tasks get it from srun.
interrupted=0
stopped=0
forward() {{ interrupted=1; stopped=1; kill -"$1" "$step_pid" 2>/dev/null || true; }}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
while :; do
  interrupted=0
  wait "$step_pid"
  code=$?
  [ "$interrupted" = 1 ] && kill -0 "$step_pid" 2>/dev/null && continue  # a signal cut the wait short
  [ "$interrupted" = 1 ] && {{ wait "$step_pid"; code=$?; }}
  break
done

# Requeue on {EXIT_PREEMPTED}, or a rank's record of it; or when a stop signal ended the step before any rank
# recorded a code that says otherwise (bad input, a NaN stop, a hang).
explained() {{ grep -qsE '"code": [235][,}}]' "$DIT_ACCEL_EXIT_DIR"/exit_rank*.json; }}
if [ "$code" -eq {EXIT_PREEMPTED} ] \\
    || grep -qs '"code": {EXIT_PREEMPTED}' "$DIT_ACCEL_EXIT_DIR"/exit_rank*.json \\
    || {{ [ "$stopped" = 1 ] && [ "$code" -ne 0 ] && ! explained; }}; then
  echo "launch.slurm: preempted (exit {EXIT_PREEMPTED}): requeueing job $SLURM_JOB_ID, which resumes from its newest checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$code"
"""
