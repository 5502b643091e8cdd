"""The planner's estimate of the traced step, component by component, at the same moment of the step."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.components import ALLOCATED
from planner.planfile import Plan

if TYPE_CHECKING:  # annotations only: the comparison itself needs no torch
    from dit_accel.memtrace.tracker import TraceResult

# Planner components a tensor trace can check; "overhead" (CUDA context, NCCL) it cannot, and
# "allocator" (reserved beyond allocated) is checked against the trace's replay through the allocator model.
COMPARED = ALLOCATED  # the planner's tensor components
# the planner's reserved peak against the replayed one, by allocator mode: the fragmentation terms are
# calibrated on the verify grid's replays (docs/planner-accuracy.md), where expandable segments (the trainer's
# default on CUDA) are within -0.9..+1.9% precomputed and -1.5..+0.8% online; fixed ones within -1.3..+2.8%
RESERVED_TOLERANCE = {"expandable": 0.03, "fixed": 0.03}
SEGMENT_MODES = ("expandable", "fixed")
# the traceable peak and each component, as tests/test_memtrace_grid.py holds them (issue 5): a component
# under SMALL_COMPONENT of the peak is held to its tolerance of that share of the peak
PEAK_TOLERANCE = {"fp32": 0.02, "bf16": 0.05, "fp16": 0.05}
COMPONENT_TOLERANCE = 0.05
SMALL_COMPONENT = 0.01
# ... and every figure to at least this many bytes: below it a difference is the caching allocator's
# granularity (2 MiB pages, 20 MiB segments: the expandable model adds one page of each), under 0.4% of a
# 16 GB GPU and far inside the planner's headroom (5% of VRAM), so no decision of the plan can turn on it
ABSOLUTE_TOLERANCE_BYTES = 64 * 2**20


def traced_optimizer_kind(plan: Plan, device: str) -> str:
    """The AdamW implementation the trainer gets on `device` (dit_accel.train.optim.build_optimizer): the plan's
    (default fused) on CUDA; on a CPU always PyTorch's default there, the per-tensor loop ("single": its
    temporaries are a few copies of one parameter, which the planner does not model)."""
    return plan.decision.adamw or "fused" if device == "cuda" else "single"


def planner_phases(
    plan: Plan, autocast_device: str, sharding: str = "ddp", world_size: int = 1, segments: str | None = None
) -> dict:
    """The planner's components at each moment of this plan's step, for `world_size` processes of `sharding`
    on one node, with the AdamW a trace on `autocast_device` runs. `segments`: the allocator mode of the
    reserved model, with its modelled fragmentation (not a measured one the plan may carry)."""
    return planner_step_memory(plan, autocast_device, sharding, world_size, segments).phases


def planner_step_memory(
    plan: Plan, autocast_device: str, sharding: str = "ddp", world_size: int = 1, segments: str | None = None
):
    """`planner_phases`'s whole estimate (planner.memory.MemoryEstimate): its phases and what the allocator
    releases at each under pressure."""
    from planner.decision import Cluster
    from planner.hardware import Assumptions
    from planner.memory import step_memory

    decision = dataclasses.replace(
        plan.decision, sharding=sharding, adamw=traced_optimizer_kind(plan, autocast_device)
    )
    assumptions = Assumptions()
    recorded = {key: value for key, value in plan.assumptions.items() if hasattr(assumptions, key)}
    # a trace sees no cuBLAS workspace (memtrace.tracker.UNSEEN), so its replay holds none either
    assumptions = assumptions.replace(**recorded).replace(
        autocast_device=autocast_device, cublas_workspace_bytes=0
    )
    if segments is not None:
        assumptions = assumptions.replace(allocator_segments=segments, fragmentation=0.0)
    cluster = Cluster(nodes=1, gpus_per_node=world_size, vram_bytes=plan.cluster.vram_bytes or 2**50)
    return step_memory(plan.spec(), decision, cluster, assumptions)


def planner_estimate(plan: Plan, autocast_device: str) -> tuple[int, dict[str, int], str]:
    """The planner's traceable peak for this plan as a single process would trace it: (bytes, components
    at the planner's peak moment without overhead, that moment). World size 1: no DDP buckets."""
    phases = planner_phases(plan, autocast_device)
    best_phase, best = None, -1
    for phase, components in phases.items():
        traceable = sum(components[name] for name in COMPARED)
        if traceable > best:
            best_phase, best = phase, traceable
    return best, {name: phases[best_phase][name] for name in COMPARED}, best_phase


