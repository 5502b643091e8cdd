"""plan.json read back as typed values: the contract between `dit-plan` and everything that runs a plan.

`make_plan` writes the JSON (planner/plan.py); every reader (the trainer, verify, calibrate, the doctor, export)
goes through `read_plan`, which checks the schema, every key a reader relies on, its type, and the rule that
makes a plan a plan: `micro_batch x grad_accum x world_size == global_batch`. A hand-edited plan that breaks
one is refused in one line that names the key and the fix, never a KeyError later on rank 3.

The JSON format is unchanged by reading: `Plan.to_json()` gives back the object that was read (plus any
decision changed with `Plan.with_decision`), so a run folder's copy of plan.json is the plan it trained with.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from planner.components import COMPONENTS
from planner.decision import Decision
from planner.errors import PlanError
from planner.repa import DEFAULT_PROJECTOR_DIM, ENCODERS
from planner.rules import OBJECTIVES, PRECISIONS, SHARDING_MODES, Precision, ShardingMode, default_matmul
from planner.spec import (
    FAMILIES,
    LATENT_MODES,
    NUM_CLASSES,
    OPTIONS,
    TOKENIZERS,
    DiTSpec,
    custom_spec,
    model_spec,
)
from planner.units import count

SCHEMA = "dit-plan/1"
KNOWN_SCHEMAS = (SCHEMA,)
REMAKE = "re-create it with dit-plan"


@dataclass(frozen=True)
class PlanModel:
    name: str
    resolution: int
    latent_size: int | None = None  # derived from the architecture (the spec); written by every dit-plan
    in_channels: int | None = None
    depth: int | None = None  # the architecture; older plans named a family member instead
    hidden: int | None = None
    heads: int | None = None
    patch: int | None = None
    num_classes: int | None = None
    params_trainable: int | None = None
    fwd_flops_per_image: float | None = None
    family: str = "dit"  # written since LightningDiT; older plans are DiT's
    tokenizer: str = ""  # "" = the family's
    options: dict = field(default_factory=dict)  # LightningDiT's block switches (planner.spec.OPTIONS)


@dataclass(frozen=True)
class PlanCluster:
    nodes: int
    gpus_per_node: int
    world_size: int
    vram_bytes: int
    gpu: str | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None


@dataclass(frozen=True)
class PlanMemory:
    """Bytes per GPU: the components at the peak moment, the peak, and the budget it was fitted into."""

    components: dict[str, int]
    peak_bytes: int
    budget_bytes: int
    peak_phase: str | None = None
    # the caching allocator's peaks (plans written before the reserved model lack them: None)
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    # the least the step runs in once the allocator releases its cache under pressure (older plans: None)
    needed_bytes: int | None = None

    @property
    def fit_bytes(self) -> int:
        """What must fit on the GPU for the step to run: the needed figure, or the peak for older plans."""
        return self.peak_bytes if self.needed_bytes is None else self.needed_bytes

    @property
    def overhead_bytes(self) -> int:
        return self.components.get("overhead", 0)

    @property
    def tensor_bytes(self) -> int:
        """The peak less what no tensor shows (CUDA context, NCCL, the allocator's rounding and
        fragmentation): what `torch.cuda.max_memory_allocated` is held to."""
        if self.allocated_peak_bytes is not None:
            return self.allocated_peak_bytes
        return self.peak_bytes - self.overhead_bytes - self.components.get("allocator", 0)


@dataclass(frozen=True)
class PlanThroughput:
    est_images_per_s: float | None = None
    step_flops: float | None = None
    assumed_mfu: float | None = None
    step_time_s: float | None = None
    # optional, written since the MFU table and time to train (older plans lack them)
    est_images_per_s_low: float | None = None
    est_images_per_s_high: float | None = None
    matmul: str | None = None  # bf16 | fp16 | tf32 | ieee-fp32; older fp32 plans were planned at TF32
    train_steps: int | None = None
    time_to_train_s: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None


@dataclass(frozen=True)
class Plan:
    """A plan as read from plan.json. `decision` is the planner's own `Decision`."""

    schema: str
    model: PlanModel
    cluster: PlanCluster
    global_batch: int
    decision: Decision
    memory: PlanMemory | None
    throughput: PlanThroughput
    compile: bool = False  # decision.compile: torch.compile per block on CUDA; False for plans before it
    objective: str = "ddpm"  # dit-plan --objective (planner.rules.OBJECTIVES); ddpm for plans before it
    inputs: dict = field(default_factory=dict)  # what the plan was made from, as given
    host: dict = field(default_factory=dict)  # the per-node host RAM estimate, as written
    assumptions: dict = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    source: dict = field(default_factory=dict, repr=False, compare=False)  # the JSON object itself

    @property
    def precision(self) -> Precision:
        return PRECISIONS[self.decision.precision]

    @property
    def sharding(self) -> ShardingMode:
        return SHARDING_MODES[self.decision.sharding]

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def matmul(self) -> str:
        """The matmul mode the plan was rated at (bf16, fp16, tf32, ieee-fp32), which the trainer runs: an fp32
        plan from before the mode was written trains with TF32, the trainer's default."""
        return self.throughput.matmul or default_matmul(self.decision.precision)

    def spec(self) -> DiTSpec:
        return spec_from_plan(self)

    def with_decision(self, **changes) -> Plan:
        """The same plan with some decision fields changed (a traced variant, a different micro-batch)."""
        source = copy.deepcopy(self.source)
        source.setdefault("decision", {}).update(changes)
        return dataclasses.replace(
            self, decision=dataclasses.replace(self.decision, **changes), source=source
        )

    def to_json(self) -> dict:
        return copy.deepcopy(self.source)


