"""How fast `dit-plan` answers: the CLI in a fresh subprocess (Python start-up and imports included),
`make_plan` in-process, and the CPU time of a plan written with its chart (plan/memory.png) against a bare
interpreter importing what the planner needs (`python -c "import numpy, yaml, tabulate"`): process CPU time
(user + sys, so a busy box's waiting does not count), medians of --cpu-runs. The bar: within 3x.
Run: `python benchmarks/plan_speed.py [--runs 10] [--cpu-runs 5]`; record the output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
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


def child_cpu_s(command: list[str]) -> float:
    """User + system CPU seconds of one run of `command` (a child process, waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_of_a_plan(runs: int) -> dict[str, float]:
    """Median CPU seconds: the bare interpreter, a plan with its chart, a plan with --no-chart; the runs
    interleaved, so that a change in the box's load falls on all three alike."""
    exe = shutil.which("dit-plan")
    plan = [exe] if exe else [sys.executable, "-m", "planner.cli"]
    cases = {
        "python -c 'import numpy, yaml, tabulate'": [sys.executable, "-c", "import numpy, yaml, tabulate"],
        "dit-plan ... --out plan (with plan/memory.png)": plan + HEADLINE + ["--out", "PLAN"],
        "dit-plan ... --out plan --no-chart": plan + HEADLINE + ["--out", "PLAN", "--no-chart"],
    }
    seconds = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(runs):
            for name, command in cases.items():
                seconds[name].append(
                    child_cpu_s([os.path.join(folder, "plan") if a == "PLAN" else a for a in command])
                )
    return {name: statistics.median(values) for name, values in seconds.items()}


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
    parser.add_argument("--cpu-runs", type=int, default=5, help="runs of each CPU-time case (medians)")
    args = parser.parse_args()
    runs = args.runs
    print(f"machine: {machine()}")
    walls = time_cli(runs)
    print(
        f"dit-plan {' '.join(HEADLINE)} (subprocess, {runs} runs): median {statistics.median(walls) * 1e3:.0f} ms, "
        f"max {max(walls) * 1e3:.0f} ms"
    )
    for name, seconds in time_make_plan(runs).items():
        print(f"make_plan {name}: median {seconds * 1e3:.1f} ms")
    cpu = cpu_of_a_plan(args.cpu_runs)
    for name, seconds in cpu.items():
        print(f"CPU (user+sys), median of {args.cpu_runs}: {name}: {seconds:.2f} s")
    bare, chart, bare_plan = cpu.values()
    print(f"a plan with its chart / the bare interpreter: {chart / bare:.2f}x (the bar: 3x)")
    print(f"a plan with its chart / --no-chart: {chart / bare_plan:.2f}x")


if __name__ == "__main__":
    main()
