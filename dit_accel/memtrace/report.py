"""`dit-accel verify`: the traced step beside the planner's estimate, as a table and as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from dit_accel.cli_args import OneLineParser, positive_int
from dit_accel.errors import UserError, exits_cleanly
from dit_accel.memtrace.comparison import (
    ABSOLUTE_TOLERANCE_BYTES,
    COMPONENT_TOLERANCE,
    PEAK_TOLERANCE,
    RESERVED_TOLERANCE,
    SMALL_COMPONENT,
    Comparison,
    ShardedComparison,
    compare,
    compare_sharded,
    relative_error,
)
from planner.planfile import Plan, read_plan

EXIT_OUTSIDE_TOLERANCE = 1  # as diff and cmp exit: compared, and it differs (2 stays bad input)

if TYPE_CHECKING:  # annotations only: `dit-accel verify --help` imports no torch
    from dit_accel.memtrace.tracker import TraceResult


def _gib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**30:.3f} GiB"


def _percent(error: float | None) -> str:
    if error is None:
        return "-"
    return "n/a (trace 0)" if math.isinf(error) else f"{error:+.1%}"


def _depths_text(result: TraceResult) -> str:
    return (
        "full depth"
        if result.traced_depths == [result.depth]
        else f"traced at depths {', '.join(map(str, result.traced_depths))}, extrapolated per block"
    )


def comparison_plan_notes(plan: Plan | None) -> list[str]:
    """What the plan says beyond what one traced process can show."""
    if plan is None or plan.memory is None or not plan.memory.peak_bytes:
        return []
    # (a sharded plan has its own report: format_sharded_report)
    return [
        f"the plan's own peak (its GPU's autocast, the allocator's reserve, overhead, DDP buckets): "
        f"{_gib(plan.memory.peak_bytes)} of a {_gib(plan.memory.budget_bytes)} budget"
    ]


def format_report(
    result: TraceResult, comparison: Comparison, plan_path: str = "plan.json", plan_notes: Plan | None = None
) -> str:
    """The traced step beside the planner's estimate, and what the trace cannot see."""
    from tabulate import tabulate

    missed = set(comparison.outside_tolerance(result.precision))
    rows = [
        (name, _gib(traced), _gib(planned), _percent(error))
        for name, traced, planned, error in comparison.rows
    ]
    rows.append(
        (
            "traceable peak",
            _gib(result.peak_bytes),
            _gib(comparison.planned_peak_bytes),
            _percent(comparison.peak_error),
        )
    )
    for mode, replayed, planned, error in comparison.reserved:
        rows.append((f"reserved peak, {mode} segments", _gib(replayed), _gib(planned), _percent(error)))
    held = comparison.held_by_floor(result.precision)
    rows = [
        (*row[:3], row[3] + (" (outside tolerance)" if row[0] in missed else held.get(row[0], "")))
        for row in rows
    ]
    depths = _depths_text(result)
    lines = [
        f"traced training step of {plan_path}: micro-batch {result.micro_batch}, {result.precision} "
        f"({result.autocast_device} autocast), {result.checkpointed_blocks}/{result.depth} blocks checkpointed "
        f"({depths}; {result.seconds:.1f} s, nothing allocated)",
        f"traced peak: {_gib(result.peak_bytes)} during {result.peak_at}; "
        f"planner's peak moment: {comparison.planned_phase.replace('_', ' ')}; planner figures are for one process "
        f"as traced (the plan's own adds DDP buckets when world_size > 1)",
    ]
    lines += comparison_plan_notes(plan_notes) + [
        "",
        tabulate(
            rows,
            headers=["component (live at the peak)", "traced", "planner", "planner error"],
            tablefmt="simple",
            disable_numparse=True,
        ),
        "",
    ]
    if comparison.reserved:
        lines.append(
            "reserved: the traced allocations and frees replayed through a model of PyTorch's caching allocator "
            "(the traced column; dit_accel/memtrace/allocator.py), held to within "
            f"{RESERVED_TOLERANCE['expandable']:.0%} (expandable segments, the trainer's default on CUDA) and "
            f"{RESERVED_TOLERANCE['fixed']:.0%} (fixed segments)"
        )
    else:
        lines.append(f"reserved: not replayed ({result.allocator_depths})")
    lines.append(
        f"tolerances: the traceable peak {PEAK_TOLERANCE[result.precision]:.0%} ({result.precision}), each "
        f"component {COMPONENT_TOLERANCE:.0%} (of {SMALL_COMPONENT:.0%} of the peak for smaller ones), and "
        f"never tighter than {ABSOLUTE_TOLERANCE_BYTES // 2**20} MiB (the allocator's granularity); "
        + (
            f"outside: {'; '.join(sorted(missed))} (exit {EXIT_OUTSIDE_TOLERANCE})"
            if missed
            else "every figure is within"
        )
    )
    lines += ["", "not seen by a tensor trace (the planner adds these as overhead, not checked here):"]
    lines += [f"  - {item}" for item in result.unseen if not item.startswith("the caching allocator")]
    return "\n".join(lines)


