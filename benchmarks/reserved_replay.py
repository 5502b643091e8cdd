"""The verify grid's traced steps replayed through the caching-allocator model (dit_accel/memtrace/allocator.py):
traced allocated peak vs replayed reserved peak, fixed and expandable segments, at full depth and as `verify`
extrapolates it from shallow traces, and the least reserved memory each step runs in when the allocator
releases its cache under pressure (`least_reserved`). The calibration data of the planner's reserved model
(planner/allocator.py, docs/planner-accuracy.md). CPU only: fake tensors allocate nothing.

    python benchmarks/reserved_replay.py --out benchmarks/results/reserved_replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_memtrace_grid import GRID, make_plan  # noqa: E402

from dit_accel.memtrace import trace_training_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", type=int, nargs="*", default=None, help="grid indices")
    args = parser.parse_args()
    rows = []
    for index, point in enumerate(GRID):
        if args.only is not None and index not in args.only:
            continue
        plan = make_plan(*point)
        started = time.perf_counter()
        full = trace_training_step(plan, depth_extrapolate="off", autocast_device="cpu")
        rows.append(
            {
                "index": index,
                "point": list(point),
                "traced_peak_bytes": full.peak_bytes,
                "components": full.components,
                "full": full.allocator,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
        r = full.allocator
        print(
            index,
            point,
            f"alloc {full.peak_bytes / 2**30:.3f} GiB",
            f"fixed {r['fixed']['reserved_peak_bytes'] / 2**30:.3f}",
            f"exp {r['expandable']['reserved_peak_bytes'] / 2**30:.3f}",
            f"least fixed {r['fixed']['least_reserved_bytes'] / 2**30:.3f}",
            f"exp {r['expandable']['least_reserved_bytes'] / 2**30:.3f}",
            f"{rows[-1]['seconds']} s",
            flush=True,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