def planner_reserved_peak(plan: Plan, autocast_device: str, segments: str) -> int:
    """The planner's reserved peak (tensors + the allocator's share, no overhead) of the step as one process
    traces it, with `segments`."""
    phases = planner_phases(plan, autocast_device, segments=segments)
    return max(sum(parts[name] for name in COMPARED) + parts["allocator"] for parts in phases.values())


def planner_least_reserved(plan: Plan, autocast_device: str, segments: str) -> int:
    """The planner's least reserved memory for the step (its cache released under pressure), no overhead:
    held to the replay's `least_reserved_bytes`."""
    estimate = planner_step_memory(plan, autocast_device, segments=segments)
    return max(
        sum(parts[name] for name in COMPARED) + parts["allocator"] - estimate.reclaimable.get(moment, 0)
        for moment, parts in estimate.phases.items()
    )


def reserved_rows(result: TraceResult, plan: Plan) -> list:
    """(segments, replayed reserved peak, planner's, relative error) for both allocator modes; none when the
    trace was not replayed at the plan's depth."""
    rows = []
    for mode in SEGMENT_MODES:
        if mode in result.allocator:
            replayed = result.allocator[mode]["reserved_peak_bytes"]
            planned = planner_reserved_peak(plan, result.autocast_device, mode)
            rows.append((mode, replayed, planned, relative_error(planned, replayed)))
    return rows


@dataclass
class Comparison:
    """Traced vs planned bytes, component by component, and the peak; the replayed reserved peaks."""

    rows: list  # (name, traced_bytes, planned_bytes or None, relative error or None)
    traced_peak_bytes: int
    planned_peak_bytes: int
    planned_phase: str
    reserved: list = dataclasses.field(default_factory=list)  # `reserved_rows`

    @property
    def peak_error(self) -> float:
        return relative_error(self.planned_peak_bytes, self.traced_peak_bytes)

    def component_error(self, name: str) -> float | None:
        return next(row[3] for row in self.rows if row[0] == name)

    def outside_tolerance(self, precision: str) -> list[str]:
        """The figures the planner misses by more than their tolerance (`within_tolerance`): components by
        name, "traceable peak", "reserved peak, MODE segments"."""
        floor = SMALL_COMPONENT * self.traced_peak_bytes
        missed = [
            name
            for name, traced, planned, _ in self.rows
            if planned is not None and not within_tolerance(planned, traced, COMPONENT_TOLERANCE, floor)
        ]
        if not within_tolerance(self.planned_peak_bytes, self.traced_peak_bytes, PEAK_TOLERANCE[precision]):
            missed.append("traceable peak")
        missed += [
            f"reserved peak, {mode} segments"
            for mode, replayed, planned, _ in self.reserved
            if not within_tolerance(planned, replayed, RESERVED_TOLERANCE[mode])
        ]
        return missed

    def held_by_floor(self, precision: str) -> dict[str, str]:
        """Row name -> the note of the floor that holds a figure past its relative tolerance (`floor_note`)."""
        floor = SMALL_COMPONENT * self.traced_peak_bytes
        notes = {
            name: floor_note(planned, traced, COMPONENT_TOLERANCE, floor)
            for name, traced, planned, _ in self.rows
            if planned is not None
        }
        notes["traceable peak"] = floor_note(
            self.planned_peak_bytes, self.traced_peak_bytes, PEAK_TOLERANCE[precision]
        )
        for mode, replayed, planned, _ in self.reserved:
            notes[f"reserved peak, {mode} segments"] = floor_note(planned, replayed, RESERVED_TOLERANCE[mode])
        return {name: note for name, note in notes.items() if note}


