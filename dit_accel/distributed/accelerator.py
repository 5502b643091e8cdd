"""The distributed set-up a plan describes: the Accelerator (DDP or FSDP2, precision, accumulation; hsdp's 2-D
device mesh), the launch checked against the plan, TF32 as planned, and the end of the process group.
FSDP2's per-block units are `distributed.fsdp`.

Which launches run which plan is decided by `planner.rules.launch_problems`, the same function
`dit-accel doctor` applies to the Accelerate YAML before the launch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dit_accel.distributed.fsdp import use_fsdp_on_cpu, uses_fsdp
from dit_accel.errors import UserError
from planner.planfile import Plan
from planner.rules import LaunchSettings, launch_problems
from planner.units import count


def check_launch(plan: Plan, world_size: int, plan_path: str) -> None:
    """The launched process count must be the plan's world size."""
    planned = plan.world_size
    if planned != world_size:
        raise UserError(
            f"{plan_path} is planned for {count(planned, 'process')} but {world_size} "
            f"{'was' if world_size == 1 else 'were'} launched",
            f"re-plan with `dit-plan --gpus {world_size}`, or launch {count(planned, 'process')}",
        )


def resolve_precision(plan_precision: str, device_type: str) -> str:
    """The plan's precision on this device. fp16 needs a GradScaler and a GPU: on a CPU, run fp32 and warn
    (bf16 would be a different recipe, and fp32 is what the fp16 run approximates)."""
    if plan_precision == "fp16" and device_type == "cpu":
        logging.getLogger("dit_accel.train").warning(
            "the plan says fp16, which needs a GPU; training in fp32 on this CPU instead"
        )
        return "fp32"
    return plan_precision


def fsdp_plugin_for(plan: Plan, plan_path: str, env: dict | None = None):
    """The launcher's settings (accelerate_config.yaml, exported as environment variables) checked against the
    plan, and for a sharded plan the FSDP2 plugin made from them; None for a DDP plan. Auto-wrap is switched
    off: `shard_blocks` makes the per-block units itself."""
    env = os.environ if env is None else env
    launched = int(env.get("WORLD_SIZE", "1") or 1)  # against the plan's world size: check_launch
    problems = launch_problems(
        plan.decision.sharding,
        plan.decision.precision,
        LaunchSettings.from_environment(env),
        launched,
        plan.cluster.nodes,
    )
    if problems:
        raise UserError(
            f"the launch config does not match {plan_path}: {'; '.join(problems)}",
            f"launch with the accelerate_config.yaml that dit-plan wrote next to {plan_path}",
        )
    if not plan.sharding.uses_fsdp:
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # every field from the launcher's FSDP_* environment
    plugin.auto_wrap_policy = None
    return plugin


