"""The reserved model's fragmentation term (planner/allocator.py TRANSIENT_FRAGMENTATION) from the replays
benchmarks/reserved_replay.py wrote, and the planner's reserved peak held to each replay.

    python benchmarks/reserved_calibration.py benchmarks/results/reserved_replay.json

needed fraction = (replayed reserved - requested peak - rounding - pages) / transient bytes, where the
transient bytes are the requested peak less what lives for the whole run (fp32 weights and buffer, AdamW
states, EMA, VAE weights), as the planner counts them. The same for the least reserved memory the step runs
in under pressure (the cache released and the request retried; planner/allocator.py PRESSURE_FRAGMENTATION),
where replays have it; online points also give the encoder share that stays reserved
((least - requested - rounding - pages - f x transient) / min(encoder working set, transient)).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_memtrace_grid import make_plan, point_id  # noqa: E402

from dit_accel.memtrace.comparison import (  # noqa: E402
    planner_least_reserved,
    planner_phases,
    planner_reserved_peak,
)
from planner import allocator  # noqa: E402
from planner.activations import FP32_BYTES, buffer_bytes  # noqa: E402
from planner.hardware import Assumptions  # noqa: E402


def persistent_bytes(spec, ema: bool, online: bool) -> int:
    a = Assumptions()
    vae = a.vae_params * a.vae_bytes_per_param if online else 0
    return (4 if ema else 3) * FP32_BYTES * spec.params_trainable + buffer_bytes(spec) + vae


def replayed_modes(rows: list):
    """Per point and allocator mode: (point, plan, mode, its replay, transient bytes, requested peak + rounding
    + pages: what the planner adds fragmentation to)."""
    for row in rows:
        point = tuple(row["point"])
        plan = make_plan(*point)
        spec = plan.spec()
        for mode in allocator.SEGMENT_MODES:
            replay = row["full"][mode]
            requested = replay["requested_peak_bytes"]
            transient = requested - persistent_bytes(spec, point[6], point[7] == "online")
            rounding = (4 if point[6] else 3) * allocator.parameter_rounding_bytes(spec, 4, 1, mode)
            pages = allocator.LARGE_PAGE_BYTES + allocator.SMALL_PAGE_BYTES if mode == "expandable" else 0
            yield point, plan, mode, replay, transient, requested + rounding + pages


def main(path: str) -> None:
    rows = json.loads(Path(path).read_text())
    needed = {mode: [] for mode in allocator.SEGMENT_MODES}
    print(
        "| point | requested peak MiB | mode | replayed reserved MiB | needed fraction | planner MiB | error |"
    )
    print("|---|---|---|---|---|---|---|")
    for point, plan, mode, replay, transient, base in replayed_modes(rows):
        requested, reserved = replay["requested_peak_bytes"], replay["reserved_peak_bytes"]
        fraction = (reserved - base) / transient
        needed[mode].append(fraction)
        planned = planner_reserved_peak(plan, "cpu", mode)
        print(
            f"| {point_id(point)} | {requested / 2**20:,.0f} | {mode} | {reserved / 2**20:,.0f} | "
            f"{fraction:.3f} | {planned / 2**20:,.0f} | {planned / reserved - 1:+.1%} |"
        )
    pressure_rows(rows)
    for mode, values in needed.items():
        values.sort()
        print(
            f"{mode}: needed fraction min {values[0]:.3f}, median {values[len(values) // 2]:.3f}, "
            f"max {values[-1]:.3f} over {len(values)} points"
        )


def pressure_rows(rows: list) -> None:
    """The least reserved memory (release-and-retry) per point: the fraction it needs, the planner's figure."""
    print()
    print(
        "| point | mode | replayed least reserved MiB | needed fraction | encoder share | planner MiB | error |"
    )
    print("|---|---|---|---|---|---|---|")
    for point, plan, mode, replay, transient, base in replayed_modes(rows):
        least = replay.get("least_reserved_bytes")
        if least is None:  # replayed before release-and-retry was modelled
            continue
        share = "-"
        if point[7] == "online":
            phases = planner_phases(plan, "cpu", segments=mode)
            encoder = phases["vae_encode"]["vae"] - phases["optimizer_step"]["vae"]
            rest = least - base - allocator.PRESSURE_FRAGMENTATION[mode] * transient
            share = f"{rest / min(encoder, transient):.3f}"
        planned = planner_least_reserved(plan, "cpu", mode)
        print(
            f"| {point_id(point)} | {mode} | {least / 2**20:,.0f} | {(least - base) / transient:.3f} | {share} | "
            f"{planned / 2**20:,.0f} | {planned / least - 1:+.1%} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