def floor_note(planned: int, traced: int, relative: float, floor_bytes: float = 0) -> str:
    """For a figure whose error is past its relative tolerance but within tolerance all the same: which floor
    held it (a +24.5% under "held to within 3%" must say why it passes); "" otherwise."""
    error = abs(planned - traced)
    if error <= relative * traced or not within_tolerance(planned, traced, relative, floor_bytes):
        return ""
    if error <= relative * floor_bytes:
        return f" (within {relative:.0%} of {SMALL_COMPONENT:.0%} of the peak: a small component)"
    return f" (within the {ABSOLUTE_TOLERANCE_BYTES // 2**20} MiB floor)"


def within_tolerance(planned: int, traced: int, relative: float, floor_bytes: float = 0) -> bool:
    """|planned - traced| within `relative` of the traced bytes (or of `floor_bytes` when more), and never
    held tighter than ABSOLUTE_TOLERANCE_BYTES."""
    return abs(planned - traced) <= max(relative * max(traced, floor_bytes), ABSOLUTE_TOLERANCE_BYTES)


def relative_error(planned: int, traced: int) -> float:
    """(planned - traced) / traced; 0 when both are 0, infinite when only the trace is 0."""
    if traced == 0:
        return 0.0 if planned == 0 else math.inf
    return (planned - traced) / traced


def traced_as_planner_components(result: TraceResult) -> dict[str, int]:
    """The trace's components under the planner's names: the positional buffer is in the planner's weights;
    the micro-batch itself (inputs, noise, labels) the planner does not count separately."""
    traced = {name: result.components.get(name, 0) for name in COMPARED}
    traced["weights"] += result.components.get("buffers", 0)
    return traced


def compare(result: TraceResult, plan: Plan) -> Comparison:
    planned_peak, planned, phase = planner_estimate(plan, result.autocast_device)
    traced = traced_as_planner_components(result)
    rows = [
        (name, traced[name], planned[name], relative_error(planned[name], traced[name])) for name in COMPARED
    ]
    rows.append(("batch (inputs, noise, labels)", result.components.get("batch", 0), None, None))
    return Comparison(
        rows=rows,
        traced_peak_bytes=result.peak_bytes,
        planned_peak_bytes=planned_peak,
        planned_phase=phase,
        reserved=reserved_rows(result, plan),
    )


# ---------------------------------------------------------------------------------------------------
# Sharded plans: one rank, part traced, part derived
# ---------------------------------------------------------------------------------------------------


@dataclass
class ShardedComparison:
    """One rank of a sharded plan beside the planner's estimate for that rank.

    At the traced compute peak (forward/backward), every component is either traced (activations, autocast
    cache, VAE, temporaries, the emulated gradient shards), derived from the traced sizes (the fp32 master
    shard, AdamW state and EMA: 1/world_size of the traced parameters), or, for zero3's gathered parameters,
    modelled as the planner models them (one process cannot reshard). `rows` say which, in their last field.
    The optimizer step is not traced: its states are derived the same way (no temporaries).
    """

    rows: list  # (name, rank bytes, planned bytes or None, relative error or None, how it is known)
    compute_peak_bytes: int  # the rank at the traced compute peak, derived as the rows say (with the batch)
    planned_compute_bytes: int  # the planner at the traced peak's moment (traceable components)
    planned_compute_phase: str
    optimizer_step_bytes: int  # derived: master shard + buffer + grad, AdamW and EMA shards
    planned_optimizer_step_bytes: int  # the planner's, with its AdamW temporaries

    @property
    def peak_bytes(self) -> int:
        return max(self.compute_peak_bytes, self.optimizer_step_bytes)

    @property
    def planned_peak_bytes(self) -> int:
        return max(self.planned_compute_bytes, self.planned_optimizer_step_bytes)

    component_error = Comparison.component_error  # rows share Comparison's first four fields