def parallelism_config_for(plan: Plan, empty: bool = False):
    """hsdp: Accelerate's ParallelismConfig of the plan's 2-D mesh, (dp_replicate = nodes, dp_shard = GPUs per
    node); None otherwise. Its `get_device_mesh` builds the mesh with torch's init_device_mesh, rank r at
    (r // G, r % G): torchrun numbers the ranks node by node, so each shard group is one node's GPUs.

    `empty`: the same config with every size 1 (no mesh). A CPU Accelerator is MULTI_CPU, which Accelerate
    refuses a mesh for (it checks before `use_fsdp_on_cpu` switches it to FSDP), so on a CPU it is made with
    the empty one, which also keeps it from building one from the launcher's PARALLELISM_CONFIG_*
    environment, and `use_fsdp_on_cpu` installs the real one."""
    if not plan.sharding.within_node:
        return None
    from accelerate.utils import ParallelismConfig

    from planner.rules import hsdp_mesh

    sizes = {} if empty else hsdp_mesh(plan.cluster.nodes, plan.world_size)
    return ParallelismConfig(
        **{f"{name}_size": sizes.get(name, 1) for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    )


ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(env) -> bool:
    """Let the CUDA caching allocator grow segments in place (`expandable_segments`), unless the user set
    PYTORCH_CUDA_ALLOC_CONF themselves: a long run's reserved memory then stays close to what it allocates,
    where fixed-size segments fragment and runs die of OOM on reserved bytes. Returns whether it was set."""
    if env.get(ALLOCATOR_ENV):
        return False
    env[ALLOCATOR_ENV] = EXPANDABLE_SEGMENTS
    return True


# The process groups this process made, kept from being freed until it exits (end_process_group).
_kept_groups: list = []


def end_process_group(accelerator=None) -> None:
    """Leave the process groups where every rank has finished (no collective follows), without freeing them.

    Freeing a gloo group joins its worker threads while this thread holds the GIL, and a worker still dropping
    its last collective's tensors needs the GIL for their Python objects: the join deadlocks (seen here: a
    rank that trained and saved its last checkpoint hung in ~ProcessGroupGloo, as DDP's reducer let go of the
    group). Left to the interpreter's teardown, the same worker is ended there instead, which aborts the rank
    (SIGABRT, "terminate called without an active exception"). So the groups are destroyed (unregistered:
    nothing can use them) but kept referenced here, and the command ends through `errors.exit_command`, which skips
    the teardown that would free them. Nothing to do in one process. `accelerator`: then its
    `end_training` (the trackers), which finds no group left to destroy."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _kept_groups.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()
    if accelerator is not None:
        accelerator.end_training()


def make_accelerator(plan: Plan, plan_path: str, run_dir: Path, collective_timeout_s: float):
    """The Accelerator the plan describes; on a machine without CUDA the same config runs on the CPU.

    Sharded plans run FSDP2 with the launcher's FSDP settings (checked against the plan), reduce-scattering
    the gradients every micro-step (`sync_each_batch`): accumulating under `no_sync` would keep a full
    unsharded gradient per rank, which the plan does not count.
    """
    from accelerate import Accelerator
    from accelerate.utils import (
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        InitProcessGroupKwargs,
        ProjectConfiguration,
    )

    from planner.rules import PRECISIONS

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        use_expandable_segments(os.environ)  # before the first CUDA allocation
    mixed_precision = PRECISIONS[
        resolve_precision(plan.decision.precision, device_type)
    ].accelerate_mixed_precision
    fsdp_plugin = fsdp_plugin_for(plan, plan_path)
    accelerator = Accelerator(
        cpu=device_type == "cpu",
        mixed_precision=mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.decision.grad_accum, sync_each_batch=fsdp_plugin is not None
        ),
        fsdp_plugin=fsdp_plugin,
        parallelism_config=parallelism_config_for(plan, empty=device_type == "cpu"),
        log_with=None,  # the run's trackers (--report-to) are chosen and started by dit_accel.train.trackers
        project_config=ProjectConfiguration(
            project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")
        ),
        # As planned: with gradient_as_bucket_view DDP's buckets ARE the .grad tensors (4 bytes/param less).
        kwargs_handlers=[
            DistributedDataParallelKwargs(gradient_as_bucket_view=plan.decision.gradient_as_bucket_view),
            InitProcessGroupKwargs(timeout=process_group_timeout(collective_timeout_s)),
        ],
    )
    if fsdp_plugin is not None and not uses_fsdp(accelerator):
        if accelerator.device.type != "cpu":
            raise UserError(
                f"{plan_path} shards the model but accelerate set up {accelerator.distributed_type}",
                "launch with the plan's accelerate_config.yaml",
            )
        use_fsdp_on_cpu(accelerator, fsdp_plugin, mixed_precision, parallelism_config_for(plan))
    return accelerator


def process_group_timeout(collective_timeout_s: float):
    """The process group's timeout: --collective-timeout-s plus a margin, a backstop behind the watchdog
    (dit_accel.run.watchdog), which ends a stuck rank at the timeout itself and names it; a collective that
    times out raises a bare backend error instead."""
    from datetime import timedelta

    return timedelta(seconds=collective_timeout_s + max(60.0, 0.1 * collective_timeout_s))


LOST_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer_message(error: BaseException, run_dir: str) -> str | None:
    """One line for a collective that failed because another rank's process went away (gloo says so at
    once; NCCL hangs, which the watchdog ends), where that rank's own error explains the run and this one's
    traceback is noise; None for any other error."""
    if not (isinstance(error, RuntimeError) and any(words in str(error) for words in LOST_PEER_WORDS)):
        return None
    first_line = str(error).splitlines()[0][:200]
    return (
        f"lost contact with another rank in a collective ({first_line}); that rank's error is above, or in "
        f"{Path(run_dir) / 'logs'}"
    )


def planned_tf32(requested: bool, plan: Plan) -> bool:
    """TF32 as the plan was rated: on when asked (--tf32, the trainer's default), except for a plan rated at
    IEEE fp32 (`dit-plan --precision fp32`), whose estimate assumed it off."""
    return requested and plan.matmul != "ieee-fp32"


def tf32_as_planned(requested: bool, plan: Plan, device: torch.device) -> str:
    """Set TF32 as the plan was rated (`planned_tf32`) and say how it ended up, for the run's first log line."""
    if set_tf32(planned_tf32(requested, plan), device):
        return "on"
    if device.type != "cuda":
        return "n/a on CPU"
    return "off (--no-tf32)" if not requested else "off (an IEEE fp32 plan)"


def set_tf32(enabled: bool, device: torch.device) -> bool:
    """TF32 matmuls and convolutions on CUDA, as the DiT recipe trains and the planner rates fp32 (TF32 peak).
    Returns whether TF32 is on; always False off CUDA, where the switch means nothing."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled
