"""Helper of benchmarks/gpu_check.sh: what the machine is, and the summary of whatever has been measured.

    python3 benchmarks/gpu_check.py machine              the machine and software as JSON (stdout)
    python3 benchmarks/gpu_check.py summary WORK OUT     OUT/summary.json, summary.md, log-tail.txt, plan.json,
                                                         runs.tar.gz from the scratch folder WORK
    python3 benchmarks/gpu_check.py modes FOLDER         the table of benchmarks/gpu_modes.sh's calibrations
                                                         (FOLDER: modes.tar.gz unpacked), planner beside GPU

The summary runs after every stage, so a check stopped at any point still returns what it measured. The
memory a run measured (metrics.jsonl: `torch.cuda.max_memory_allocated` / `max_memory_reserved`, logged by
dit_accel.train.steplog) is set against the plan's tensors and peak; each calibration point against the planner's
estimate at that micro-batch (planner.memory.step_memory, the function that made the plan).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

GIB = 2**30
RUNS = ("eager", "compiled", "fp8", "lightningdit")
RUN_PLANS = {
    "eager": "plan",
    "compiled": "plan",
    "fp8": "plan-fp8",
    "lightningdit": "plan-lightningdit",
}  # run: its plan in WORK
CALIBRATIONS = {"calibration": "plan", "calibration-ckpt14": "plan-ckpt14"}  # file in OUT: plan in WORK
TAIL_LINES = 40  # of each stage's log in log-tail.txt


def machine() -> dict:
    """The GPU, the driver and the software the check ran with (and where dit_accel was imported from)."""
    import torch

    info = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "gpu_total_bytes": None,
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(
            gpu=properties.name,
            gpu_total_bytes=int(properties.total_memory),
            capability=f"{properties.major}.{properties.minor}",
        )
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        answer = subprocess.run(query, capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = answer.stdout.strip() or answer.stderr.strip()
    import dit_accel

    info["dit_accel_from"] = str(Path(dit_accel.__file__).resolve().parent.parent)
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
        info["diffusers_from"] = str(Path(diffusers.__file__).resolve().parent.parent)
    except ImportError:
        info["diffusers"] = None
    return info


# --- reading what the stages left ----------------------------------------------------------------------


def read_stages(work: Path) -> list[dict]:
    stages = []
    path = work / "stages.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds, limit = line.split("\t")
        status = {"0": "ok", "124": "timed out", "137": "timed out", "skipped": "skipped"}.get(rc, "failed")
        stages.append(
            {
                "name": name,
                "status": status,
                "exit": None if rc == "skipped" else int(rc),
                "seconds": int(seconds),
                "limit_s": int(limit),
            }
        )
    return stages


def read_plan_file(path: Path):
    from planner.planfile import read_plan

    return read_plan(path) if path.exists() else None


def peak_flops(plan) -> float | None:
    """The GPU preset's matmul rate at the plan's precision (None when planned by --vram alone)."""
    from planner.hardware import gpu_preset

    return gpu_preset(plan.cluster.gpu).matmul_peak_flops(plan.matmul) if plan.cluster.gpu else None


def run_summary(run_dir: Path, plan) -> dict | None:
    """A training run's images/s (median of the log windows after the first, which holds start-up and
    compilation), MFU and measured memory beside the plan's, from its metrics.jsonl and log."""
    from planner.search import image_step_flops

    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        return None
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not lines:
        return None
    timed = lines[1:] or lines
    images_per_s = statistics.median(line["images_per_s"] for line in timed)
    allocated = max((line.get("peak_allocated_bytes") or 0) for line in lines) or None
    reserved = max((line.get("peak_reserved_bytes") or 0) for line in lines) or None
    rate = peak_flops(plan)
    memory = plan.memory
    log_path = run_dir / "logs" / "rank0.log"
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    compiled = [
        line.split("compiled blocks: ", 1)[1] for line in log_text.splitlines() if "compiled blocks: " in line
    ]
    return {
        "final_loss": lines[-1].get(
            "loss"
        ),  # the last logged window's: FP8 beside bf16, the same data and seed
        "model": plan.spec().name,
        "micro_batch": plan.decision.micro_batch,
        "est_images_per_s": plan.throughput.est_images_per_s if plan.throughput else None,
        "steps": lines[-1]["step"],
        "images_per_s": images_per_s,
        "images_per_s_windows": [line["images_per_s"] for line in lines],
        "mfu": images_per_s * image_step_flops(plan.spec(), plan.decision) / rate if rate else None,
        "max_allocated_bytes": allocated,
        "max_reserved_bytes": reserved,
        "plan_tensor_bytes": memory.tensor_bytes if memory else None,
        "plan_reserved_bytes": memory.reserved_peak_bytes if memory else None,
        "plan_peak_bytes": memory.peak_bytes if memory else None,
        "allocated_over_plan": allocated / memory.tensor_bytes if allocated and memory else None,
        "compiled_blocks": compiled[0].split(",")[0] if compiled else None,
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")),
    }