# --- reading -----------------------------------------------------------------------------------------------

_MISSING = object()


class _Reader:
    """Typed access to one section of the plan, each refusal one PlanError line naming the key."""

    def __init__(self, data, where: str, origin: str):
        self.where, self.origin = where, origin
        if not isinstance(data, dict):
            self.fail(f"{where or 'the plan'} is not a JSON object")
        self.data = data

    def fail(self, problem: str):
        raise PlanError(f"plan {self.origin}: {problem}", f"{REMAKE}")

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def section(self, key: str, optional: bool = False) -> _Reader | None:
        if key not in self.data:
            if optional:
                return None
            self.fail(f"it lacks {self.name(key)}")
        return _Reader(self.data[key], self.name(key), self.origin)

    def get(self, key: str, kind, default=_MISSING, minimum: int | None = None, choices=None):
        value = self.data.get(key, _MISSING)
        if value is _MISSING or (value is None and default is not _MISSING):
            if default is _MISSING:
                self.fail(f"it lacks {self.name(key)}")
            return default
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(f"{self.name(key)} is {value!r}, not a whole number")
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.fail(f"{self.name(key)} is {value!r}, not a number")
        elif not isinstance(value, kind):
            self.fail(f"{self.name(key)} is {value!r}, not a {kind.__name__}")
        if minimum is not None and value < minimum:
            bound = "positive" if minimum == 1 else f"at least {minimum}"
            self.fail(f"{self.name(key)} is {value}, it must be {bound}")
        if choices is not None and value not in choices:
            self.fail(f"{self.name(key)} is {value!r}, expected one of {', '.join(choices)}")
        return value


