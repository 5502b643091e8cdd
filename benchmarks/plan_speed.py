"""How fast `dit-plan` answers: the CLI in a fresh subprocess (Python start-up and imports included) and
`make_plan` in-process. Run: `python benchmarks/plan_speed.py [--runs 10]`; record the output in docs/planner.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HEADLINE = ["--gpus", "8", "--vram", "40G", "--global-batch", "256"]
CASES = {
    "headline (8 x 40G, XL/2 @256)": dict(gpus=8, vram="40G", global_batch=256),
    "1 x 24G, XL/2 @512 (long path)": dict(gpus=1, vram="24G", global_batch=256, resolution=512),
    "4 nodes x 8 x 80G, XL/2 @512": dict(gpus=8, nodes=4, vram="80G", global_batch=1024, resolution=512),
}


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), ""
            )
    except OSError:
        pass
    return f"{platform.machine()} {model or platform.processor()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def time_cli(runs: int) -> list[float]:
    exe = shutil.which("dit-plan")
    command = [exe] if exe else [sys.executable, "-m", "planner.cli"]
    walls = []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run(
                command + HEADLINE + ["--out", os.path.join(folder, "plan")],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            walls.append(time.perf_counter() - start)
    return walls


def time_make_plan(runs: int) -> dict[str, float]:
    from planner.plan import make_plan

    results = {}
    for name, kwargs in CASES.items():
        make_plan(**kwargs)  # warm the preset cache
        walls = []
        for _ in range(runs):
            start = time.perf_counter()
            make_plan(**kwargs)
            walls.append(time.perf_counter() - start)
        results[name] = statistics.median(walls)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    runs = parser.parse_args().runs
    print(f"machine: {machine()}")
    walls = time_cli(runs)
    print(
        f"dit-plan {' '.join(HEADLINE)} (subprocess, {runs} runs): median {statistics.median(walls) * 1e3:.0f} ms, "
        f"max {max(walls) * 1e3:.0f} ms"
    )
    for name, seconds in time_make_plan(runs).items():
        print(f"make_plan {name}: median {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