def plan_cluster(plan):
    from planner.decision import Cluster
    from planner.hardware import gpu_preset

    return Cluster(
        nodes=plan.cluster.nodes,
        gpus_per_node=plan.cluster.gpus_per_node,
        vram_bytes=plan.cluster.vram_bytes,
        gpu=gpu_preset(plan.cluster.gpu) if plan.cluster.gpu else None,
    )


def plan_assumptions(plan):
    """The assumptions the plan was made under (e.g. --assume allocator_segments=fixed), as it wrote them."""
    from planner.hardware import Assumptions

    return Assumptions(**plan.assumptions) if plan.assumptions else Assumptions()


def planned_memory(plan, micro_batch: int):
    """The planner's estimate of this plan's step at another micro-batch (no accumulation), as it made the plan."""
    from planner.memory import step_memory

    decision = dataclasses.replace(plan.decision, micro_batch=micro_batch, grad_accum=1)
    return step_memory(plan.spec(), decision, plan_cluster(plan), plan_assumptions(plan))


def modes_table(folder: Path) -> str:
    """benchmarks/gpu_modes.sh's calibrations, each point beside the planner (error = plan / measured - 1),
    the MFU the planner's model needs to give each measured images/s back, and the VAE encoder's rate from
    each online mode against the precomputed one of its matmul mode at the same micro-batch."""
    from planner.errors import PlanError
    from planner.memory import step_memory
    from planner.search import estimate_throughput, implied_mfu, implied_vae_mfu

    rows, measured = [], {}
    header = (
        "| mode | allocator | micro-batch | allocated GiB: plan / GPU | error | reserved + outside GiB: plan / GPU"
        " | error | img/s: plan / GPU | error | implied MFU |"
    )
    rows += [header, "|" + "---|" * 10]
    for calibration_path in sorted(folder.glob("*/calibration.json")):
        name = calibration_path.parent.name
        plan = read_plan_file(calibration_path.parent / "plan.json")
        spec, cluster, assumptions = plan.spec(), plan_cluster(plan), plan_assumptions(plan)
        calibration = json.loads(calibration_path.read_text())
        outside = (calibration.get("fit") or {}).get("outside_allocator_bytes") or 0
        segments = plan.assumptions.get("allocator_segments", "expandable")
        for m in calibration.get("measurements", []):
            mb = m["micro_batch"]
            decision = dataclasses.replace(plan.decision, micro_batch=mb, grad_accum=1)
            memory = step_memory(spec, decision, cluster, assumptions)
            speed = estimate_throughput(spec, decision, cluster, assumptions, plan.matmul)
            gpu_total = m["max_reserved_bytes"] + outside
            try:
                mfu = implied_mfu(spec, decision, cluster, assumptions, m["images_per_s"], plan.matmul)
            except PlanError:
                mfu = None
            key = (plan.matmul, plan.decision.latents, plan.decision.checkpointed_blocks, mb)
            measured[key] = (spec, decision, cluster, assumptions, m["images_per_s"])
            rows.append(
                f"| {name} | {segments} | {mb} | {gib(memory.allocated_peak_bytes)} / {gib(m['max_allocated_bytes'])}"
                f" | {percent(memory.allocated_peak_bytes / m['max_allocated_bytes'] - 1)}"
                f" | {gib(memory.peak_bytes)} / {gib(gpu_total)} | {percent(memory.peak_bytes / gpu_total - 1)}"
                f" | {speed.images_per_s:.1f} / {m['images_per_s']:.1f} | {percent(speed.images_per_s / m['images_per_s'] - 1)}"
                f" | {f'{mfu:.3f}' if mfu else 'n/a'} |"
            )
    vae = []
    for (matmul, latents, checkpointed, mb), (spec, decision, cluster, assumptions, online) in sorted(
        measured.items(), key=lambda item: item[0]
    ):
        same = measured.get((matmul, "precomputed", checkpointed, mb))
        if latents == "online" and same:
            try:
                rate = implied_vae_mfu(spec, decision, cluster, assumptions, online, same[-1])
                vae.append(
                    f"- {matmul}, {checkpointed} checkpointed, micro-batch {mb}: VAE encoder MFU {rate:.3f}"
                )
            except PlanError as error:
                vae.append(f"- {matmul}, micro-batch {mb}: {error}")
    return "\n".join(rows + [""] + (vae or ["- no online mode has a precomputed twin"])) + "\n"


