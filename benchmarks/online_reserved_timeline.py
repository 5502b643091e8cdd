"""Where the reserved peak of an online-latents step forms: the verify grid's online points traced (CPU
autocast, fake tensors, a few seconds each) and replayed through the caching-allocator model, reading the
reserved and requested bytes at the windows that matter: the VAE encode of the first step (on an empty
cache), the first optimizer step, the encode of the second step, and the end, beside the planner's reserved
peak. Each point twice: AdamW's state made before the first step as dit-accel's trainer makes it ("eager"),
and made inside the first optimizer step as torch's AdamW does by default ("lazy": other codebases,
`--assume adamw_state=lazy`). Beyond the grid, three online points whose DiT transient is large (no
checkpointing) test the planner's rules where the cache is ample. docs/planner-accuracy.md ("Online
latents: where the reserved peak forms") records the figures.

    python benchmarks/online_reserved_timeline.py
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_memtrace_grid import GRID, make_plan, point_id  # noqa: E402

from dit_accel.memtrace import trace_events  # noqa: E402
from dit_accel.memtrace.allocator import CachingAllocator, replay_steps  # noqa: E402
from dit_accel.memtrace.comparison import planner_reserved_peak  # noqa: E402

MiB = 2**20
STATES = ("eager", "lazy")
BEYOND_GRID = [
    ("DiT-S/2", 256, "fp32", 0, 32, 1, True, "online"),
    ("DiT-B/2", 256, "bf16", 0, 16, 1, True, "online"),
    ("DiT-XL/2", 256, "fp32", 0, 8, 1, True, "online"),
]


def window_marks(tracker, expandable: bool) -> tuple[dict, dict, int]:
    """Replay the trace: (reserved, requested) as each window opens, each window's requested peak, and the
    reserved peak."""
    allocator = CachingAllocator(expandable)
    marks, requested_peaks, before = {}, {}, (0, 0)
    for _, window in zip(replay_steps(allocator, tracker.events), tracker.event_windows):
        marks.setdefault(window, before)  # as the window opens: the state before its first event
        before = (allocator.reserved, allocator.requested)
        requested_peaks[window] = max(requested_peaks.get(window, 0), allocator.requested)
    return marks, requested_peaks, allocator.reserved_peak


def main() -> None:
    print(
        "| point | AdamW state | mode | encoder working set W | step-1 encode: new reserved | first optimizer step: "
        "reserved, allocated after | step-2 encode: new reserved | reserved peak | planner | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for point, state in itertools.product([p for p in GRID if p[7] == "online"] + BEYOND_GRID, STATES):
        plan = dataclasses.replace(make_plan(*point), assumptions={"adamw_state": state})
        tracker = trace_events(plan)
        for mode in ("expandable", "fixed"):
            marks, peaks, reserved_peak = window_marks(tracker, mode == "expandable")
            start0, after0 = marks[("pre", 0, 0)], marks[("fwd", 0, 0, 0)]
            start1, after1 = marks[("pre", 1, 0)], marks[("fwd", 1, 0, 0)]
            working = peaks[("pre", 0, 0)] - start0[1]
            first = (after0[0] - start0[0]) / working
            second = (after1[0] - start1[0]) / working
            planned = planner_reserved_peak(plan, "cpu", mode)
            print(
                f"| {point_id(point)} | {state} | {mode} | {working / MiB:,.0f} MiB | {first:.2f} W | "
                f"{start1[0] / MiB:,.0f}, {start1[1] / MiB:,.0f} MiB | {second:.2f} W | "
                f"{reserved_peak / MiB:,.0f} MiB | {planned / MiB:,.0f} MiB | {planned / reserved_peak - 1:+.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
