"""Fixed segments: what the first backward maps for gradients. The verify grid's precomputed points traced
(CPU autocast, fake tensors, seconds each) and replayed through the caching-allocator model, reading the
reserved bytes the first step's forward and its backward map, beside the planner's gradient segments
(planner/allocator.py `new_gradient_segment_bytes`) and its reserved peak. docs/planner-accuracy.md
("Calibration against the replayed verify grid") records the figures.

    python benchmarks/gradient_segments.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_memtrace_grid import GRID, make_plan, point_id  # noqa: E402

from dit_accel.memtrace import trace_events  # noqa: E402
from dit_accel.memtrace.allocator import CachingAllocator, replay_steps  # noqa: E402
from dit_accel.memtrace.comparison import planner_reserved_peak  # noqa: E402
from planner.decision import Cluster
from planner.hardware import Assumptions  # noqa: E402
from planner.memory import gradient_segment_bytes, largest_transient_bytes  # noqa: E402

MiB = 2**20


def first_step_mapped(tracker) -> tuple[int, int, int]:
    """Fixed segments: the reserved bytes mapped in the first step's forward and backward, and the peak."""
    allocator = CachingAllocator(expandable_segments=False)
    mapped = {"fwd": 0, "bwd": 0}
    before = 0
    for _, window in zip(replay_steps(allocator, tracker.events), tracker.event_windows):
        if window[0] in mapped and window[1] == 0 and (len(window) < 3 or window[2] == 0):
            mapped[window[0]] += allocator.reserved - before
        before = allocator.reserved
    return mapped["fwd"], mapped["bwd"], allocator.reserved_peak


def main() -> None:
    print(
        "| point | largest transient MiB | forward maps MiB | first backward maps MiB | planner gradient "
        "segments MiB | replayed reserved MiB | planner MiB | error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for point in (p for p in GRID if p[7] == "precomputed"):
        plan = make_plan(*point)
        forward, backward, peak = first_step_mapped(trace_events(plan))
        spec, decision, fixed = plan.spec(), plan.decision, Assumptions(allocator_segments="fixed")
        largest = largest_transient_bytes(spec, decision, fixed)
        gradients = gradient_segment_bytes(spec, decision, Cluster(1, 1, 80 * 10**9), fixed)
        planned = planner_reserved_peak(plan, "cpu", "fixed")
        print(
            f"| {point_id(point)} | {largest / MiB:,.1f} | {forward / MiB:,.0f} | {backward / MiB:,.0f} | "
            f"{gradients / MiB:,.0f} | {peak / MiB:,.0f} | {planned / MiB:,.0f} | "
            f"{planned / peak - 1:+.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