def calibration_summary(calibration: dict, plan) -> dict:
    """Each measured point beside the planner's estimate at that micro-batch, and the largest that fits."""
    outside = (calibration.get("fit") or {}).get("outside_allocator_bytes") or 0
    points = []
    for m in calibration.get("measurements", []):
        estimate = planned_memory(plan, m["micro_batch"]) if plan else None
        point = {
            "micro_batch": m["micro_batch"],
            "images_per_s": m["images_per_s"],
            "max_allocated_bytes": m["max_allocated_bytes"],
            "max_reserved_bytes": m["max_reserved_bytes"],
            "device_used_bytes": m.get("device_used_bytes"),
        }
        if estimate is not None:
            measured_total = m["max_reserved_bytes"] + outside
            point.update(
                planned_allocated_bytes=estimate.allocated_peak_bytes,
                allocated_error=(estimate.allocated_peak_bytes - m["max_allocated_bytes"])
                / m["max_allocated_bytes"],
                planned_peak_bytes=estimate.peak_bytes,
                peak_error=(estimate.peak_bytes - measured_total) / measured_total,
            )
        points.append(point)
    return {
        "complete": calibration.get("complete"),
        "checkpointed_blocks": calibration.get("config", {}).get("checkpointed_blocks"),
        "allocator": calibration.get("allocator"),
        "points": points,
        "out_of_memory_micro_batches": calibration.get("out_of_memory_micro_batches", []),
        "largest_micro_batch": calibration.get("largest_micro_batch"),
        "smallest_oom_micro_batch": calibration.get("smallest_oom_micro_batch"),
        "planned_micro_batch": plan.decision.micro_batch if plan else None,
        "fit": calibration.get("fit"),
    }


