"""Helper of benchmarks/gpu_calibrate.sh: plans to calibrate, and the planner-vs-GPU table afterwards.

    python benchmarks/gpu_calibrate.py plans OUT_DIR        writes OUT_DIR/plan-ckptN.json (DiT-XL/2 @256 bf16)
    python benchmarks/gpu_calibrate.py report OUT_DIR       prints the markdown table for docs/planner-accuracy.md

The plans carry the planner's own estimate (planner.memory.step_memory, CUDA autocast, fused AdamW, one GPU)
so the table compares it with what the GPU measured at every micro-batch the calibration ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from planner.hardware import Assumptions
from planner.memory import Cluster, Decision, step_memory
from planner.spec import model_spec

MODEL, RESOLUTION, PRECISION = "DiT-XL/2", 256, "bf16"
CHECKPOINTED = (0, 14)  # none, and half of the 28 blocks
PLAN_MICRO_BATCH = 32
H200_BYTES = 143771 * 2**20


def estimate(micro_batch: int, checkpointed_blocks: int, vram_bytes: int = H200_BYTES):
    decision = Decision(
        micro_batch=micro_batch,
        grad_accum=1,
        checkpointed_blocks=checkpointed_blocks,
        precision=PRECISION,
        sharding="ddp",
        latents="precomputed",
        ema=True,
        adamw="fused",
    )
    cluster = Cluster(nodes=1, gpus_per_node=1, vram_bytes=vram_bytes)
    return step_memory(model_spec(MODEL, RESOLUTION), decision, cluster, Assumptions())


def write_plans(out_dir: Path) -> None:
    spec = model_spec(MODEL, RESOLUTION)
    out_dir.mkdir(parents=True, exist_ok=True)
    for checkpointed in CHECKPOINTED:
        memory = estimate(PLAN_MICRO_BATCH, checkpointed)
        plan = {
            "schema": "dit-plan/1",
            "inputs": {"model": MODEL, "resolution": RESOLUTION, "gpus": 1, "gpu": "h200"},
            "model": {
                "name": spec.name,
                "resolution": RESOLUTION,
                "latent_size": spec.latent_size,
                "in_channels": spec.in_channels,
                "tokens": spec.tokens,
                "params_trainable": spec.params_trainable,
                "fwd_flops_per_image": spec.fwd_flops_per_image,
            },
            "cluster": {
                "nodes": 1,
                "gpus_per_node": 1,
                "world_size": 1,
                "vram_bytes": H200_BYTES,
                "gpu": "h200",
            },
            "global_batch": PLAN_MICRO_BATCH,
            "decision": {
                "micro_batch": PLAN_MICRO_BATCH,
                "grad_accum": 1,
                "checkpointed_blocks": checkpointed,
                "precision": PRECISION,
                "sharding": "ddp",
                "latents": "precomputed",
                "ema": True,
            },
            "memory": dict(memory.components, peak_bytes=memory.peak_bytes, budget_bytes=memory.budget_bytes),
        }
        (out_dir / f"plan-ckpt{checkpointed}.json").write_text(json.dumps(plan, indent=2) + "\n")


def report(out_dir: Path) -> str:
    gib = 2**30
    lines = [
        "| checkpointed | micro-batch | planned allocated GiB | measured max allocated GiB | error | "
        "planned total GiB | measured reserved + outside GiB | error | img/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    largest_lines = []
    for checkpointed in CHECKPOINTED:
        path = out_dir / f"calibration-ckpt{checkpointed}.json"
        if not path.exists():
            lines.append(
                f"| {checkpointed} | (no calibration file: the run failed or timed out) | | | | | | | |"
            )
            continue
        calibration = json.loads(path.read_text())
        outside = calibration["fit"]["outside_allocator_bytes"] or 0
        for m in calibration["measurements"]:
            est = estimate(m["micro_batch"], checkpointed)
            allocated = sum(v for k, v in est.components.items() if k != "overhead")
            measured_total = m["max_reserved_bytes"] + outside
            lines.append(
                f"| {checkpointed} | {m['micro_batch']} | {allocated / gib:.2f} | {m['max_allocated_bytes'] / gib:.2f} | "
                f"{(allocated - m['max_allocated_bytes']) / m['max_allocated_bytes']:+.1%} | {est.peak_bytes / gib:.2f} | "
                f"{measured_total / gib:.2f} | {(est.peak_bytes - measured_total) / measured_total:+.1%} | "
                f"{m['images_per_s']:.1f} |"
            )
        budget = calibration["gpu"]["total_bytes"]
        planned_largest = max(
            (mb for mb in range(1, 4097) if estimate(mb, checkpointed, budget).peak_bytes <= budget),
            default=0,
        )
        largest_lines.append(
            f"- {checkpointed} blocks checkpointed: largest micro-batch that fits measured "
            f"{calibration['largest_micro_batch']} (first OOM {calibration['smallest_oom_micro_batch']}), "
            f"planner {planned_largest}; MFU "
            f"{'n/a' if calibration['fit']['mfu'] is None else format(calibration['fit']['mfu'], '.1%')}, "
            f"fragmentation (reserved/allocated) {calibration['fit']['fragmentation']:.3f}, "
            f"outside the allocator {outside / gib:.2f} GiB"
        )
        gpu, software = calibration["gpu"], calibration["software"]
    header = (
        [
            f"GPU: {gpu['name']} ({gpu['total_bytes'] / gib:.1f} GiB), torch {software['torch']}, CUDA {software['cuda']}, "
            f"measured {calibration['created']}",
            "",
        ]
        if largest_lines
        else []
    )
    return "\n".join(header + lines + [""] + largest_lines) + "\n"


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    if command == "plans":
        write_plans(folder)
    elif command == "report":
        sys.stdout.write(report(folder))
    else:
        sys.exit(f"usage: {sys.argv[0]} plans|report OUT_DIR")
