"""The Accelerate config a plan launches with: topology and precision, nothing Accelerate does not know.

Accelerate 1.15 rejects unknown top-level keys, so everything else (micro-batch, accumulation, checkpointing)
travels in plan.json. For FSDP1 the sharding strategy is written explicitly: left out, the launcher makes
it FULL_SHARD whatever was meant.
"""

from __future__ import annotations

import yaml

FSDP_STRATEGY = {"zero2": "SHARD_GRAD_OP", "zero3": "FULL_SHARD"}
WRAPPED_BLOCK = "BasicTransformerBlock"  # diffusers' DiT block: one FSDP unit per transformer block


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
            "fsdp_version": 1,
            "fsdp_sharding_strategy": FSDP_STRATEGY[decision["sharding"]],
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": WRAPPED_BLOCK,
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_forward_prefetch": False,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_use_orig_params": True,
            "fsdp_activation_checkpointing": False,  # dit_accel checkpoints the planned blocks itself
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
