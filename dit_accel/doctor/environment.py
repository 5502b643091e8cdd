"""Environment checks: library versions, the GPUs this node can see, their memory against the plan's
peak, bf16 and TF32, and the Accelerate YAML against plan.json.

`probe_environment()` reads the real machine into an `EnvironmentFacts`; the checks only read that
dataclass, so a test describes a GPU node (or a broken one) with plain values.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dit_accel.doctor.checks import Check, failed, gib, passed, warned
from dit_accel.doctor.plan import PlanFacts
from dit_accel.errors import UserError
from planner.rules import LaunchSettings, launch_problems
from planner.units import count, plural

GROUP = "environment"
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores
TF32_MIN_CAPABILITY = (8, 0)
CUDA_INDEX = "https://download.pytorch.org/whl/cu128"  # the README's CUDA build of torch
LOW_FREE_MARGIN = 0.05  # free memory within 5% of the total above the plan's peak: allocator headroom is thin


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]
    uuid: str = ""
    error: str = ""  # why torch could not open it (e.g. no memory left for a CUDA context)


@dataclass(frozen=True)
class ComputeApp:
    """A process holding GPU memory, as nvidia-smi --query-compute-apps reports it."""

    pid: int
    process_name: str
    used_bytes: int
    gpu_uuid: str


@dataclass(frozen=True)
class EnvironmentFacts:
    python: str
    torch: str
    cuda_build: str | None  # the CUDA runtime torch was built with (torch.version.cuda); None on a CPU build
    cudnn: int | None
    nccl: str | None
    driver_version: str | None = None  # e.g. "550.54.15", from nvidia-smi
    driver_cuda: str | None = None  # newest CUDA the driver supports, e.g. "12.4"
    cuda_available: bool = False
    gpus: tuple[GpuFacts, ...] = ()
    tf32_matmul: bool = False  # torch.get_float32_matmul_precision() != "highest"
    tf32_cudnn: bool = True
    compute_apps: tuple[ComputeApp, ...] | None = None  # None: nvidia-smi not available, cannot tell
    env: dict = field(default_factory=dict)  # CUDA_VISIBLE_DEVICES, NVIDIA_TF32_OVERRIDE, ACCELERATE_USE_CPU


# --- reading the real machine --------------------------------------------------------------------------


def _nvidia_smi(args: list[str]) -> str | None:
    """stdout of nvidia-smi, or None when it is missing or fails (no driver, no GPU, a container without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _parse_csv(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]


def parse_compute_apps(text: str) -> tuple[ComputeApp, ...]:
    """`nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits`
    (used memory in MiB); rows nvidia-smi cannot fill ('[N/A]', '[Insufficient Permissions]') are dropped."""
    apps = []
    for row in _parse_csv(text):
        if len(row) < 4:
            continue
        pid, name, used, uuid = (
            row[0],
            ", ".join(row[1:-2]),
            row[-2],
            row[-1],
        )  # a process name may hold commas
        try:
            apps.append(
                ComputeApp(
                    pid=int(pid), process_name=name, used_bytes=int(float(used) * 2**20), gpu_uuid=uuid
                )
            )
        except ValueError:
            continue
    return tuple(apps)


def parse_driver_cuda(header: str) -> str | None:
    """The newest CUDA the driver supports, from plain `nvidia-smi`'s banner ('CUDA Version: 12.4')."""
    if "CUDA Version:" not in header:
        return None
    return header.split("CUDA Version:")[1].split()[0]


def _cuda_version_string(encoded: int) -> str:
    """The driver API's 12040 -> '12.4'."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def probe_environment() -> EnvironmentFacts:
    import torch

    nccl = None
    try:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except (AttributeError, RuntimeError):
        pass
    driver_version = driver_cuda = None
    gpu_rows = _nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"])
    if gpu_rows:
        driver_version = _parse_csv(gpu_rows)[0][0]
    gpus = []
    cuda_available = torch.cuda.is_available()
    if cuda_available and hasattr(torch._C, "_cuda_getDriverVersion"):
        driver_cuda = _cuda_version_string(torch._C._cuda_getDriverVersion())
    else:  # no CUDA driver API in torch: plain nvidia-smi's banner names it
        header = _nvidia_smi([])
        if header:
            driver_cuda = parse_driver_cuda(header)
    if cuda_available:
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            error = ""
            try:  # creates a CUDA context on the GPU (a few hundred MiB, released when the doctor exits)
                free_bytes, total_bytes = torch.cuda.mem_get_info(index)
            except RuntimeError as failure:  # a GPU so full that no context fits, or in a bad state
                free_bytes, total_bytes, error = 0, properties.total_memory, str(failure).splitlines()[0]
            gpus.append(
                GpuFacts(
                    index=index,
                    name=properties.name,
                    total_bytes=total_bytes,
                    free_bytes=free_bytes,
                    capability=(properties.major, properties.minor),
                    uuid=f"GPU-{properties.uuid}" if getattr(properties, "uuid", None) else "",
                    error=error,
                )
            )
    app_rows = _nvidia_smi(
        ["--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits"]
    )
    apps = None if app_rows is None else parse_compute_apps(app_rows)
    return EnvironmentFacts(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        nccl=nccl,
        driver_version=driver_version,
        driver_cuda=driver_cuda,
        cuda_available=cuda_available,
        gpus=tuple(gpus),
        tf32_matmul=torch.get_float32_matmul_precision() != "highest",
        tf32_cudnn=bool(torch.backends.cudnn.allow_tf32),
        compute_apps=apps,
        env={
            key: os.environ[key]
            for key in ("CUDA_VISIBLE_DEVICES", "NVIDIA_TF32_OVERRIDE", "ACCELERATE_USE_CPU")
            if key in os.environ
        },
    )


# --- checks --------------------------------------------------------------------------------------------


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split(".") + ["0"])[:2]
    return int(parts[0]), int(parts[1])


def cpu_requested(facts: EnvironmentFacts) -> bool:
    """ACCELERATE_USE_CPU=1 runs the plan's topology on CPU processes (docs/architecture.md, "Running on
    machines without GPUs")."""
    return facts.env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")


def cpu_machine(facts: EnvironmentFacts) -> bool:
    """No GPU, no CUDA device torch can open and no NVIDIA driver: a laptop or a CPU node, where the trainer
    runs the plan's processes on CPUs over gloo (`make_accelerator`: cpu=not torch.cuda.is_available())."""
    return not facts.gpus and not facts.cuda_available and facts.driver_version is None


def cpu_run_is_fine(plan: PlanFacts, facts: EnvironmentFacts) -> bool:
    """A CPU machine with a plan that names no GPU (`dit-plan --vram` alone, as the CPU demo's): the run is a
    CPU run by intent, a warning; a plan for a named GPU (`--gpu h100-80g`) on such a machine is a failure."""
    return cpu_machine(facts) and not plan.gpu


def cuda_torch_install(torch_version: str) -> str:
    """The install line of the README: this torch's version from PyTorch's CUDA 12.8 index."""
    return f"pip install torch=={torch_version.split('+')[0]} --index-url {CUDA_INDEX}"


def check_versions(plan: PlanFacts, facts: EnvironmentFacts) -> Check:
    cudnn = (
        f"{facts.cudnn // 10000}.{facts.cudnn // 100 % 100}.{facts.cudnn % 100}"
        if facts.cudnn and facts.cudnn >= 10000
        else facts.cudnn
    )
    driver = f"driver {facts.driver_version or '?'} (supports CUDA {facts.driver_cuda or '?'})"
    summary = (
        f"python {facts.python}, torch {facts.torch}, CUDA {facts.cuda_build or 'none (CPU build)'}, "
        f"cuDNN {cudnn or 'none'}, NCCL {facts.nccl or 'none'}, {driver}"
    )
    if cpu_requested(facts):
        return passed(GROUP, "versions", summary + "; ACCELERATE_USE_CPU=1: CUDA not needed")
    if cpu_run_is_fine(plan, facts):
        return passed(
            GROUP, "versions", summary + "; no GPU here: a CPU run needs no CUDA (see GPUs visible)"
        )
    if facts.cuda_build is None:
        return failed(
            GROUP,
            "versions",
            summary + f"; the plan needs {count(plan.gpus_per_node, 'GPU')} per node",
            f"install a CUDA build of torch: `{cuda_torch_install(facts.torch)}`",
        )
    if facts.driver_cuda:
        built, supported = _major_minor(facts.cuda_build), _major_minor(facts.driver_cuda)
        if built[0] > supported[0]:
            return failed(
                GROUP,
                "versions",
                summary
                + f"; torch needs a CUDA {built[0]}.x driver, this driver stops at {facts.driver_cuda}",
                f"upgrade the NVIDIA driver, or install a torch build for CUDA {supported[0]}.x",
            )
        if built > supported:
            return warned(
                GROUP,
                "versions",
                summary
                + f"; torch's CUDA {facts.cuda_build} is newer than the driver's {facts.driver_cuda}: "
                "minor-version compatibility runs most kernels, but ones needing newer PTX can fail",
                f"upgrade the driver, or install the torch build for CUDA {facts.driver_cuda}",
            )
    if plan.world_size > 1 and facts.nccl is None:
        return failed(
            GROUP,
            "versions",
            summary + f"; {count(plan.world_size, 'process')} need NCCL and this torch has none",
            "install the official CUDA build of torch (it bundles NCCL)",
        )
    return passed(GROUP, "versions", summary)


def check_gpus_visible(plan: PlanFacts, facts: EnvironmentFacts) -> Check:
    need, seen = plan.gpus_per_node, len(facts.gpus)
    if cpu_requested(facts):
        return warned(
            GROUP,
            "GPUs visible",
            f"ACCELERATE_USE_CPU=1: {need} CPU {plural(need, 'process')} per node stand in for the plan's GPUs",
            "unset ACCELERATE_USE_CPU for a real run",
        )
    if cpu_run_is_fine(plan, facts):
        return warned(
            GROUP,
            "GPUs visible",
            f"no GPU and no NVIDIA driver on this machine: the plan's {count(need, 'process')} per node train "
            f"on CPUs (gloo), as the trainer does without CUDA: fine for the demo and dry runs, far too slow "
            f"for a real run",
            f"for a GPU run: a node with the NVIDIA driver and `{cuda_torch_install(facts.torch)}`; a plan "
            f"made with `dit-plan --gpu NAME` makes this check a failure",
        )
    if seen == 0:
        visible = facts.env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
            why, fix = (
                f"CUDA_VISIBLE_DEVICES={visible!r} hides them",
                "unset CUDA_VISIBLE_DEVICES or list the GPU ids",
            )
        elif facts.cuda_build is None:
            why, fix = "this torch is a CPU-only build", f"`{cuda_torch_install(facts.torch)}` (see versions)"
        elif facts.driver_version is None:
            why, fix = (
                "nvidia-smi finds no driver",
                "install the NVIDIA driver, or run on a GPU node (in a container: --gpus all)",
            )
        else:
            why, fix = (
                "torch.cuda.is_available() is False",
                "check `nvidia-smi` and that the driver matches torch's CUDA",
            )
        return failed(
            GROUP,
            "GPUs visible",
            f"the plan needs {count(need, 'GPU')} per node and no GPU is visible: {why}",
            fix,
        )
    if seen < need:
        return failed(
            GROUP,
            "GPUs visible",
            f"the plan needs {count(need, 'GPU')} per node, {seen} visible",
            f"run on a node with {need} GPUs (check CUDA_VISIBLE_DEVICES), or re-plan with dit-plan --gpus {seen * plan.nodes}",
        )
    names = sorted({gpu.name for gpu in facts.gpus})
    if seen > need:
        return warned(
            GROUP,
            "GPUs visible",
            f"{seen} GPUs visible ({', '.join(names)}), the plan uses {need}",
            f"re-plan with dit-plan --gpus {seen * plan.nodes} to use them all, or set CUDA_VISIBLE_DEVICES",
        )
    return passed(GROUP, "GPUs visible", f"{count(seen, 'GPU')} visible ({', '.join(names)}), as planned")


def _holders(facts: EnvironmentFacts, gpu: GpuFacts) -> str:
    if facts.compute_apps is None:
        return "nvidia-smi is not available, so the processes holding memory cannot be named"
    apps = [app for app in facts.compute_apps if not gpu.uuid or app.gpu_uuid == gpu.uuid]
    if not apps:
        return "nvidia-smi lists no compute process on it"
    return "held by " + ", ".join(f"pid {app.pid} {app.process_name} ({gib(app.used_bytes)})" for app in apps)


def check_gpu_memory(plan: PlanFacts, facts: EnvironmentFacts) -> list[Check]:
    """Each GPU's total and free memory against the plan's per-GPU peak: a failure below what the step needs
    once the allocator releases its cache (plan.json's needed_bytes), a warning below the peak."""
    checks = []
    for gpu in facts.gpus[: plan.gpus_per_node]:
        name = f"GPU {gpu.index} memory"
        figures = f"{gpu.name}: {gib(gpu.free_bytes)} free of {gib(gpu.total_bytes)}, plan peak {gib(plan.peak_bytes)}"
        replan = f"re-plan with dit-plan --vram {gpu.total_bytes / 2**30:.0f}GiB (the real size), or a lower --max-micro-batch"
        if gpu.error:
            checks.append(
                failed(
                    GROUP,
                    name,
                    f"{gpu.name}: torch cannot open it ({gpu.error}); " + _holders(facts, gpu),
                    "stop the processes holding it (nvidia-smi), or pick other GPUs with CUDA_VISIBLE_DEVICES",
                )
            )
        elif gpu.total_bytes < plan.needed_bytes:
            checks.append(
                failed(GROUP, name, figures + f"; the plan was made for {gib(plan.vram_bytes)} GPUs", replan)
            )
        elif gpu.free_bytes < plan.needed_bytes:
            checks.append(
                failed(
                    GROUP,
                    name,
                    figures + "; " + _holders(facts, gpu),
                    "stop the processes holding this GPU (nvidia-smi), or pick free GPUs with CUDA_VISIBLE_DEVICES",
                )
            )
        elif gpu.free_bytes - plan.peak_bytes < LOW_FREE_MARGIN * gpu.total_bytes:
            checks.append(
                warned(
                    GROUP,
                    name,
                    figures + "; under 5% left for the allocator's fragmentation; " + _holders(facts, gpu),
                    "free the GPU, or re-plan with a smaller --vram to keep more headroom",
                )
            )
        elif gpu.total_bytes < 0.97 * plan.vram_bytes:
            checks.append(
                warned(GROUP, name, figures + f"; the plan assumed {gib(plan.vram_bytes)} per GPU", replan)
            )
        else:
            checks.append(passed(GROUP, name, figures))
    return checks


def check_bf16(plan: PlanFacts, facts: EnvironmentFacts) -> Check:
    if plan.precision != "bf16" or not facts.gpus:
        return passed(GROUP, "precision", f"plan precision {plan.precision}")
    old = [gpu for gpu in facts.gpus if gpu.capability < BF16_MIN_CAPABILITY]
    if old:
        gpu = old[0]
        return failed(
            GROUP,
            "precision",
            f"plan precision bf16, but {gpu.name} (compute capability {gpu.capability[0]}.{gpu.capability[1]}) "
            "has no bf16 tensor cores",
            "re-plan with dit-plan --precision fp16 (or fp32) for this GPU",
        )
    return passed(
        GROUP, "precision", "plan precision bf16; every visible GPU supports bf16 (compute capability >= 8.0)"
    )


def check_tf32(plan: PlanFacts, facts: EnvironmentFacts) -> Check:
    """dit_accel.train turns TF32 on for CUDA runs (unless --no-tf32), the rate the planner gives fp32 plans;
    only NVIDIA_TF32_OVERRIDE=0 still takes it away."""
    state = f"TF32 matmul {'on' if facts.tf32_matmul else 'off'}, cuDNN TF32 {'on' if facts.tf32_cudnn else 'off'}"
    if facts.env.get("NVIDIA_TF32_OVERRIDE") == "0":
        return warned(
            GROUP,
            "TF32",
            state + "; NVIDIA_TF32_OVERRIDE=0 disables TF32 for every library",
            "unset NVIDIA_TF32_OVERRIDE unless you need bit-exact fp32",
        )
    return passed(
        GROUP,
        "TF32",
        f"dit_accel.train turns TF32 on for CUDA (--no-tf32 keeps full fp32); "
        f"the plan trains in {plan.precision}",
    )


# --- the Accelerate YAML against the plan ----------------------------------------------------------------


def check_accelerate_config(plan: PlanFacts, config_path: Path) -> Check:
    """The YAML `accelerate launch` reads must describe the same run as plan.json, which the trainer reads."""
    name, remake = "accelerate config", f"re-make both files together: dit-plan ... --out {plan.path.parent}"
    if not config_path.is_file():
        return failed(GROUP, name, f"{config_path} not found", f"pass --accelerate-config PATH, or {remake}")
    try:
        config = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError) as error:
        return failed(
            GROUP, name, f"{config_path} is not readable YAML: {str(error).splitlines()[0]}", remake
        )
    if not isinstance(config, dict):
        return failed(GROUP, name, f"{config_path} is not a YAML mapping", remake)
    from accelerate.commands.config.config_args import ClusterConfig

    try:  # Accelerate's own reader: a top-level key it does not know is an error at launch
        ClusterConfig.from_yaml_file(str(config_path))
    except (ValueError, TypeError, KeyError) as error:
        return failed(
            GROUP, name, f"accelerate cannot read {config_path}: {str(error).splitlines()[0]}", remake
        )
    problems = []
    num_processes = config.get("num_processes")
    if num_processes != plan.world_size:
        problems.append(f"num_processes is {num_processes}, the plan's world size is {plan.world_size}")
    num_machines = config.get("num_machines", 1)
    if num_machines != plan.nodes:
        problems.append(f"num_machines is {num_machines}, the plan has {count(plan.nodes, 'node')}")
    # The trainer's own rule for which launches run the plan (it applies it to the environment this file makes).
    problems += launch_problems(
        plan.sharding, plan.precision, LaunchSettings.from_yaml(config), plan.world_size, plan.nodes
    )
    distributed_type, mixed = config.get("distributed_type", "NO"), config.get("mixed_precision", "no")
    if problems:
        return failed(
            GROUP, name, f"{config_path} disagrees with {plan.path.name}: " + "; ".join(problems), remake
        )
    return passed(
        GROUP,
        name,
        f"{config_path.name}: {distributed_type}, {count(num_processes, 'process')} on "
        f"{count(num_machines, 'machine')}, "
        f"mixed_precision {mixed}, as planned",
    )


def check_trainer_runs_plan(plan: PlanFacts) -> Check:
    """The trainer's own launch check (e.g. it refuses sharded plans it cannot run yet), before the launch."""
    from dit_accel.distributed.accelerator import check_launch

    try:
        check_launch(plan.plan, plan.world_size, str(plan.path))
    except UserError as error:
        return failed(GROUP, "trainer", error.problem, error.fix or "re-plan with dit-plan")
    return passed(
        GROUP,
        "trainer",
        f"dit_accel.train runs this plan: {plan.sharding}, {count(plan.world_size, 'process')}, "
        f"micro-batch {plan.micro_batch} x {plan.grad_accum} accumulation = global batch {plan.global_batch}",
    )


def check_environment(plan: PlanFacts, facts: EnvironmentFacts, config_path: Path) -> list[Check]:
    checks = [check_trainer_runs_plan(plan), check_versions(plan, facts), check_gpus_visible(plan, facts)]
    if facts.gpus and not cpu_requested(facts):
        checks += check_gpu_memory(plan, facts)
        checks += [check_bf16(plan, facts), check_tf32(plan, facts)]
    checks.append(check_accelerate_config(plan, config_path))
    return checks
