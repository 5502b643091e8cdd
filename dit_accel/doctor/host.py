"""Host checks: RAM against the plan's per-node estimate (the exitcode -9 cause), /dev/shm for the
data-loader workers, the open-file limit and the CPU count.

`read_host(...)` takes its sources as arguments (a meminfo file, a shm mount, a cgroup root, and
callables for limits and CPUs), so a test points it at a written file to simulate a small node.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dit_accel.doctor.checks import Check, failed, gib, passed, warned
from dit_accel.doctor.plan import PlanFacts
from dit_accel.train.config import most_workers_per_rank, usable_cpus
from planner.units import count

GROUP = "host"
RAM_WARN_FRACTION = 0.9  # an estimate within 10% of what is available is too close to call
PREFETCH_FACTOR = 2  # batches in flight per worker: torch DataLoader's default, which the trainer keeps
BASE_OPEN_FILES = 256  # python, torch, CUDA, NCCL sockets and the log files of one rank
OPEN_FILES_PER_BATCH = 8  # file descriptors a worker's batch in flight may hold (file_descriptor sharing)
COMFORTABLE_OPEN_FILES = 4096


@dataclass(frozen=True)
class HostFacts:
    mem_total_bytes: int
    mem_available_bytes: int
    cgroup_limit_bytes: int | None  # a scheduler's/container's memory limit: it kills with SIGKILL too
    shm_total_bytes: int | None  # None: no /dev/shm
    shm_free_bytes: int | None
    open_files_soft: int
    open_files_hard: int
    cpu_count: int  # CPUs this process may run on (affinity), not the machine's


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo ('MemAvailable:   12345 kB') as bytes by field."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return values


def read_cgroup_limit(cgroup_root: Path) -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max or v1 limit_in_bytes), None when unlimited."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (cgroup_root / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 writes a huge number for "no limit"
            return int(text)
        return None
    return None


def read_host(
    meminfo_path: str | Path = "/proc/meminfo",
    shm_path: str | Path = "/dev/shm",
    cgroup_root: str | Path = "/sys/fs/cgroup",
    open_files: Callable[[], tuple[int, int]] = lambda: resource.getrlimit(resource.RLIMIT_NOFILE),
    cpu_count: Callable[[], int] = usable_cpus,
) -> HostFacts:
    memory = parse_meminfo(Path(meminfo_path).read_text())
    shm_total = shm_free = None
    if Path(shm_path).is_dir():
        stats = os.statvfs(shm_path)
        shm_total, shm_free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    soft, hard = open_files()
    return HostFacts(
        mem_total_bytes=memory.get("MemTotal", 0),
        mem_available_bytes=memory.get("MemAvailable", memory.get("MemFree", 0)),
        cgroup_limit_bytes=read_cgroup_limit(Path(cgroup_root)),
        shm_total_bytes=shm_total,
        shm_free_bytes=shm_free,
        open_files_soft=soft,
        open_files_hard=hard,
        cpu_count=cpu_count(),
    )


@dataclass(frozen=True)
class LoaderFacts:
    """What the data loaders of one node will do: workers per rank and the bytes of one sample in flight."""

    workers_per_rank: int
    sample_bytes: int


def loader_facts(plan: PlanFacts, workers_per_rank: int) -> LoaderFacts:
    """The sample size by the planner's own rule (an fp32 latent, or fp32 RGB pixels; REPA from a cache
    both)."""
    from planner.host import sample_bytes

    size = sample_bytes(plan.plan.spec(), plan.latents, plan.plan.decision.repa)
    return LoaderFacts(workers_per_rank=workers_per_rank, sample_bytes=size)


def check_ram(plan: PlanFacts, host: HostFacts, workers_per_rank: int) -> Check:
    name = "host RAM"
    limit, source = host.mem_available_bytes, "available (MemAvailable)"
    if host.cgroup_limit_bytes is not None and host.cgroup_limit_bytes < limit:
        limit, source = host.cgroup_limit_bytes, "allowed by this job's cgroup memory limit"
    figures = f"{gib(host.mem_total_bytes)} total, {gib(host.mem_available_bytes)} available"
    if host.cgroup_limit_bytes is not None:
        figures += f", cgroup limit {gib(host.cgroup_limit_bytes)}"
    estimate = plan.host_bytes_for_workers(workers_per_rank)
    if estimate is None:
        return warned(
            GROUP,
            name,
            figures + "; the plan has no per-node host RAM estimate to compare with",
            "re-make the plan with this version's dit-plan",
        )
    need = f"the plan needs about {gib(estimate)} per node"
    if plan.loader_workers is not None and plan.loader_workers != workers_per_rank:
        need += (
            f" (its {gib(plan.host_bytes)} assumed {plan.loader_workers} data-loader workers per rank; "
            f"rescaled to the run's {workers_per_rank})"
        )
    fix = (
        "fewer data-loader workers per rank (--num-workers), precomputed latents (dit-accel extract-latents), "
        "loading weights once per node, or a node (or job memory request) with more RAM"
    )
    if estimate > limit:
        return failed(
            GROUP,
            name,
            f"{need}, {gib(limit)} {source} ({figures}): "
            "the kernel's OOM killer (or the scheduler) would kill ranks with exitcode -9",
            fix,
        )
    if estimate > RAM_WARN_FRACTION * limit:
        return warned(GROUP, name, f"{need}, close to the {gib(limit)} {source} ({figures})", fix)
    return passed(GROUP, name, f"{need}; {figures}")


def shm_needed_bytes(plan: PlanFacts, loader: LoaderFacts) -> int:
    """Workers hand batches to their rank through /dev/shm: workers x prefetch x batch, for every rank on the node."""
    batch_bytes = plan.micro_batch * loader.sample_bytes
    return plan.gpus_per_node * loader.workers_per_rank * PREFETCH_FACTOR * batch_bytes


def check_shm(plan: PlanFacts, host: HostFacts, loader: LoaderFacts) -> Check:
    name = "/dev/shm"
    if loader.workers_per_rank == 0:
        return passed(GROUP, name, "no data-loader workers: batches stay in the rank's own memory")
    need = shm_needed_bytes(plan, loader)
    what = (
        f"{count(plan.gpus_per_node, 'rank')} x {count(loader.workers_per_rank, 'worker')} x {PREFETCH_FACTOR} "
        f"batches of {plan.micro_batch} need about {gib(need)}"
    )
    fix = (
        "enlarge it (docker run --shm-size=16g; Kubernetes: an emptyDir with medium Memory on /dev/shm), "
        "or use fewer data-loader workers"
    )
    if host.shm_total_bytes is None:
        return failed(GROUP, name, f"there is no /dev/shm; {what}", fix)
    if host.shm_total_bytes < need:
        return failed(
            GROUP, name, f"{gib(host.shm_total_bytes)} in total; {what} (workers die with 'Bus error')", fix
        )
    if host.shm_free_bytes is not None and host.shm_free_bytes < need:
        return warned(
            GROUP,
            name,
            f"{gib(host.shm_free_bytes)} free of {gib(host.shm_total_bytes)}; {what}",
            "remove stale files in /dev/shm (left by killed runs), or " + fix,
        )
    return passed(GROUP, name, f"{gib(host.shm_total_bytes)}; {what}")


def check_open_files(plan: PlanFacts, host: HostFacts, loader: LoaderFacts) -> Check:
    name = "open-file limit"
    need = BASE_OPEN_FILES + loader.workers_per_rank * PREFETCH_FACTOR * OPEN_FILES_PER_BATCH
    figures = f"soft {host.open_files_soft}, hard {host.open_files_hard}"
    raise_it = f"raise it before the launch: ulimit -n {min(host.open_files_hard, 65536)}"
    if host.open_files_soft < need:
        return failed(
            GROUP,
            name,
            f"{figures}; a rank with {loader.workers_per_rank} workers needs about {need} "
            "('Too many open files' / 'received 0 items of ancdata')",
            raise_it,
        )
    if host.open_files_soft < COMFORTABLE_OPEN_FILES:
        return warned(
            GROUP, name, f"{figures}; enough for about {need}, but below {COMFORTABLE_OPEN_FILES}", raise_it
        )
    return passed(GROUP, name, figures)


def check_cpus(plan: PlanFacts, host: HostFacts, loader: LoaderFacts) -> Check:
    name = "CPUs"
    need = plan.gpus_per_node * (loader.workers_per_rank + 1)
    what = (
        f"{host.cpu_count} usable; {count(plan.gpus_per_node, 'rank')} x "
        f"({count(loader.workers_per_rank, 'worker')} + 1) = {need}"
    )
    if host.cpu_count < need:
        per_rank = most_workers_per_rank(plan.gpus_per_node, host.cpu_count)
        fix = (
            f"use --num-workers {per_rank} (per rank)"
            if per_rank > 0
            else "a node with more CPUs (or --num-workers 0)"
        )
        return warned(
            GROUP,
            name,
            what + ": workers will share cores and may starve the GPUs",
            fix + "; precomputed latents are the cheapest to load",
        )
    return passed(GROUP, name, what)


def check_host(plan: PlanFacts, host: HostFacts, loader: LoaderFacts) -> list[Check]:
    return [
        check_ram(plan, host, loader.workers_per_rank),
        check_shm(plan, host, loader),
        check_open_files(plan, host, loader),
        check_cpus(plan, host, loader),
    ]
