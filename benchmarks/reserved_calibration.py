"""The reserved model's fragmentation term (planner/allocator.py TRANSIENT_FRAGMENTATION) from the replays
benchmarks/reserved_replay.py wrote, and the planner's reserved peak held to each replay.

    python benchmarks/reserved_calibration.py benchmarks/results/reserved_replay.json

needed fraction = (replayed reserved - requested peak - rounding - pages) / transient bytes, where the
transient bytes are the requested peak less what lives for the whole run (fp32 weights and buffer, AdamW
states, EMA, VAE weights), as the planner counts them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_memtrace_grid import make_plan, point_id  # noqa: E402

from dit_accel.memtrace.comparison import planner_reserved_peak  # noqa: E402
from planner import allocator  # noqa: E402
from planner.hardware import Assumptions  # noqa: E402
from planner.memory import FP32_BYTES, buffer_bytes  # noqa: E402


def persistent_bytes(spec, ema: bool, online: bool) -> int:
    a = Assumptions()
    vae = a.vae_params * a.vae_bytes_per_param if online else 0
    return (4 if ema else 3) * FP32_BYTES * spec.params_trainable + buffer_bytes(spec) + vae


def main(path: str) -> None:
    rows = json.loads(Path(path).read_text())
    needed = {mode: [] for mode in allocator.SEGMENT_MODES}
    print(
        "| point | requested peak MiB | mode | replayed reserved MiB | needed fraction | planner MiB | error |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        point = tuple(row["point"])
        plan = make_plan(*point)
        spec = plan.spec()
        ema, online = point[6], point[7] == "online"
        for mode in allocator.SEGMENT_MODES:
            replay = row["full"][mode]
            requested = replay["requested_peak_bytes"]
            transient = requested - persistent_bytes(spec, ema, online)
            rounding = (4 if ema else 3) * allocator.parameter_rounding_bytes(spec, 4, 1, mode)
            pages = allocator.LARGE_PAGE_BYTES + allocator.SMALL_PAGE_BYTES if mode == "expandable" else 0
            fraction = (replay["reserved_peak_bytes"] - requested - rounding - pages) / transient
            needed[mode].append(fraction)
            planned = planner_reserved_peak(plan, "cpu", mode)
            error = planned / replay["reserved_peak_bytes"] - 1
            print(
                f"| {point_id(point)} | {requested / 2**20:,.0f} | {mode} | "
                f"{replay['reserved_peak_bytes'] / 2**20:,.0f} | {fraction:.3f} | {planned / 2**20:,.0f} | "
                f"{error:+.1%} |"
            )
    for mode, values in needed.items():
        values.sort()
        print(
            f"{mode}: needed fraction min {values[0]:.3f}, median {values[len(values) // 2]:.3f}, "
            f"max {values[-1]:.3f} over {len(values)} points"
        )


if __name__ == "__main__":
    main(sys.argv[1])
