"""The planner held to a trace of the trainer's real step, over a grid of 26 DiT configurations and 9 LightningDiT ones.

Each point traces the trainer's own step (`dit_accel.train.step`) on fake tensors (CPU autocast, shallow depths extrapolated
per block, which test_memtrace.py shows is exact) and asks the planner's CPU-autocast variant for the same
step as one process would run it. Tolerances (issue 5): the traceable peak within 2% in fp32 and 5% in
bf16/fp16; every component within 5% of its traced bytes. A component smaller than 1% of the peak is held
to 5% of 1% of the peak instead: it cannot move the peak by more than 0.05%, and a relative error of a few
megabytes is noise, not a model error. Points the planner misses are strict xfails naming the fix, so a
planner fix turns them into failures until the mark is removed.
"""

from __future__ import annotations

import pytest

from dit_accel.memtrace import compare, trace_training_step
from planner.planfile import Plan, parse_plan

pytestmark = pytest.mark.slow  # 26 whole-model traces: the heaviest in-process tests

PEAK_TOLERANCE = {"fp32": 0.02, "bf16": 0.05, "fp16": 0.05}
COMPONENT_TOLERANCE = 0.05
SMALL_COMPONENT = 0.01  # of the traced peak


def make_plan(
    model: str,
    resolution: int,
    precision: str,
    checkpointed_blocks: int,
    micro_batch: int,
    grad_accum: int = 1,
    ema: bool = True,
    latents: str = "precomputed",
) -> Plan:
    return parse_plan(
        {
            "schema": "dit-plan/1",
            "inputs": {"model": model},
            "model": {"name": model, "resolution": resolution},
            "cluster": {"world_size": 1, "nodes": 1, "gpus_per_node": 1},
            "global_batch": micro_batch * grad_accum,
            "objective": "flow" if model.startswith("LightningDiT") else "ddpm",
            "decision": {
                "micro_batch": micro_batch,
                "grad_accum": grad_accum,
                "checkpointed_blocks": checkpointed_blocks,
                "precision": precision,
                "sharding": "ddp",
                "latents": latents,
                "ema": ema,
            },
        }
    )


# (model, resolution, precision, checkpointed blocks, micro-batch, grad_accum, ema, latents)
GRID = [
    ("DiT-S/2", 256, "fp32", 0, 32, 1, True, "precomputed"),
    ("DiT-S/2", 256, "bf16", 0, 32, 1, True, "precomputed"),
    ("DiT-S/2", 256, "fp16", 6, 32, 2, True, "precomputed"),
    ("DiT-S/4", 256, "bf16", 12, 64, 1, False, "precomputed"),
    ("DiT-S/8", 512, "fp32", 0, 16, 1, True, "precomputed"),
    ("DiT-B/2", 256, "bf16", 4, 16, 1, True, "precomputed"),
    ("DiT-B/2", 256, "fp32", 12, 16, 4, True, "precomputed"),
    ("DiT-B/4", 512, "bf16", 0, 8, 2, True, "precomputed"),
    ("DiT-B/8", 256, "fp16", 0, 64, 1, False, "precomputed"),
    ("DiT-L/2", 256, "bf16", 0, 8, 1, True, "precomputed"),
    ("DiT-L/2", 512, "bf16", 24, 4, 1, True, "precomputed"),
    ("DiT-L/4", 256, "fp32", 10, 16, 2, True, "precomputed"),
    ("DiT-L/8", 512, "fp16", 0, 16, 1, True, "precomputed"),
    ("DiT-XL/2", 256, "fp32", 0, 32, 1, True, "precomputed"),
    ("DiT-XL/2", 256, "bf16", 0, 32, 1, True, "precomputed"),
    ("DiT-XL/2", 256, "bf16", 14, 32, 2, True, "precomputed"),
    ("DiT-XL/2", 256, "bf16", 28, 64, 1, True, "precomputed"),
    ("DiT-XL/2", 256, "fp16", 7, 32, 1, False, "precomputed"),
    ("DiT-XL/2", 512, "bf16", 28, 8, 2, True, "precomputed"),
    ("DiT-XL/4", 512, "fp32", 0, 8, 1, True, "precomputed"),
    ("DiT-XL/8", 256, "bf16", 0, 128, 1, True, "precomputed"),
    ("DiT-XL/2", 512, "fp16", 0, 4, 1, True, "precomputed"),
    ("DiT-S/2", 256, "bf16", 0, 8, 1, True, "online"),
    ("DiT-B/4", 256, "fp32", 6, 8, 2, True, "online"),
    ("DiT-XL/2", 256, "bf16", 28, 16, 1, True, "online"),
    ("DiT-L/2", 512, "bf16", 12, 4, 1, False, "online"),
]