def parse_plan(data: dict, origin: str = "plan.json") -> Plan:
    """A plan.json object (as `make_plan` returns it) checked and typed; `origin` names it in errors."""
    top = _Reader(data, "", origin)
    schema = data.get("schema")
    if schema not in KNOWN_SCHEMAS:
        raise PlanError(
            f"plan {origin} has schema {schema!r} but this dit-accel reads {', '.join(KNOWN_SCHEMAS)}: "
            f"re-plan with the dit-plan of this dit-accel version"
        )
    m = top.section("model")
    model = PlanModel(
        name=m.get("name", str),
        resolution=m.get("resolution", int, minimum=1),
        latent_size=m.get("latent_size", int, None, minimum=1),
        in_channels=m.get("in_channels", int, None, minimum=1),
        depth=m.get("depth", int, None, minimum=1),
        hidden=m.get("hidden", int, None, minimum=1),
        heads=m.get("heads", int, None, minimum=1),
        patch=m.get("patch", int, None, minimum=1),
        num_classes=m.get("num_classes", int, None, minimum=1),
        params_trainable=m.get("params_trainable", int, None, minimum=1),
        fwd_flops_per_image=m.get("fwd_flops_per_image", float, None),
        family=m.get("family", str, "dit", choices=FAMILIES),
        tokenizer=m.get("tokenizer", str, "", choices=("", *TOKENIZERS)),
        options={key: m.get(key, bool) for key in OPTIONS if key in m.data},
    )
    c = top.section("cluster")
    cluster = PlanCluster(
        nodes=c.get("nodes", int, 1, minimum=1),
        gpus_per_node=c.get("gpus_per_node", int, None, minimum=1) or 0,
        world_size=c.get("world_size", int, minimum=1),
        vram_bytes=c.get("vram_bytes", int, 0, minimum=0),
        gpu=c.get("gpu", str, None),
        main_process_ip=c.get("main_process_ip", str, None),
        main_process_port=c.get("main_process_port", int, None, minimum=1),
    )
    if cluster.gpus_per_node and cluster.nodes * cluster.gpus_per_node != cluster.world_size:
        top.fail(
            f"cluster.world_size {cluster.world_size} is not nodes x gpus_per_node "
            f"({cluster.nodes} x {cluster.gpus_per_node})"
        )
    d = top.section("decision")
    decision = Decision(
        micro_batch=d.get("micro_batch", int, minimum=1),
        grad_accum=d.get("grad_accum", int, minimum=1),
        checkpointed_blocks=d.get("checkpointed_blocks", int, minimum=0),
        precision=d.get("precision", str, choices=tuple(PRECISIONS)),
        sharding=d.get("sharding", str, "ddp", choices=tuple(SHARDING_MODES)),
        latents=d.get("latents", str, choices=LATENT_MODES),
        ema=d.get("ema", bool, True),
        adamw=d.get("adamw", str, "fused", choices=("fused", "foreach", "single")),
        gradient_as_bucket_view=d.get("gradient_as_bucket_view", bool, False),
        repa=d.get("repa", str, "", choices=("", *ENCODERS)),
        repa_projector_dim=d.get("repa_projector_dim", int, DEFAULT_PROJECTOR_DIM, minimum=1),
    )
    if SHARDING_MODES[decision.sharding].within_node and not (
        cluster.nodes > 1 and cluster.gpus_per_node > 1
    ):  # hsdp's mesh is nodes x GPUs per node: both known, both more than one
        top.fail(
            f"decision.sharding hsdp needs several nodes of several GPUs, the cluster is "
            f"{count(cluster.nodes, 'node')} of {count(cluster.gpus_per_node or 0, 'GPU')}"
        )
    global_batch = top.get("global_batch", int, minimum=1)
    if decision.micro_batch * decision.grad_accum * cluster.world_size != global_batch:
        top.fail(
            f"global_batch {global_batch} != micro_batch x grad_accum x world_size "
            f"({decision.micro_batch} x {decision.grad_accum} x {cluster.world_size})"
        )
    if model.depth is not None and decision.checkpointed_blocks > model.depth:
        top.fail(
            f"decision.checkpointed_blocks {decision.checkpointed_blocks} is more than the model's "
            f"{model.depth} blocks"
        )
    mem = top.section("memory", optional=True)
    memory = None
    if mem is not None:
        memory = PlanMemory(
            components={name: mem.get(name, int, 0, minimum=0) for name in COMPONENTS},
            peak_bytes=mem.get("peak_bytes", int, minimum=0),
            budget_bytes=mem.get("budget_bytes", int, 0),
            peak_phase=mem.get("peak_phase", str, None),
            allocated_peak_bytes=mem.get("allocated_peak_bytes", int, None, minimum=0),
            reserved_peak_bytes=mem.get("reserved_peak_bytes", int, None, minimum=0),
            needed_bytes=mem.get("needed_bytes", int, None, minimum=0),
        )
    t = top.section("throughput", optional=True) or _Reader({}, "throughput", origin)
    throughput = PlanThroughput(
        est_images_per_s=t.get("est_images_per_s", float, None),
        step_flops=t.get("step_flops", float, None),
        assumed_mfu=t.get("assumed_mfu", float, None),
        step_time_s=t.get("step_time_s", float, None),
        est_images_per_s_low=t.get("est_images_per_s_low", float, None),
        est_images_per_s_high=t.get("est_images_per_s_high", float, None),
        matmul=t.get("matmul", str, None),
        train_steps=t.get("train_steps", int, None, minimum=1),
        time_to_train_s=t.get("time_to_train_s", float, None),
        gpu_hours=t.get("gpu_hours", float, None),
        cost=t.get("cost", float, None),
    )
    plan = Plan(
        schema=schema,
        model=model,
        cluster=cluster,
        global_batch=global_batch,
        decision=decision,
        memory=memory,
        throughput=throughput,
        compile=d.get("compile", bool, False),  # older plans were sized and run eager
        objective=top.get("objective", str, "ddpm", choices=tuple(OBJECTIVES)),
        inputs=top.get("inputs", dict, {}),
        host=top.get("host", dict, {}),
        assumptions=top.get("assumptions", dict, {}),
        warnings=tuple(top.get("warnings", list, [])),
        source=copy.deepcopy(data),
    )
    spec_from_plan(plan)  # the network must be buildable: a bad width or head count is the plan's fault
    return plan


def read_plan(path: str | Path) -> Plan:
    """plan.json from disk, checked (see `parse_plan`); a missing or unreadable file is one line too."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(
            f"plan {path} not found: make one with `dit-plan --gpus N --vram SIZE --out DIR` and pass "
            f"DIR/plan.json"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PlanError(
            f"plan {path} is not valid JSON ({error.msg} at line {error.lineno}): {REMAKE}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read plan {path} ({error}): check the path and its permissions") from None
    return parse_plan(data, str(path))


def spec_from_plan(plan: Plan | dict) -> DiTSpec:
    """The DiTSpec the plan was made for: the architecture it records, or a family member by name with the
    plan's overrides (older plans). Accepts the parsed plan or its JSON object."""
    if isinstance(plan, dict):
        plan = parse_plan(plan)
    model, inputs, latents = plan.model, plan.inputs, plan.decision.latents
    if None not in (model.depth, model.hidden, model.heads, model.patch):
        return custom_spec(
            depth=model.depth,
            hidden=model.hidden,
            heads=model.heads,
            patch=model.patch,
            resolution=model.resolution,
            latents=latents,
            num_classes=model.num_classes or inputs.get("num_classes") or NUM_CLASSES,
            name=model.name,
            family=model.family,
            tokenizer=model.tokenizer,
            **model.options,
        )
    overrides = {
        key: inputs.get(key) for key in ("depth", "hidden", "heads", "num_classes") if inputs.get(key)
    }
    name = inputs.get("model") or model.name.removesuffix("-custom")
    return model_spec(name, model.resolution, latents, **overrides)
