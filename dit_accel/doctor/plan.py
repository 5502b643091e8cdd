"""The parts of plan.json the doctor compares against this machine, read once into named fields.

The keys follow DESIGN.md's plan.json contract; a plan that lacks one the checks need is a bad plan,
reported on one line with the fix (re-run dit-plan), never a KeyError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dit_accel.errors import UserError


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
    sharding: str  # ddp | zero2 | zero3
    latents: str  # precomputed | online | pixel
    ema: bool
    peak_bytes: int  # per GPU
    budget_bytes: int  # per GPU: vram minus the plan's headroom
    host: dict = field(default_factory=dict)  # the plan's per-node host RAM estimate, as written
    inputs: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    main_process_ip: str | None = None
    main_process_port: int | None = None
    raw: dict = field(default_factory=dict, repr=False)  # the whole plan, for the trainer's own checks

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


# PlanFacts field -> (plan.json key, type): the keys every check relies on (DESIGN.md's contract)
_REQUIRED = {
    "model_name": ("model.name", str), "resolution": ("model.resolution", int), "latent_size": ("model.latent_size", int),
    "in_channels": ("model.in_channels", int), "params_trainable": ("model.params_trainable", int),
    "nodes": ("cluster.nodes", int), "gpus_per_node": ("cluster.gpus_per_node", int),
    "world_size": ("cluster.world_size", int), "vram_bytes": ("cluster.vram_bytes", int),
    "global_batch": ("global_batch", int), "micro_batch": ("decision.micro_batch", int),
    "grad_accum": ("decision.grad_accum", int), "checkpointed_blocks": ("decision.checkpointed_blocks", int),
    "precision": ("decision.precision", str), "sharding": ("decision.sharding", str),
    "latents": ("decision.latents", str), "peak_bytes": ("memory.peak_bytes", int),
    "budget_bytes": ("memory.budget_bytes", int),
}


def _get(plan: dict, dotted: str, path: Path):
    node = plan
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise UserError(f"{path}: plan.json has no {dotted!r}; re-make it with dit-plan ... --out DIR")
        node = node[part]
    return node


def load_plan(path: str | Path) -> PlanFacts:
    """Read a plan.json exactly as the trainer does (same refusals, same messages), then the keys the
    checks compare against this machine; any problem is one UserError line with the fix."""
    from dit_accel.train import read_plan

    path = Path(path)
    try:
        plan = read_plan(path)
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read plan {path}: {error}") from None
    values = {name: kind(_get(plan, key, path)) for name, (key, kind) in _REQUIRED.items()}
    cluster, decision = plan["cluster"], plan["decision"]
    return PlanFacts(
        path=path, **values, gpu=cluster.get("gpu"), ema=bool(decision.get("ema", True)),
        host=plan["host"] if isinstance(plan.get("host"), dict) else {},
        inputs=plan["inputs"] if isinstance(plan.get("inputs"), dict) else {},
        model=plan["model"], main_process_ip=cluster.get("main_process_ip"),
        main_process_port=cluster.get("main_process_port"), raw=plan,
    )