# LightningDiT (models.lightningdit, planner.activations' LightningDiT terms): its own sizes and patches, the three
# checkpointing kinds, fp32, bf16 and fp16, accumulation, no EMA, online VA-VAE latents.
LIGHTNINGDIT_GRID = [
    ("LightningDiT-B/1", 256, "fp32", 0, 16, 1, True, "precomputed"),
    ("LightningDiT-B/1", 256, "bf16", 0, 16, 1, True, "precomputed"),
    ("LightningDiT-B/2", 256, "bf16", 6, 32, 2, True, "precomputed"),
    ("LightningDiT-L/1", 256, "fp32", 24, 16, 1, True, "precomputed"),
    ("LightningDiT-XL/1", 256, "bf16", 0, 32, 1, True, "precomputed"),
    ("LightningDiT-XL/1", 256, "bf16", 28, 64, 1, True, "precomputed"),
    ("LightningDiT-XL/1", 256, "fp16", 14, 32, 1, False, "precomputed"),
    ("LightningDiT-XL/2", 512, "bf16", 14, 8, 2, True, "precomputed"),
    ("LightningDiT-B/1", 256, "bf16", 6, 8, 1, True, "online"),
]


# The planner's misses from the last run against planner/memory.py (regenerate with
# `python tests/test_memtrace_grid.py --misses`): none since F1-F7 of docs/planner-accuracy.md went in.
KNOWN_MISSES: dict[int, str] = {}


def point_id(point) -> str:
    model, resolution, precision, checkpointed, micro_batch, grad_accum, ema, latents = point
    name = model.removeprefix("DiT-").replace("LightningDiT-", "LDiT-").replace("/", "_")
    return (
        f"{name}-{resolution}-{precision}-ckpt{checkpointed}-mb{micro_batch}"
        f"-acc{grad_accum}{'' if ema else '-noema'}{'-online' if latents == 'online' else ''}"
    )


def misses(point) -> list[str]:
    """Every tolerance the planner misses at this point, as readable sentences."""
    plan = make_plan(*point)
    result = trace_training_step(plan, autocast_device="cpu")
    comparison = compare(result, plan)
    problems = []
    precision = point[2]
    if abs(comparison.peak_error) > PEAK_TOLERANCE[precision]:
        problems.append(
            f"peak off by {comparison.peak_error:+.1%} (traced {result.peak_bytes:,} B during "
            f"{result.peak_at}, planner {comparison.planned_peak_bytes:,} B at {comparison.planned_phase})"
        )
    floor = SMALL_COMPONENT * result.peak_bytes
    for name, traced, planned, _ in comparison.rows:
        if planned is None:
            continue
        if abs(planned - traced) > COMPONENT_TOLERANCE * max(traced, floor):
            problems.append(f"{name} traced {traced:,} B, planner {planned:,} B")
    return problems


def _params():
    for index, point in enumerate(GRID):
        marks = []
        if index in KNOWN_MISSES:
            marks.append(pytest.mark.xfail(strict=True, reason=f"planner: {KNOWN_MISSES[index]}"))
        yield pytest.param(point, id=point_id(point), marks=marks)


def test_grid_covers_the_issue():
    assert len(GRID) >= 24
    assert {p[0].split("/")[0] for p in GRID} == {"DiT-S", "DiT-B", "DiT-L", "DiT-XL"}
    assert {p[0].split("/")[1] for p in GRID} == {"2", "4", "8"}
    assert {p[1] for p in GRID} == {256, 512} and {p[2] for p in GRID} == {"fp32", "bf16", "fp16"}
    depth = {"DiT-S": 12, "DiT-B": 12, "DiT-L": 24, "DiT-XL": 28}
    kinds = {"none" if p[3] == 0 else "all" if p[3] == depth[p[0].split("/")[0]] else "some" for p in GRID}
    assert kinds == {"none", "some", "all"}
    assert {p[5] > 1 for p in GRID} == {True, False} and {p[6] for p in GRID} == {True, False}
    assert {p[7] for p in GRID} == {"precomputed", "online"}


