"""A SLURM batch script for multi-node plans: one task per node, each running `accelerate launch` with its
node's rank. The first node of the allocation is the rendezvous host unless the plan names one."""

from __future__ import annotations

import shlex


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
    return f"""#!/bin/bash
# SLURM job written by dit-plan: {model["name"]} @ {model["resolution"]} px on {nodes} nodes x {gpus} GPUs.
# Submit from the plan directory:   sbatch launch.slurm --data-path /data/imagenet/train --output-dir runs/xl2
# Arguments after the script name go to dit_accel.train.
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --exclusive
#SBATCH --output=%x-%j.out

set -euo pipefail
export PLAN_DIR="${{PLAN_DIR:-$SLURM_SUBMIT_DIR}}"
export MAIN_PROCESS_IP="{main_ip}"
export MAIN_PROCESS_PORT={port}

# One task per node; each starts {gpus} processes. SLURM_NODEID is this node's rank (0 = the main node).
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
    -m dit_accel.train --plan "$PLAN_DIR/{plan_name}" "$@"
' dit-plan-launch "$@"
"""
