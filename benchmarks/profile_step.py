"""Where a training step's time goes: a few of the trainer's own steps (`memtrace.build_step_parts`, blocks
compiled as the trainer compiles them) under torch.profiler, summarised by kind into a small table.

    python3 benchmarks/profile_step.py --plan PLAN.json --out DIR [--warmup 2] [--steps 3] [--no-compile]

Writes DIR/profile.json and DIR/profile.md: the time by kind (matmul, attention, normalisation and
modulation, elementwise, optimizer, EMA, communication, other, and on a GPU the idle time between kernels),
the top kernels, and the matmuls' achieved TFLOP/s (the planner's FLOP count of the step over the matmuls'
own time). On a GPU the kinds are the device kernels'; on a CPU (the GPU check's dry run) the operators'.
Kernels are sorted into kinds by name (`kind_of`); the optimizer's and the EMA's work is told apart by the
ranges the step marks around them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

KINDS = (
    "matmul",
    "attention",
    "norm and modulation",
    "elementwise",
    "optimizer",
    "ema",
    "communication",
    "other",
)
# the first pattern a (lower-case) kernel or operator name matches decides its kind
PATTERNS = (
    ("communication", r"nccl|all_reduce|allreduce|reduce_scatter|all_gather|c10d|gloo"),
    ("ema", r"lerp"),
    ("optimizer", r"adam|fused_adamw|multi_tensor_apply"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|cudnn_.*attn"),
    (
        "matmul",
        r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|cutlass|sm90_|sm80_|xmma|linear|aten::_scaled_mm|nvjet",
    ),
    ("norm and modulation", r"layer_norm|layernorm|rms_norm|rmsnorm|group_norm|norm_|modulat"),
    (
        "elementwise",
        r"elementwise|vectorized|triton_poi|triton_per|triton_red|gelu|silu|mul|add|copy|cat|fill|"
        r"softmax|where|div|sub|exp|pow|sqrt|mean|sum|clamp|neg|to_copy|_to_copy",
    ),
)
RANGES = {"dit_accel.optimizer_step": "optimizer", "dit_accel.ema_update": "ema"}


def kind_of(name: str) -> str:
    text = name.lower()
    for kind, pattern in PATTERNS:
        if re.search(pattern, text):
            return kind
    return "other"


def summarise(events, wall_s: float, device: str, step_flops: float, steps: int) -> dict:
    """`events`: (name, self time in s, the marked range it ran in or None), the leaf operators (CPU) or the
    kernels (GPU) of the profiled steps. The kinds' totals, the idle remainder of the wall time (on a GPU),
    the top ten, and the matmuls' TFLOP/s."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: dict[str, float] = {}
    for name, seconds, marked in events:
        kind = kind_of(name)
        if marked and kind not in ("communication",):  # the optimizer's or the EMA's own work, whatever op
            kind = RANGES.get(marked, kind)
        by_kind[kind] += seconds
        by_name[name] = by_name.get(name, 0.0) + seconds
    busy = sum(by_kind.values())
    if device == "cuda":
        by_kind["idle between kernels"] = max(wall_s - busy, 0.0)
    total = max(wall_s if device == "cuda" else busy, 1e-12)
    matmul_s = by_kind["matmul"]
    top = sorted(by_name.items(), key=lambda item: -item[1])[:10]
    return {
        "device": device,
        "steps": steps,
        "wall_s_per_step": wall_s / steps,
        "kinds": {kind: {"s_per_step": s / steps, "share": s / total} for kind, s in by_kind.items()},
        "top": [{"name": name[:120], "s_per_step": s / steps, "kind": kind_of(name)} for name, s in top],
        # the step's FLOPs are ~96% matmuls (attention ~4% at 256 tokens): all of them over the matmuls' time
        "matmul_tflops": step_flops / (matmul_s / steps) / 1e12 if matmul_s > 0 else None,
    }


def markdown(summary: dict) -> str:
    lines = [
        f"Profiled {summary['steps']} steps on {summary['device']}: {summary['wall_s_per_step'] * 1e3:.1f} ms "
        "per optimizer step"
        + (
            f"; the matmuls at {summary['matmul_tflops']:.3g} TFLOP/s of the step's FLOPs"
            if summary["matmul_tflops"]
            else ""
        ),
        "",
        "| kind | ms per step | share |",
        "|---|---|---|",
    ]
    for kind, value in summary["kinds"].items():
        lines.append(f"| {kind} | {value['s_per_step'] * 1e3:.2f} | {value['share']:.1%} |")
    lines += ["", "| top kernel | kind | ms per step |", "|---|---|---|"]
    for entry in summary["top"]:
        name = entry["name"].replace("|", "/")
        lines.append(f"| `{name[:80]}` | {entry['kind']} | {entry['s_per_step'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def profile(plan_path: str, out: Path, warmup: int, steps: int, compile_blocks: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, record_function

    from dit_accel.memtrace import build_step_parts
    from dit_accel.models.compile import compile_blocks as compile_each_block
    from dit_accel.train.ema import EMA
    from planner.planfile import read_plan
    from planner.search import image_step_flops

    plan = read_plan(plan_path)
    spec, decision = plan.spec(), plan.decision
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts = build_step_parts(plan, spec, decision.checkpointed_blocks, decision.micro_batch, device)
    if compile_blocks:
        compile_each_block(parts.model)
    ema_update = EMA.update

    def marked_update(self, model):  # the EMA's own range, inside the optimizer step's
        with record_function("dit_accel.ema_update"):
            return ema_update(self, model)

    EMA.update = marked_update

    def step():
        for _ in range(parts.grad_accum):
            parts.micro_step()
        with record_function("dit_accel.optimizer_step"):
            parts.optimizer_step()
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        for _ in range(warmup):  # compilation and the first kernels' set-up stay out of the profile
            step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                step()
            wall_s = time.perf_counter() - started
    finally:
        EMA.update = ema_update
    events = prof.events()
    ranges = {}
    for event in events:
        if event.name in RANGES:
            ranges.setdefault(event.name, []).append((event.time_range.start, event.time_range.end))

    def inside(event) -> str | None:
        start = event.time_range.start
        for name in ("dit_accel.ema_update", "dit_accel.optimizer_step"):  # the innermost first
            if any(low <= start <= high for low, high in ranges.get(name, [])):
                return name
        return None

    leaves = []
    if device == "cuda":
        for event in events:
            for kernel in getattr(event, "kernels", []):
                leaves.append((kernel.name, kernel.duration / 1e6, inside(event)))
    else:  # every operator's own time (without its children's): together, the whole CPU time
        for event in events:
            if event.name not in RANGES:
                leaves.append((event.name, event.self_cpu_time_total / 1e6, inside(event)))
    images = decision.micro_batch * parts.grad_accum
    summary = summarise(leaves, wall_s, device, image_step_flops(spec, decision) * images, steps)
    summary.update(
        plan=str(plan_path), model=spec.name, micro_batch=decision.micro_batch, compiled=compile_blocks
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "profile.md").write_text(markdown(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    summary = profile(args.plan, Path(args.out), args.warmup, args.steps, not args.no_compile)
    sys.stdout.write(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