@pytest.mark.parametrize("point", list(_params()))
def test_planner_matches_the_trace(point):
    problems = misses(point)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("point", LIGHTNINGDIT_GRID, ids=[point_id(point) for point in LIGHTNINGDIT_GRID])
def test_planner_matches_the_lightningdit_trace(point):
    problems = misses(point)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("segments", ["expandable", "fixed"])
def test_online_steps_reuse_the_first_encodes_cache_as_the_planner_says(segments):
    """The grid's DiT-S/2 online point traced at full depth and replayed through the allocator model. AdamW's
    state exists before the first step (dit_accel.train.optim.create_states), so nothing after the first step's
    encode maps memory the first step did not (before it did: the states pinned the encoder's freed maps
    and the second encode mapped up to its whole footprint anew, +8.6% expandable). The planner's rule
    (planner/allocator.py `online_reserved_bytes`) is within 3% (+0.8% expandable, -1.3% fixed when written)."""
    from dit_accel.memtrace import trace_events
    from dit_accel.memtrace.allocator import CachingAllocator, replay_steps
    from dit_accel.memtrace.comparison import planner_reserved_peak

    point = GRID[22]
    assert point[7] == "online" and point[0] == "DiT-S/2"
    plan = make_plan(*point)
    tracker = trace_events(plan)
    assert tracker.window_peaks[("pre", 0, 0)][1]["optimizer"] > 0  # the state is there at the first encode
    allocator = CachingAllocator(segments == "expandable")
    reserved_by_window: dict = {}
    for _, window in zip(replay_steps(allocator, tracker.events), tracker.event_windows):
        reserved_by_window[window] = allocator.reserved
    assert reserved_by_window[("opt", 0)] == allocator.reserved == allocator.reserved_peak
    planned = planner_reserved_peak(plan, "cpu", segments)
    assert abs(planned / allocator.reserved_peak - 1) <= 0.03, (
        planned / 2**20,
        allocator.reserved_peak / 2**20,
    )


def test_a_lazily_made_adamw_state_makes_the_second_encode_map_anew_as_the_planner_says():
    """The same point traced as a codebase whose AdamW makes its state in the first optimizer step runs
    (--assume adamw_state=lazy): the state takes the encoder's freed cache, so reserved grows after the first
    step, nearly all of it while the second step encodes; the planner's lazy rule is within 5% (-4.8%
    expandable when written)."""
    import dataclasses

    from dit_accel.memtrace import trace_events
    from dit_accel.memtrace.allocator import CachingAllocator, replay_steps
    from dit_accel.memtrace.comparison import planner_reserved_peak

    plan = dataclasses.replace(make_plan(*GRID[22]), assumptions={"adamw_state": "lazy"})
    tracker = trace_events(plan)
    assert tracker.window_peaks[("pre", 0, 0)][1]["optimizer"] == 0  # no state yet at the first encode
    allocator = CachingAllocator(True)
    reserved_by_window: dict = {}
    for _, window in zip(replay_steps(allocator, tracker.events), tracker.event_windows):
        reserved_by_window[window] = allocator.reserved
    peak, after_first_step = allocator.reserved_peak, reserved_by_window[("opt", 0)]
    assert after_first_step < 0.95 * peak
    assert reserved_by_window[("pre", 1, 0)] - after_first_step >= 0.95 * (peak - after_first_step)
    planned = planner_reserved_peak(plan, "cpu", "expandable")
    assert abs(planned / peak - 1) <= 0.05, (planned / 2**20, peak / 2**20)


