"""The Accelerate config a plan launches with: topology and precision, nothing Accelerate does not know.

Accelerate 1.15 rejects unknown top-level keys, so everything else (micro-batch, accumulation, checkpointing)
travels in plan.json.

Sharded plans use FSDP2 (`fully_shard`, per-parameter DTensor shards): zero2 is `reshard_after_forward:
false` (gathered parameters stay until the end of backward, like SHARD_GRAD_OP), zero3 is `true`
(FULL_SHARD). The value is written explicitly: the launcher's default is true, i.e. zero3 whatever was
meant. hsdp is zero3 inside each node, replicated across nodes: FSDP2 on a 2-D device mesh, which Accelerate
1.15 configures with its ParallelismConfig (`parallelism_config`: dp_replicate_size = nodes, dp_shard_size =
GPUs per node; FSDP1's HYBRID_SHARD strategy does not exist for FSDP2).

No auto-wrap: every block's embedder is the one shared CombinedTimestepLabelEmbeddings, and a parameter seen
by two FSDP units is an error, so the trainer shards each block's own layers as one unit and leaves the
embedder to the root unit (docs/training.md, "Sharded plans").
"""

from __future__ import annotations

import yaml

from planner.rules import SHARDING_MODES, hsdp_mesh


def accelerate_config(plan: dict) -> dict:
    """The config as a dict, in the order `accelerate config` writes it."""
    cluster, decision = plan["cluster"], plan["decision"]
    world, nodes = cluster["world_size"], cluster["nodes"]
    if decision["sharding"] != "ddp":
        distributed_type = "FSDP"
    else:
        distributed_type = "MULTI_GPU" if world > 1 else "NO"
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed_type,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": decision["mixed_precision"],
        "num_machines": nodes,
        "num_processes": world,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }
    if nodes > 1:
        config["main_process_ip"] = cluster.get("main_process_ip")
        config["main_process_port"] = cluster.get("main_process_port")
    if distributed_type == "FSDP":
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": SHARDING_MODES[decision["sharding"]].reshard_after_forward,
            "fsdp_auto_wrap_policy": "NO_WRAP",  # dit_accel shards per block itself, the shared embedder in the root
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,  # every rank builds the same weights from the run's seed
            "fsdp_activation_checkpointing": False,  # dit_accel checkpoints the planned blocks itself
        }
    if SHARDING_MODES[decision["sharding"]].within_node:  # hsdp: Accelerate's ParallelismConfig, 2-D mesh
        config["parallelism_config"] = {
            f"parallelism_config_{name}_size": size for name, size in hsdp_mesh(nodes, world).items()
        }
    return config


def accelerate_yaml(plan: dict) -> str:
    d = plan["decision"]
    header = (
        f"# Accelerate config written by dit-plan for {plan['model']['name']} @ {plan['model']['resolution']} px.\n"
        f"# Launch: accelerate launch --config_file accelerate_config.yaml -m dit_accel.train --plan plan.json ...\n"
        f"# The step itself (micro-batch {d['micro_batch']} x accumulation {d['grad_accum']}, "
        f"{d['checkpointed_blocks']} checkpointed blocks) is in plan.json: Accelerate's YAML has no keys for it.\n"
    )
    return header + yaml.safe_dump(accelerate_config(plan), sort_keys=False, default_flow_style=False)
