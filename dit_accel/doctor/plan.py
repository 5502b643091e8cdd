"""The parts of plan.json the doctor compares against this machine, read once into named fields.

The plan is read by `planner.planfile.read_plan`, as the trainer reads it: a plan that lacks a key the
checks need is a bad plan, reported on one line with the fix (re-run dit-plan), never a KeyError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dit_accel.errors import UserError
from planner.planfile import Plan, read_plan


@dataclass(frozen=True)
class PlanFacts:
    path: Path
    model_name: str
    resolution: int
    latent_size: int
    in_channels: int
    params_trainable: int
    nodes: int
    gpus_per_node: int
    world_size: int
    vram_bytes: int
    gpu: str | None
    global_batch: int
    micro_batch: int
    grad_accum: int
    checkpointed_blocks: int
    precision: str  # bf16 | fp16 | fp32
    sharding: str  # ddp | zero2 | zero3 | hsdp
    latents: str  # precomputed | online | pixel
    ema: bool
    peak_bytes: int  # per GPU
    needed_bytes: int  # per GPU: the least the step runs in (the cache released under pressure)
    budget_bytes: int  # per GPU: vram minus the plan's headroom
    host: dict = field(default_factory=dict)  # the plan's per-node host RAM estimate, as written
    inputs: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    main_process_ip: str | None = None
    main_process_port: int | None = None
    plan: Plan | None = field(default=None, repr=False)  # the typed plan, for the trainer's own checks

    @property
    def host_bytes(self) -> int | None:
        """Per-node host RAM the plan expects a launch to use (the exitcode -9 budget)."""
        for key in ("per_node_bytes", "peak_bytes", "total_bytes", "host_bytes"):
            if isinstance(self.host.get(key), (int, float)):
                return int(self.host[key])
        return None

    @property
    def loader_workers(self) -> int | None:
        """Data-loader workers per rank the plan's host estimate assumed."""
        value = self.host.get("loader_workers_per_rank")
        return int(value) if isinstance(value, int) else None

    def host_bytes_for_workers(self, workers: int) -> int | None:
        """The per-node host estimate rescaled to the run's worker count: the workers' resident memory and
        their prefetched batches grow with it, the rest does not."""
        estimate, assumed = self.host_bytes, self.loader_workers
        per_rank = self.host.get("per_rank")
        if estimate is None or not assumed or not isinstance(per_rank, dict):
            return estimate
        worker_bytes = sum(int(per_rank.get(key, 0)) for key in ("loader_workers", "loader_prefetch"))
        ranks = int(self.host.get("ranks_per_node", self.gpus_per_node))
        return estimate + ranks * worker_bytes * (workers - assumed) // assumed

    @property
    def num_classes(self) -> int:
        """Class labels the model embeds (the trainer's rule: the plan's, else ImageNet's 1000)."""
        from planner.spec import NUM_CLASSES

        return int(self.model.get("num_classes") or self.inputs.get("num_classes") or NUM_CLASSES)

    @property
    def vae(self) -> str | None:
        """The VAE the plan names (identity of the latent space), if any."""
        value = self.inputs.get("vae")
        return str(value) if value else None


def load_plan(path: str | Path) -> PlanFacts:
    """Read a plan.json exactly as the trainer does (`planner.planfile.read_plan`: same refusals, same
    messages), then name the facts the checks compare against this machine."""
    path = Path(path)
    plan = read_plan(path)
    model, cluster, decision, spec = plan.model, plan.cluster, plan.decision, plan.spec()
    if plan.memory is None:
        raise UserError(f"plan {path} has no memory estimate", "re-make it with dit-plan ... --out DIR")
    return PlanFacts(
        path=path,
        model_name=model.name,
        resolution=model.resolution,
        latent_size=spec.latent_size,
        in_channels=spec.in_channels,
        params_trainable=spec.params_trainable,
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node or cluster.world_size,
        world_size=cluster.world_size,
        vram_bytes=cluster.vram_bytes,
        gpu=cluster.gpu,
        global_batch=plan.global_batch,
        micro_batch=decision.micro_batch,
        grad_accum=decision.grad_accum,
        checkpointed_blocks=decision.checkpointed_blocks,
        precision=decision.precision,
        sharding=decision.sharding,
        latents=decision.latents,
        ema=decision.ema,
        peak_bytes=plan.memory.peak_bytes,
        needed_bytes=plan.memory.fit_bytes,
        budget_bytes=plan.memory.budget_bytes,
        host=plan.host,
        inputs=plan.inputs,
        model=plan.to_json()["model"],
        main_process_ip=cluster.main_process_ip,
        main_process_port=cluster.main_process_port,
        plan=plan,
    )
