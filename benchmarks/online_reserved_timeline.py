"""Where the reserved peak of an online-latents step forms: the verify grid's online points traced (CPU
autocast, fake tensors, a few seconds each) and replayed through the caching-allocator model, reading the
reserved and requested bytes at the windows that matter: the VAE encode of the first step (on an empty
cache), the first optimizer step, the encode of the second step, and the end, beside the planner's reserved
peak. Each point twice: AdamW's state made before the first step as dit-accel's trainer makes it ("eager"),
and made inside the first optimizer step as torch's AdamW does by default ("lazy": other codebases,
`--assume adamw_state=lazy`). Beyond the grid, three online points whose DiT transient is large (no
checkpointing) test the planner's rules where the cache is ample. A second table replays online points with
two micro-steps: what the second micro-step's encode maps beside the first one's gradients, against
planner/allocator.py `accumulating_encode_bytes`, and the reserved peak and the least reserved (release and
retry) against the planner's. docs/planner-accuracy.md ("Online latents: where the reserved peak forms")
records the figures.

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
from dit_accel.memtrace.allocator import CachingAllocator, least_reserved, replay_steps  # noqa: E402
from dit_accel.memtrace.comparison import planner_least_reserved, planner_reserved_peak  # noqa: E402
from planner import vae  # noqa: E402
from planner.allocator import accumulating_encode_bytes  # noqa: E402
from planner.decision import Cluster
from planner.hardware import Assumptions  # noqa: E402
from planner.memory import accumulated_gradient_bytes, encoder_working_bytes  # noqa: E402

MiB = 2**20
STATES = ("eager", "lazy")
BEYOND_GRID = [
    ("DiT-S/2", 256, "fp32", 0, 32, 1, True, "online"),
    ("DiT-B/2", 256, "bf16", 0, 16, 1, True, "online"),
    ("DiT-XL/2", 256, "fp32", 0, 8, 1, True, "online"),
]
ACCUMULATING = [
    ("DiT-S/2", 256, "bf16", 0, 8, 2, True, "online"),
    ("DiT-B/4", 256, "fp32", 6, 8, 2, True, "online"),  # the grid's
    ("DiT-B/4", 256, "bf16", 6, 8, 2, True, "online"),
    ("DiT-XL/2", 256, "bf16", 28, 16, 2, True, "online"),
    ("DiT-L/2", 512, "bf16", 12, 4, 2, False, "online"),
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


def accumulating_table() -> None:
    print()
    print(
        "| point | mode | gradients G | largest map | micro-step 2 encode: new reserved | rule | reserved peak | "
        "planner | error | least reserved | planner | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for point in ACCUMULATING:
        plan = make_plan(*point)
        tracker = trace_events(plan)
        spec, decision, one_gpu = plan.spec(), plan.decision, Cluster(1, 1, 80 * 10**9)
        gradients = accumulated_gradient_bytes(spec, decision, one_gpu)
        largest_map = vae.encoder_activation_bytes(spec.resolution, decision.micro_batch, 1)
        working = encoder_working_bytes(spec, decision, one_gpu, Assumptions())
        for mode in ("expandable", "fixed"):
            marks, _, reserved_peak = window_marks(tracker, mode == "expandable")
            mapped = marks[("fwd", 1, 1, 0)][0] - marks[("pre", 1, 1)][0]
            rule = accumulating_encode_bytes(gradients, largest_map, working, mode)
            planned = planner_reserved_peak(plan, "cpu", mode)
            least = least_reserved(tracker.events, mode == "expandable")
            planned_least = planner_least_reserved(plan, "cpu", mode)
            print(
                f"| {point_id(point)} | {mode} | {gradients / MiB:,.0f} MiB | {largest_map / MiB:,.0f} MiB | "
                f"{mapped / MiB:,.0f} MiB | {rule / MiB:,.0f} MiB | {reserved_peak / MiB:,.0f} MiB | "
                f"{planned / MiB:,.0f} MiB | {planned / reserved_peak - 1:+.1%} | {least / MiB:,.0f} MiB | "
                f"{planned_least / MiB:,.0f} MiB | {planned_least / least - 1:+.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
    accumulating_table()