def format_sharded_report(
    result: TraceResult,
    comparison: ShardedComparison,
    plan_path: str = "plan.json",
    plan_notes: Plan | None = None,
) -> str:
    """One rank of a sharded plan beside the planner, each figure labelled traced, derived or modelled."""
    from tabulate import tabulate

    rows = [
        (name, _gib(rank), _gib(planned), _percent(error), how)
        for name, rank, planned, error, how in comparison.rows
    ]
    rows.append(
        (
            "rank at the compute peak",
            _gib(comparison.compute_peak_bytes),
            _gib(comparison.planned_compute_bytes),
            _percent(relative_error(comparison.planned_compute_bytes, comparison.compute_peak_bytes)),
            "",
        )
    )
    rows.append(
        (
            "optimizer step",
            _gib(comparison.optimizer_step_bytes),
            _gib(comparison.planned_optimizer_step_bytes),
            _percent(
                relative_error(comparison.planned_optimizer_step_bytes, comparison.optimizer_step_bytes)
            ),
            "derived states, not traced (the planner adds AdamW's temporaries)",
        )
    )
    rows.append(
        (
            "peak of the rank",
            _gib(comparison.peak_bytes),
            _gib(comparison.planned_peak_bytes),
            _percent(relative_error(comparison.planned_peak_bytes, comparison.peak_bytes)),
            "",
        )
    )
    depths = _depths_text(result)
    lines = [
        f"traced compute of one rank of {plan_path} ({result.sharding}, FSDP2, world size {result.world_size}): "
        f"micro-batch {result.micro_batch}, pure {result.precision} (parameters in the compute dtype, no autocast), "
        f"{result.checkpointed_blocks}/{result.depth} blocks checkpointed ({depths}; {result.seconds:.1f} s, "
        f"nothing allocated)",
        f"traced compute peak during {result.peak_at}; planner's moment compared: "
        f"{comparison.planned_compute_phase.replace('_', ' ')}",
        "traced: what the step's tensors hold; derived: 1/world_size of the traced sizes; modelled: the planner's "
        "rule, which one process cannot run",
    ]
    if plan_notes is not None and plan_notes.memory is not None and plan_notes.memory.peak_bytes:
        memory = plan_notes.memory
        lines.append(
            f"the plan's own peak (its GPU, overhead, NCCL, fragmentation): {_gib(memory.peak_bytes)} "
            f"of a {_gib(memory.budget_bytes)} budget"
        )
    lines += [
        "",
        tabulate(
            rows,
            headers=["component (one rank)", "rank", "planner", "planner error", "how it is known"],
            tablefmt="simple",
            disable_numparse=True,
        ),
        "",
        "not seen by a tensor trace (the planner adds these as overhead, not checked here):",
    ]
    unseen = [item for item in result.unseen if not item.startswith("CPU-vs-CUDA")]  # no autocast to differ
    unseen.append(
        "FSDP2's all-gather and reduce-scatter buffers, and the unsharded gradients of a whole unit "
        "before its reduce-scatter"
    )
    lines += [f"  - {item}" for item in unseen]
    return "\n".join(lines)


