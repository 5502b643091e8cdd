"""The trainer's own step against a bare loop over the same model and loss, on this machine's CPU.

    python benchmarks/train_speed.py [--model DiT-S/2 --resolution 64 --micro-batch 8 --steps 5 --repeats 3]

The trainer: `build_components` (with an Accelerator, as the loop makes one), then per optimizer step
`train_micro_step` and `optimizer_step`, on a step that neither logs nor saves (`measure_grad_norm=False`)
and, for comparison, on one that does (the gradient norm measured, which every step paid before). The bare
loop: the same seeded network (`dit_accel.models.dit.build_model`), the same diffusion loss on the same batch,
`torch.optim.AdamW` and an EMA of `lerp_`s, with no accumulation context, vote or bookkeeping. Each repeat
runs the three in turn (after one warm-up step each; each repeat starts with the next one), so a slow
moment of a shared machine hits all three; the report gives each one's best and median step time, the
ratio of bests (the least disturbed figure on a shared machine), and the per-repeat ratio to the bare loop
with its run-to-run spread (min to max).
Figures go into docs/benchmarks.md with the machine (`lscpu`) and torch version.
One torch thread by default: on a shared machine more threads than free cores spin against each other and
the timings say more about the neighbours than about the step; the load average is recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from dit_accel.diffusion.objective import Diffusion
from dit_accel.models.dit import as_model_fn, build_model, null_class
from dit_accel.train.config import TrainConfig
from dit_accel.train.step import build_components, optimizer_step, train_micro_step
from planner.planfile import parse_plan


def make_plan(model: str, resolution: int, micro_batch: int):
    return parse_plan(
        {
            "schema": "dit-plan/1",
            "inputs": {},
            "cluster": {"world_size": 1},
            "global_batch": micro_batch,
            "model": {"name": model, "resolution": resolution},
            "decision": {
                "micro_batch": micro_batch,
                "grad_accum": 1,
                "checkpointed_blocks": 0,
                "precision": "fp32",
                "sharding": "ddp",
                "latents": "precomputed",
                "ema": True,
            },
        }
    )


def make_batch(spec, micro_batch: int, seed: int = 0) -> dict:
    """One micro-batch as the loader's Collate makes it."""
    generator = torch.Generator().manual_seed(seed)
    shape = (micro_batch, spec.in_channels, spec.latent_size, spec.latent_size)
    return {
        "x": torch.randn(shape, generator=generator),
        "y": torch.randint(0, spec.num_classes, (micro_batch,), generator=generator),
        "t": torch.randint(0, 1000, (micro_batch,), generator=generator),
        "noise": torch.randn(shape, generator=generator),
        "drop": torch.rand(micro_batch, generator=generator) < 0.1,
    }


class TrainerStep:
    """The trainer's step: what dit_accel.train runs for one optimizer step of grad_accum 1."""

    def __init__(self, plan, measure_grad_norm: bool):
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.components = build_components(
            plan, TrainConfig(plan="p", output_dir="o", latents="l"), self.accelerator
        )
        self.measure_grad_norm = measure_grad_norm

    def __call__(self, batch: dict) -> None:
        with self.accelerator.accumulate(self.components.model):
            loss = train_micro_step(self.components, batch)
        optimizer_step(self.components, loss, measure_grad_norm=self.measure_grad_norm)


class BareStep:
    """Forward, backward, AdamW, EMA: the same network, loss and update, nothing else."""

    def __init__(self, plan, decay: float = 0.9999):
        self.spec = plan.spec()
        torch.manual_seed(0)
        self.model = build_model(self.spec).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.0)
        self.ema = [p.detach().clone() for p in self.params]
        self.objective, self.decay = Diffusion.linear(), decay
        self.model_fn = as_model_fn(self.model)

    def __call__(self, batch: dict) -> None:
        labels = torch.where(batch["drop"], null_class(self.spec), batch["y"])
        terms = self.objective.training_losses(
            self.model_fn, batch["x"], labels, t=batch["t"], noise=batch["noise"]
        )
        terms["loss"].mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.params, 1.0 - self.decay)


def seconds_per_step(step, batch: dict, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step(batch)
    return (time.perf_counter() - started) / steps


def machine() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown"
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="DiT-S/2")
    parser.add_argument("--resolution", type=int, default=64, help="pixels; latents are 1/8 of it")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat and loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see above)")
    parser.add_argument("--json", dest="json_out", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    plan = make_plan(args.model, args.resolution, args.micro_batch)
    batch = make_batch(plan.spec(), args.micro_batch)
    loops = {
        "bare loop": BareStep(plan),
        "trainer, unlogged step": TrainerStep(plan, measure_grad_norm=False),
        "trainer, logged step (grad norm)": TrainerStep(plan, measure_grad_norm=True),
    }
    for step in loops.values():
        step(batch)  # warm-up: AdamW state, allocator, first-call costs
    times = {name: [] for name in loops}
    names = list(loops)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # each goes first in turn
            times[name].append(seconds_per_step(loops[name], batch, args.steps))

    bare = times["bare loop"]
    rows = {}
    for name, values in times.items():
        ratios = [value / base for value, base in zip(values, bare)]
        rows[name] = {
            "best_s_per_step": min(values),
            "ratio_of_bests": min(values) / min(bare),
            "median_s_per_step": statistics.median(values),
            "spread_s_per_step": [min(values), max(values)],
            "ratio_to_bare": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
    info = machine()  # the load average after the runs: the last minute of them
    print(
        f"{args.model} @{args.resolution} ({plan.spec().latent_size}x{plan.spec().latent_size} latents), "
        f"micro-batch {args.micro_batch}, fp32, {args.repeats} repeats x {args.steps} steps; {info['cpu']}, "
        f"{info['cores']} cores, {info['torch_threads']} torch thread(s), torch {info['torch']}, load average "
        f"{info['load_average_1min']}"
    )
    print(
        f"{'loop':34} {'s/step best':>11} {'best/bare':>9} {'s/step median':>13} {'min-max':>15} "
        f"{'median ratio':>12} {'ratio min-max':>13}"
    )
    for name, row in rows.items():
        low, high = row["spread_s_per_step"]
        rlow, rhigh = row["ratio_spread"]
        print(
            f"{name:34} {row['best_s_per_step']:11.4f} {row['ratio_of_bests']:9.3f} "
            f"{row['median_s_per_step']:13.4f} {f'{low:.3f}-{high:.3f}':>15} {row['ratio_to_bare']:12.3f} "
            f"{f'{rlow:.3f}-{rhigh:.3f}':>13}"
        )
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(
                {"args": vars(args), "machine": info, "loops": rows, "raw_s_per_step": times},
                handle,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