def summarise(work: Path, out: Path) -> dict:
    machine_path = work / "machine.json"
    summary = {
        "check": "benchmarks/gpu_check.sh",
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": json.loads(machine_path.read_text() or "{}") if machine_path.exists() else {},
        "stages": read_stages(work),
        "plan": None,
        "runs": {},
        "calibrations": {},
    }
    plan = read_plan_file(work / "plan" / "plan.json")
    if plan is not None:
        spec, decision = plan.spec(), plan.decision
        summary["plan"] = {
            "model": spec.name,
            "resolution": spec.resolution,
            "gpu": plan.cluster.gpu,
            "vram_bytes": plan.cluster.vram_bytes,
            "micro_batch": decision.micro_batch,
            "grad_accum": decision.grad_accum,
            "checkpointed_blocks": decision.checkpointed_blocks,
            "depth": spec.depth,
            "precision": decision.precision,
            "est_images_per_s": plan.throughput.est_images_per_s if plan.throughput else None,
        }
    for mode in RUNS:
        run_plan = plan if RUN_PLANS[mode] == "plan" else read_plan_file(work / RUN_PLANS[mode] / "plan.json")
        measured = run_summary(work / f"run-{mode}", run_plan) if run_plan is not None else None
        if measured is not None:
            summary["runs"][mode] = measured
    if "eager" in summary["runs"] and "compiled" in summary["runs"]:
        eager, compiled = summary["runs"]["eager"], summary["runs"]["compiled"]
        summary["compiled_over_eager"] = compiled["images_per_s"] / eager["images_per_s"]
    profile_path = work / "profile" / "profile.json"  # benchmarks/profile_step.py: where the step's time goes
    if profile_path.exists():
        summary["profile"] = json.loads(profile_path.read_text())
    for name, plan_folder in CALIBRATIONS.items():
        path = out / f"{name}.json"
        if path.exists():
            calibration = json.loads(path.read_text())
            summary["calibrations"][name] = calibration_summary(
                calibration, read_plan_file(work / plan_folder / "plan.json")
            )
    return summary


# --- writing -------------------------------------------------------------------------------------------


def gib(value) -> str:
    return f"{value / GIB:.2f}" if value else "n/a"


def percent(value) -> str:
    return f"{value:+.1%}" if value is not None else ""