def compare_sharded(result: TraceResult, plan: Plan) -> ShardedComparison:
    """Complete the traced compute of one rank (`make_sharded`) with what one process cannot trace, and put it
    beside the planner's sharded estimate for the same moment, component by component."""
    spec = plan.spec()
    world_size, traced = result.world_size, result.components
    compute_bytes = 4 if result.precision == "fp32" else 2
    dtype = {2: result.precision, 4: "fp32"}[compute_bytes]
    gathered = traced[
        "weights"
    ]  # every parameter, converted to the compute dtype: all units gathered at once
    params = gathered // compute_bytes
    master = 4 * params // world_size
    if result.sharding == "zero3":
        held_blocks = min(
            2, spec.depth
        )  # the unit in use and the prefetched next, plus the root (planner's rule)
        gathered = compute_bytes * (params - (spec.depth - held_blocks) * spec.block_params)
        gathered_how = (
            f"modelled {dtype} gathered parameters: root unit + {held_blocks} block units (planner's rule)"
        )
    else:
        gathered_how = f"traced {dtype} gathered parameters: every unit, forward to end of backward"
    ema = 4 * params // world_size if plan.decision.ema else 0
    derived = f"derived: 1/{world_size} of the traced {params:,} parameters"
    rank = {
        "weights": (
            master + traced["buffers"] + gathered,
            f"{derived} x 4 B (fp32 master shard) + traced fp32 buffer + {gathered_how}",
        ),
        "grads": (
            traced["grads"],
            f"traced: fp32 1/{world_size} shards as each reduce-scatter leaves them (emulated)",
        ),
        "optimizer": (2 * 4 * params // world_size, f"{derived} x 8 B (AdamW exp_avg, exp_avg_sq)"),
        "ema": (ema, f"{derived} x 4 B (fp32 EMA)" if ema else "no EMA"),
        "activations": (traced["activations"], f"traced: pure {dtype}, no autocast"),
        "autocast_cache": (traced["autocast_cache"], "traced: no autocast, so no cache"),
        "vae": (traced["vae"], "traced"),
        "repa": (traced["repa"], "traced: the frozen encoder whole, the projector as one rank holds it"),
        "temporaries": (traced["temporaries"], "traced: unsharded grads freed per parameter, not per unit"),
    }
    phases = planner_phases(plan, result.autocast_device, result.sharding, world_size)
    compute_phases = {phase: parts for phase, parts in phases.items() if phase != "optimizer_step"}
    # the planner at the moment the trace peaked, else at its own largest forward/backward moment
    planned_phase = (
        result.peak_moment
        if result.peak_moment in compute_phases
        else max(compute_phases, key=lambda phase: sum(compute_phases[phase][name] for name in COMPARED))
    )
    planned = compute_phases[planned_phase]
    rows = [
        (name, rank[name][0], planned[name], relative_error(planned[name], rank[name][0]), rank[name][1])
        for name in COMPARED
    ]
    rows.append(("batch (inputs, noise, labels)", traced.get("batch", 0), None, None, "traced"))
    optimizer_step = (
        master + traced["buffers"] + 4 * params // world_size + 2 * 4 * params // world_size + ema
    )
    return ShardedComparison(
        rows=rows,
        compute_peak_bytes=sum(row[1] for row in rows),
        planned_compute_bytes=sum(planned[name] for name in COMPARED),
        planned_compute_phase=planned_phase,
        optimizer_step_bytes=optimizer_step,
        planned_optimizer_step_bytes=sum(phases["optimizer_step"][name] for name in COMPARED),
    )