def _vae_config(folder: str) -> dict:
    """The config.json of an AutoencoderKL folder (or of a pipeline folder's vae/)."""

    for candidate in (Path(folder) / "config.json", Path(folder) / "vae" / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise UserError(
        f"--vae {folder} has no config.json (nor vae/config.json): pass a folder written by "
        f"AutoencoderKL.save_pretrained, or leave --vae out to trace the SD VAE"
    )


@exits_cleanly("dit-accel verify")
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="dit-accel verify",
        description="Trace one real training step of the plan on fake tensors (nothing is allocated) and compare "
        "its peak memory, component by component, with the planner's estimate.",
        epilog=f"Exit codes: 0 every figure within its tolerance (printed under the table; a sharded plan's "
        f"report has none), {EXIT_OUTSIDE_TOLERANCE} a figure outside it, 2 bad input.",
    )
    parser.add_argument("plan", help="plan.json written by dit-plan")
    parser.add_argument(
        "--depth-extrapolate",
        choices=("auto", "off"),
        default="auto",
        help="auto: trace at most 5 blocks and extrapolate per block (exact); off: trace every block",
    )
    parser.add_argument(
        "--device-autocast",
        choices=("cpu", "cuda"),
        default=None,
        help="whose autocast casts the ops: cuda needs a CUDA build of torch; without a GPU it traces the "
        "forward and optimizer step, and the backward under cpu (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--micro-batch",
        type=positive_int,
        default=None,
        help="trace this micro-batch instead of the plan's (default: none: the plan's own)",
    )
    parser.add_argument(
        "--vae",
        default=None,
        help="online latents: a diffusers AutoencoderKL folder whose "
        "config.json to trace (weights are not read); default: the SD VAE's architecture",
    )
    parser.add_argument(
        "--json",
        dest="json_out",
        default=None,
        help="also write the trace and comparison here (default: none: the terminal only)",
    )
    args = parser.parse_args(argv)
    from dit_accel.memtrace.driver import trace_training_step

    plan = read_plan(args.plan)
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise UserError(f"--micro-batch must be positive, got {args.micro_batch}")
        plan = plan.with_decision(micro_batch=args.micro_batch)
    result = trace_training_step(
        plan,
        depth_extrapolate=args.depth_extrapolate,
        autocast_device=args.device_autocast,
        vae_config=_vae_config(args.vae) if args.vae else None,
        replay_at_depth=not plan.sharding.uses_fsdp,  # the allocator replay needs the plan's depth (DDP)
    )
    if result.sharding != "ddp":
        sharded = compare_sharded(result, plan)
        print(format_sharded_report(result, sharded, args.plan, plan))
        if args.json_out:
            from dit_accel.atomic import write_json_atomically

            write_json_atomically(
                Path(args.json_out),
                {
                    "trace": result.to_json(),
                    "rank": {row[0]: {"bytes": row[1], "how": row[4]} for row in sharded.rows},
                    "planner": {
                        "phase": sharded.planned_compute_phase,
                        "components": {row[0]: row[2] for row in sharded.rows if row[2] is not None},
                        "optimizer_step_bytes": sharded.planned_optimizer_step_bytes,
                        "peak_bytes": sharded.planned_peak_bytes,
                    },
                    "peak_bytes": sharded.peak_bytes,
                    "peak_error": relative_error(sharded.planned_peak_bytes, sharded.peak_bytes),
                },
            )
        return 0
    comparison = compare(result, plan)
    print(format_report(result, comparison, args.plan, plan))
    if args.json_out:
        from dit_accel.atomic import write_json_atomically

        write_json_atomically(
            Path(args.json_out),
            {
                "trace": result.to_json(),
                "planner": {
                    "peak_bytes": comparison.planned_peak_bytes,
                    "phase": comparison.planned_phase,
                    "components": {row[0]: row[2] for row in comparison.rows if row[2] is not None},
                },
                "peak_error": comparison.peak_error,
                "reserved": {
                    mode: {"replayed_peak_bytes": replayed, "planner_peak_bytes": planned, "error": error}
                    for mode, replayed, planned, error in comparison.reserved
                },
                "outside_tolerance": comparison.outside_tolerance(result.precision),
            },
        )
    return EXIT_OUTSIDE_TOLERANCE if comparison.outside_tolerance(result.precision) else 0