def test_a_later_micro_steps_encode_maps_what_the_gradients_spoiled_as_the_planner_says():
    """The grid's DiT-S/2 online point with two micro-steps, traced at full depth and replayed with fixed
    segments: the first micro-step's backward makes the 125 MiB of gradients out of the encoder's cached
    segments, and the second micro-step's encode maps one 256 MiB map's segment anew, the figure of
    planner/allocator.py `accumulating_encode_bytes`. A release cannot return it (the gradients live there):
    the least the step runs in is its reserved peak. The planner is within 3% of both (-1.2% when written;
    it was -5.9% and -14.3% before the rule)."""
    from dit_accel.memtrace import trace_events
    from dit_accel.memtrace.allocator import CachingAllocator, least_reserved, replay_steps
    from dit_accel.memtrace.comparison import planner_least_reserved, planner_reserved_peak
    from planner import vae
    from planner.allocator import accumulating_encode_bytes
    from planner.hardware import Assumptions
    from planner.spec import model_spec

    model, resolution, precision, checkpointed, micro_batch, _, ema, latents = GRID[22]
    plan = make_plan(model, resolution, precision, checkpointed, micro_batch, 2, ema, latents)
    tracker = trace_events(plan)
    allocator = CachingAllocator(False)
    opened: dict = {}
    for _, window in zip(replay_steps(allocator, tracker.events), tracker.event_windows):
        opened.setdefault(window[:3], allocator.reserved)
    mib = 2**20
    gradients = 4 * model_spec(model, resolution).params_trainable
    largest_map = vae.encoder_activation_bytes(resolution, micro_batch, 1)
    working = int(Assumptions().vae_activation_maps * largest_map)
    spoiled = accumulating_encode_bytes(gradients, largest_map, working, "fixed")
    assert allocator.reserved_peak - opened[("pre", 1, 1)] == spoiled == 256 * mib
    least = least_reserved(tracker.events)
    assert least == allocator.reserved_peak
    for planned, replayed in (
        (planner_reserved_peak(plan, "cpu", "fixed"), allocator.reserved_peak),
        (planner_least_reserved(plan, "cpu", "fixed"), least),
    ):
        assert abs(planned / replayed - 1) <= 0.03, (planned / mib, replayed / mib)


def markdown_table() -> str:
    """The grid as docs/planner-accuracy.md shows it: `python tests/test_memtrace_grid.py`."""
    mib = 2**20
    lines = [
        "| # | configuration | traced peak MiB | planner MiB | error | traced peak moment | planner moment | "
        "components off by more than 5% (traced -> planner MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, point in enumerate(GRID):
        plan = make_plan(*point)
        result = trace_training_step(plan, autocast_device="cpu")
        comparison = compare(result, plan)
        floor = SMALL_COMPONENT * result.peak_bytes
        off = [
            f"{name} {traced / mib:.1f} -> {planned / mib:.1f}"
            for name, traced, planned, _ in comparison.rows
            if planned is not None and abs(planned - traced) > COMPONENT_TOLERANCE * max(traced, floor)
        ]
        peak_ok = abs(comparison.peak_error) <= PEAK_TOLERANCE[point[2]]
        lines.append(
            f"| {index} | {point_id(point)} | {result.peak_bytes / mib:,.1f} | "
            f"{comparison.planned_peak_bytes / mib:,.1f} | {comparison.peak_error:+.2%}{'' if peak_ok else ' **miss**'} | "
            f"{result.peak_at} | {comparison.planned_phase} | {'; '.join(off) or 'none'} |"
        )
    return "\n".join(lines)


# Which correction a miss needs, by where the traced peak is (docs/planner-accuracy.md).
def miss_reasons() -> str:
    """KNOWN_MISSES as Python source, from a fresh run against the current planner."""
    lines = ["KNOWN_MISSES: dict[int, str] = {"]
    for index, point in enumerate(GRID):
        plan = make_plan(*point)
        result = trace_training_step(plan, autocast_device="cpu")
        comparison = compare(result, plan)
        floor = SMALL_COMPONENT * result.peak_bytes
        parts = []
        if abs(comparison.peak_error) > PEAK_TOLERANCE[point[2]]:
            parts.append(f"peak {comparison.peak_error:+.1%}")
        for name, traced, planned, error in comparison.rows:
            if planned is not None and abs(planned - traced) > COMPONENT_TOLERANCE * max(traced, floor):
                parts.append(f"{name} {f'{error:+.0%}' if traced else f'+{planned / 2**20:.0f} MiB'}")
        if parts:
            reason = (
                f"{', '.join(parts)} at the traced peak ({result.peak_at.split(' (')[0]}); "
                f"the planner's peak is at {comparison.planned_phase}: see docs/planner-accuracy.md"
            )
            lines.append(f"    {index}: {reason!r},")
    return "\n".join(lines + ["}"])


if __name__ == "__main__":
    import sys

    print(miss_reasons() if "--misses" in sys.argv else markdown_table())