def markdown(summary: dict) -> str:
    """The tables for docs/benchmarks.md ("On one GPU") and docs/planner-accuracy.md ("Planner vs GPU")."""
    machine, plan = summary["machine"], summary["plan"]
    lines = [
        f"GPU: {machine.get('gpu') or 'none (CPU)'} ({gib(machine.get('gpu_total_bytes'))} GiB), "
        f"{machine.get('nvidia_smi', 'no nvidia-smi')}; torch {machine.get('torch')}, CUDA {machine.get('cuda')}, "
        f"{machine.get('cpus')} CPUs; written {summary['written']}",
        "",
    ]
    if plan:
        lines += [
            f"Plan: {plan['model']} @{plan['resolution']}, {plan['precision']}, micro-batch {plan['micro_batch']} x "
            f"accumulation {plan['grad_accum']}, {plan['checkpointed_blocks']}/{plan['depth']} blocks checkpointed, "
            f"{plan['gpu'] or 'no GPU preset'}; planned {plan['est_images_per_s'] or 0:.0f} img/s",
            "",
        ]
    if summary["runs"]:
        lines += [
            "| run | model, micro-batch | images/s (median of windows 2+) | planned img/s | MFU | max allocated GiB "
            "| plan: tensors GiB | max reserved GiB | plan: reserved GiB | plan: peak GiB | compiled blocks "
            "| last loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for mode, run in summary["runs"].items():
        mfu = f"{run['mfu']:.1%}" if run["mfu"] is not None else "n/a"
        planned = f"{run['est_images_per_s']:.0f}" if run.get("est_images_per_s") else "n/a"
        loss = f"{run['final_loss']:.4f}" if run.get("final_loss") is not None else "n/a"
        lines.append(
            f"| {mode} | {run.get('model')}, {run.get('micro_batch')} | {run['images_per_s']:.1f} | {planned} | "
            f"{mfu} | {gib(run['max_allocated_bytes'])} | "
            f"{gib(run['plan_tensor_bytes'])} | {gib(run['max_reserved_bytes'])} | {gib(run['plan_reserved_bytes'])} | "
            f"{gib(run['plan_peak_bytes'])} | {run['compiled_blocks'] or 'none'} | {loss} |"
        )
    if "compiled_over_eager" in summary:
        lines += ["", f"compiled / eager: {summary['compiled_over_eager']:.3f}x"]
    for name, calibration in summary["calibrations"].items():
        state = "complete" if calibration["complete"] else "INCOMPLETE (stopped part-way)"
        lines += [
            "",
            f"{name}: {calibration['checkpointed_blocks']} blocks checkpointed, {state}; largest micro-batch that "
            f"fits {calibration['largest_micro_batch']} (first OOM {calibration['smallest_oom_micro_batch']}), "
            f"planned {calibration['planned_micro_batch']}; allocator "
            f"{(calibration['allocator'] or {}).get('alloc_conf')}",
            "",
            "| micro-batch | planned allocated GiB | measured max allocated GiB | error | planned peak GiB | "
            "measured reserved + outside GiB | error | img/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        outside = (calibration["fit"] or {}).get("outside_allocator_bytes") or 0
        for p in calibration["points"]:
            lines.append(
                f"| {p['micro_batch']} | {gib(p.get('planned_allocated_bytes'))} | {gib(p['max_allocated_bytes'])} | "
                f"{percent(p.get('allocated_error'))} | {gib(p.get('planned_peak_bytes'))} | "
                f"{gib(p['max_reserved_bytes'] + outside)} | {percent(p.get('peak_error'))} | {p['images_per_s']:.1f} |"
            )
    if summary.get("profile"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, however this file was loaded
        from profile_step import markdown as profile_markdown

        lines += ["", profile_markdown(summary["profile"]).rstrip()]
    lines += ["", "Stages: " + ", ".join(map(stage_text, summary["stages"]))]
    return "\n".join(lines) + "\n"


def stage_text(stage: dict) -> str:
    failed = f", exit {stage['exit']}" if stage["status"] == "failed" else ""
    return f"{stage['name']} {stage['status']}{failed} ({stage['seconds']} s)"


def log_tail(work: Path, stages: list[dict]) -> str:
    """The check's own lines, then the last lines of each stage's log."""
    parts = [(work / "check.log").read_text(errors="replace") if (work / "check.log").exists() else ""]
    for stage in stages:
        path = work / f"{stage['name']}.log"
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
            parts.append(
                f"=== {stage['name']} ({stage['status']}): last {len(tail)} lines ===\n" + "\n".join(tail)
            )
    return "\n".join(parts) + "\n"


def archive(work: Path) -> bytes:
    """Every run's metrics, logs and config, and the stage logs: no weights, no data."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for mode in RUNS:
            run = work / f"run-{mode}"
            for path in sorted(run.rglob("*")) if run.exists() else []:
                kept = (
                    path.suffix in (".jsonl", ".json", ".log", ".yaml", ".txt")
                    and "checkpoints" not in path.parts
                )
                if path.is_file() and kept:
                    tar.add(path, arcname=str(path.relative_to(work)))
        for path in (
            sorted(work.glob("*.log")) + sorted(work.glob("*.tsv")) + sorted(work.glob("machine.json"))
        ):
            tar.add(path, arcname=path.name)
    return buffer.getvalue()


def write_outputs(work: Path, out: Path) -> dict:
    from dit_accel.atomic import write_bytes_atomically, write_json_atomically

    summary = summarise(work, out)
    write_json_atomically(out / "summary.json", summary)
    write_bytes_atomically(out / "summary.md", markdown(summary).encode())
    write_bytes_atomically(out / "log-tail.txt", log_tail(work, summary["stages"]).encode())
    if (work / "plan" / "plan.json").exists():
        write_bytes_atomically(out / "plan.json", (work / "plan" / "plan.json").read_bytes())
    write_bytes_atomically(out / "runs.tar.gz", archive(work))
    return summary


if __name__ == "__main__":
    if sys.argv[1:2] == ["machine"]:
        print(json.dumps(machine(), indent=1))
    elif sys.argv[1:2] == ["summary"] and len(sys.argv) == 4:
        write_outputs(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["modes"] and len(sys.argv) == 3:
        print(modes_table(Path(sys.argv[2])), end="")
    else:
        sys.exit(f"usage: {sys.argv[0]} machine | summary WORK OUT | modes FOLDER")
