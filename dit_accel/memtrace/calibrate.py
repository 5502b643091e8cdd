"""`dit-accel calibrate`: measure the planned step on the real GPU and write what the planner assumed.

The planner assumes a CUDA context size, the caching allocator's fragmentation and an MFU. Here real steps
of the plan's configuration (the trainer's own step, random data) run at a few micro-batches; the peak
allocated bytes are fitted as fixed + per_sample x micro_batch (least squares), the largest micro-batch
that really fits is found by bisection up to an out-of-memory error (recovered from, not fatal), and the
result is a calibration file that `dit-plan --calibration FILE` reads in place of its assumptions.

It measures under the trainer's allocator (expandable segments, `dit_accel.distributed.accelerator`), or under the
user's own PYTORCH_CUDA_ALLOC_CONF, and records which. The file is rewritten (atomically) after every
micro-batch, so a run stopped part-way keeps what it measured: `"complete": false` until the search ends, and
without the fitted `assumptions` (which the planner then refuses) until the requested micro-batches are done.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dit_accel.atomic import write_json_atomically
from dit_accel.cli_args import OneLineParser, positive_int
from dit_accel.errors import UserError, exits_cleanly
from planner.planfile import Plan, read_plan
from planner.units import parse_bytes

SCHEMA = "dit-calibration/1"


@dataclass
class Measurement:
    """One micro-batch measured on the GPU (bytes from torch.cuda's allocator statistics)."""

    micro_batch: int
    max_allocated_bytes: int
    max_reserved_bytes: int
    step_seconds: float  # one optimizer step (grad_accum micro-steps), median of the timed steps
    device_used_bytes: int = (
        0  # total - free from cudaMemGetInfo at the peak: allocator + context + workspaces
    )
    grad_accum: int = 1
    # the caching allocator's release-and-retry and its out-of-memory errors during the point (memory_stats'
    # num_alloc_retries, num_ooms): ooms > 0 on a point that ran means a library caught one and went on (cuDNN
    # takes an engine with a smaller workspace)
    alloc_retries: int = 0
    caught_ooms: int = 0

    @property
    def images_per_s(self) -> float:
        """Per GPU: the micro-batches of one optimizer step over its duration."""
        return self.micro_batch * self.grad_accum / self.step_seconds if self.step_seconds > 0 else 0.0


class MeasureOOM(Exception):
    """A micro-batch did not fit. `measure` functions raise it (calibrate maps torch's OOM onto it)."""


# Out of memory as CUDA libraries report it outside the caching allocator's own OutOfMemoryError: cuBLAS
# or cuDNN failing to allocate a workspace or handle, or a raw CUDA allocation error (torch.AcceleratorError).
OUT_OF_MEMORY_MESSAGES = (
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a step's error means the micro-batch did not fit (not that the step is broken)."""
    import torch

    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_MESSAGES)


# ---------------------------------------------------------------------------------------------------
# Fitting and search: pure functions, tested on the CPU with recorded measurements
# ---------------------------------------------------------------------------------------------------


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope * x. Needs two distinct x."""
    if len(set(xs)) < 2:
        raise UserError(
            "fitting a per-sample slope needs at least two different micro-batches: pass e.g. --micro-batches 8,16,32"
        )
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    slope = sxy / sxx
    return mean_y - slope * mean_x, slope


def largest_fitting(
    measure: Callable[[int], Measurement],
    start: int,
    limit: int,
    known_fit: int = 0,
    known_oom: int | None = None,
    growth: float = 2.0,
    on_result: Callable[[int, Measurement | None], None] | None = None,
) -> tuple[int, int | None]:
    """The largest micro-batch in [1, limit] for which `measure` does not raise MeasureOOM.

    Grows from `start` by `growth` until an OOM (or `limit`), then bisects between the last fit and the
    first OOM. Memory grows with the micro-batch, so "fits" is monotone and bisection is exact. Returns
    (largest that fits, smallest that was seen to OOM or None). `on_result` sees every try.
    """

    def fits(micro_batch: int) -> bool:
        try:
            result = measure(micro_batch)
        except MeasureOOM:
            if on_result:
                on_result(micro_batch, None)
            return False
        if on_result:
            on_result(micro_batch, result)
        return True

    low, high = known_fit, known_oom
    candidate = max(start, low + 1)
    while high is None and candidate <= limit:
        if fits(candidate):
            low = candidate
            candidate = (
                min(max(candidate + 1, int(candidate * growth)), limit) if candidate < limit else limit + 1
            )
        else:
            high = candidate
    if high is None:
        return low, None
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, high


def fit_calibration(
    measurements: list[Measurement], step_flops_per_image: float, peak_flops: float | None, tokens: int
) -> dict:
    """Fixed and per-sample bytes, fragmentation, non-allocator bytes and throughput from measurements."""
    ok = sorted(measurements, key=lambda m: m.micro_batch)
    xs = [m.micro_batch for m in ok]
    fixed, per_sample = fit_line(xs, [m.max_allocated_bytes for m in ok])
    reserved_fixed, reserved_per_sample = fit_line(xs, [m.max_reserved_bytes for m in ok])
    residual = max(abs(m.max_allocated_bytes - (fixed + per_sample * m.micro_batch)) for m in ok)
    largest = ok[-1]
    ratio = largest.max_reserved_bytes / largest.max_allocated_bytes
    outside = [m.device_used_bytes - m.max_reserved_bytes for m in ok if m.device_used_bytes]
    images_per_s = largest.images_per_s
    mfu = images_per_s * step_flops_per_image / peak_flops if peak_flops else None
    # Throughput model of the planner: rate = saturated x n / (n + half), n = micro_batch x tokens.
    # Two micro-batches give it exactly: 1/rate = (1 + half/n) / saturated is a line in 1/n.
    half_tokens = None
    if len(ok) >= 2:
        inv_n = [1.0 / (m.micro_batch * tokens) for m in ok]
        inv_rate = [1.0 / m.images_per_s for m in ok if m.images_per_s > 0]
        if len(inv_rate) == len(ok) and len(set(inv_n)) >= 2:
            intercept, slope = fit_line(inv_n, inv_rate)
            if intercept > 0 and slope >= 0:
                half_tokens = int(round(slope / intercept))
    return {
        "fixed_bytes": int(round(fixed)),
        "per_sample_bytes": int(round(per_sample)),
        "reserved_fixed_bytes": int(round(reserved_fixed)),
        "reserved_per_sample_bytes": int(round(reserved_per_sample)),
        "fit_residual_max_bytes": int(round(residual)),
        "fragmentation": ratio,  # reserved / allocated at the largest measured micro-batch
        "outside_allocator_bytes": int(max(outside)) if outside else None,  # CUDA context, NCCL
        "images_per_s": images_per_s,
        "mfu": mfu,
        "half_efficiency_tokens": half_tokens,
    }


def planner_mfu(
    spec,
    decision,
    preset,
    images_per_s: float,
    half_efficiency_tokens: int | None,
    matmul: str | None = None,
) -> float | None:
    """The MFU with which the planner's own model (its FLOP count, small-batch efficiency, VAE rate and fixed
    per-step cost) gives back the measured images/s for this decision on one GPU of this kind: what
    `dit-plan --calibration` must assume to predict what was measured (`planner.search.implied_mfu`, the
    model's inverse). At most 1.0, also where even that would be slower than measured."""
    if preset is None or images_per_s <= 0:
        return None
    from planner.decision import Cluster
    from planner.errors import PlanError
    from planner.hardware import Assumptions
    from planner.search import implied_mfu

    extra = {"half_efficiency_tokens": half_efficiency_tokens} if half_efficiency_tokens else {}
    cluster = Cluster(nodes=1, gpus_per_node=1, vram_bytes=preset.memory_bytes, gpu=preset)
    try:
        return min(1.0, implied_mfu(spec, decision, cluster, Assumptions(**extra), images_per_s, matmul))
    except PlanError:  # faster than the fixed per-step cost alone allows
        return 1.0


def planner_assumptions(fitted: dict, precision: str) -> dict:
    """The subset of planner.hardware.CALIBRATABLE this calibration measured, in the planner's units."""
    # the planner's fragmentation is reserved beyond allocated, a fraction it requires to be below 1
    out = {"fragmentation": min(0.99, max(0.0, fitted["fragmentation"] - 1.0))}
    if fitted["outside_allocator_bytes"] is not None:
        # device used less reserved: the context (cuBLAS workspaces are reserved memory, the planner's too)
        out["cuda_context_bytes"] = fitted["outside_allocator_bytes"]
    if fitted.get("planner_mfu"):
        out["mfu_fp32" if precision == "fp32" else "mfu_mixed"] = fitted["planner_mfu"]
    if fitted["half_efficiency_tokens"] is not None:
        out["half_efficiency_tokens"] = fitted["half_efficiency_tokens"]
    return out


# ---------------------------------------------------------------------------------------------------
# Measuring on the GPU
# ---------------------------------------------------------------------------------------------------


def cuda_measure(plan: Plan, spec, steps: int, warmup_steps: int = 1) -> Callable[[int], Measurement]:
    """A `measure(micro_batch)` that runs `warmup_steps` untimed, then `steps` timed optimizer steps of the
    trainer's step on the GPU."""
    import torch

    from dit_accel.memtrace import build_step_parts

    def measure(micro_batch: int) -> Measurement:
        parts, result, out_of_memory = None, None, False
        try:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_stats()
            parts = build_step_parts(plan, spec, plan.decision.checkpointed_blocks, micro_batch, "cuda")
            durations, device_used = [], 0
            for step in range(warmup_steps + steps):  # the first warm kernels, cache and clocks up
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(parts.grad_accum):
                    parts.micro_step()
                parts.optimizer_step()
                torch.cuda.synchronize()
                if step >= warmup_steps:
                    durations.append(time.perf_counter() - started)
                free, total = torch.cuda.mem_get_info()
                device_used = max(device_used, total - free)
            result = Measurement(
                micro_batch=micro_batch,
                max_allocated_bytes=torch.cuda.max_memory_allocated(),
                max_reserved_bytes=torch.cuda.max_memory_reserved(),
                step_seconds=statistics.median(durations),  # of an even count: the middle two's mean
                device_used_bytes=device_used,
                grad_accum=parts.grad_accum,
                **allocator_events(before, torch.cuda.memory_stats()),
            )
        except RuntimeError as error:  # torch.cuda.OutOfMemoryError, cuBLAS's, a raw CUDA one, or a real bug
            if not is_out_of_memory(error):
                raise
            out_of_memory = True  # leaving this block drops the traceback and the tensors its frames hold
        finally:
            parts = None
            gc.collect()
            torch.cuda.empty_cache()
        if out_of_memory:
            raise MeasureOOM(micro_batch)
        return result

    return measure


def allocator_events(before: dict, after: dict) -> dict:
    """The release-and-retries and out-of-memory errors between two `torch.cuda.memory_stats()` (cumulative
    counters, which resetting the peaks leaves alone)."""
    counters = {"alloc_retries": "num_alloc_retries", "caught_ooms": "num_ooms"}
    return {field: int(after.get(key, 0)) - int(before.get(key, 0)) for field, key in counters.items()}


# ---------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------


def _micro_batches(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UserError(
            f"--micro-batches takes comma-separated integers like 8,16,32, got {text!r}"
        ) from None
    if len(values) < 2 or values[0] < 1:
        raise UserError(
            f"--micro-batches needs at least two different positive sizes (e.g. 8,16,32), got {text!r}"
        )
    return values


def cap_allocator(torch, vram_bytes: int, total_bytes: int) -> int:
    """Cap the caching allocator at `vram_bytes` less the CUDA context (which a card of that size holds outside
    it too), so that a plan for a smaller card is measured under that card's memory pressure."""
    if vram_bytes >= total_bytes:
        raise UserError(
            f"--vram {vram_bytes / 2**30:.1f} GiB is not below this GPU's {total_bytes / 2**30:.1f} GiB",
            "leave --vram out to measure the whole card",
        )
    free, total = torch.cuda.mem_get_info()  # initialises CUDA: the context is what is missing from free
    capped = vram_bytes - (total - free)
    torch.cuda.set_per_process_memory_fraction(capped / total)
    print(
        f"allocator capped at {capped / 2**30:.2f} GiB: a {vram_bytes / 2**30:.1f} GiB card less the context"
    )
    return capped


def _gpu_facts(torch) -> dict:
    from planner.hardware import gpu_presets

    properties = torch.cuda.get_device_properties(0)
    name = properties.name
    preset = None
    lowered = name.lower().replace("nvidia ", "")
    for (
        candidate
    ) in gpu_presets().values():  # e.g. "NVIDIA H200" -> h200, "NVIDIA A100-SXM4-80GB" -> a100-80g
        labels = [candidate.name, *candidate.aliases]
        if any(label in lowered.replace(" ", "-") for label in labels):
            if preset is None or len(candidate.name) > len(preset.name):
                preset = candidate
    return {
        "name": name,
        "total_bytes": int(properties.total_memory),
        "capability": f"{properties.major}.{properties.minor}",
        "preset": preset.name if preset else None,
        "_preset": preset,
    }


def calibrate(
    plan: Plan,
    micro_batches: list[int],
    steps: int,
    max_micro_batch: int | None,
    measure: Callable[[int], Measurement],
    gpu: dict,
    log=print,
    probe: Callable[[int], Measurement] | None = None,
    allocator: dict | None = None,
    save: Callable[[dict], None] | None = None,
    warmup_steps: int = 1,
) -> dict:
    """Measure, fit and search; returns the calibration dict (see docs/planner-accuracy.md for the format).

    `measure` gives the fitted points; `probe` (default: `measure`) only has to tell fit from OOM in the
    search for the largest micro-batch, so it may time fewer steps. `save` gets the document as it stands
    after every micro-batch (`"complete": false` until the end), so a run stopped part-way keeps its points.
    """
    spec = plan.spec()
    decision = plan.decision
    matmul = plan.matmul
    measurements: dict[int, Measurement | None] = {}
    document = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
        "gpu": {key: value for key, value in gpu.items() if not key.startswith("_")},
        "software": _software(),
        "allocator": allocator or {},
        "model": {
            "name": spec.name,
            "resolution": spec.resolution,
            "depth": spec.depth,
            "hidden": spec.hidden,
            "heads": spec.heads,
            "patch": spec.patch,
            "params_trainable": spec.params_trainable,
        },
        "config": {
            "precision": decision.precision,
            "matmul": matmul,
            "checkpointed_blocks": decision.checkpointed_blocks,
            "latents": decision.latents,
            "ema": decision.ema,
            "grad_accum": decision.grad_accum,
            "steps": steps,
            "warmup_steps": warmup_steps,
        },
    }

    def fitted_points() -> list[Measurement]:  # the requested micro-batches only: probes time fewer steps
        return sorted(
            (m for mb, m in measurements.items() if m is not None and mb in micro_batches),
            key=lambda m: m.micro_batch,
        )

    def record(micro_batch: int, result: Measurement | None) -> None:
        measurements[micro_batch] = result
        if result is None:
            log(f"micro-batch {micro_batch}: out of memory")
        else:
            log(
                f"micro-batch {micro_batch}: allocated {result.max_allocated_bytes / 2**30:.2f} GiB, reserved "
                f"{result.max_reserved_bytes / 2**30:.2f} GiB, {result.images_per_s:.1f} img/s"
            )
        document["measurements"] = [dict(asdict(m), images_per_s=m.images_per_s) for m in fitted_points()]
        document["out_of_memory_micro_batches"] = sorted(mb for mb, m in measurements.items() if m is None)
        if "fit" in document:  # searching: the bounds found so far
            fits = [mb for mb, m in measurements.items() if m is not None]
            document["largest_micro_batch"] = max(fits)
            document["smallest_oom_micro_batch"] = min(
                (mb for mb, m in measurements.items() if m is None and mb > max(fits)), default=None
            )
        if save:
            save(document)

    first_oom = None
    for micro_batch in micro_batches:
        try:
            record(micro_batch, measure(micro_batch))
        except MeasureOOM:
            record(micro_batch, None)
            first_oom = micro_batch
            break
    points = fitted_points()
    if len(points) < 2:
        raise UserError(
            f"fewer than two of --micro-batches {','.join(map(str, micro_batches))} fit on this GPU: "
            f"pass smaller ones (e.g. 1,2,4)"
        )

    # The fit is final now: the search below only adds the largest micro-batch that fits.
    step_flops_per_image = 3 * spec.fwd_flops_per_image + (
        spec.fwd_flops_per_image * decision.checkpointed_blocks / spec.depth
    )
    preset = gpu.get("_preset")
    peak = preset.matmul_peak_flops(matmul) if preset else None
    fitted = fit_calibration(points, step_flops_per_image, peak, spec.tokens)
    largest_fitted = points[-1]
    fitted["planner_mfu"] = planner_mfu(
        spec,
        dataclasses.replace(
            decision, micro_batch=largest_fitted.micro_batch, grad_accum=largest_fitted.grad_accum
        ),
        preset,
        largest_fitted.images_per_s,
        fitted["half_efficiency_tokens"],
        matmul,
    )
    planned_micro_batch = decision.micro_batch
    document.update(
        fit=fitted,
        largest_micro_batch=largest_fitted.micro_batch,
        smallest_oom_micro_batch=first_oom,
        planned={
            "micro_batch": planned_micro_batch,
            "peak_bytes": plan.memory.peak_bytes if plan.memory else None,
            "measured_reserved_at_planned_bytes": int(
                fitted["reserved_fixed_bytes"] + fitted["reserved_per_sample_bytes"] * planned_micro_batch
            ),
        },
        assumptions=planner_assumptions(fitted, decision.precision),
    )
    if save:
        save(document)

    # Where the fitted line meets the GPU's memory: a good first guess for the search.
    known_fit = largest_fitted.micro_batch
    fixed, per_sample = fit_line([m.micro_batch for m in points], [m.max_reserved_bytes for m in points])
    guess = int((gpu["total_bytes"] - fixed) / per_sample) if per_sample > 0 else known_fit * 2
    limit = max_micro_batch or max(known_fit * 2, guess * 2)
    largest, smallest_oom = largest_fitting(
        probe or measure,
        start=max(known_fit + 1, min(guess, limit)),
        limit=limit,
        known_fit=known_fit,
        known_oom=first_oom,
        growth=1.25,
        on_result=record,
    )
    document.update(complete=True, largest_micro_batch=largest, smallest_oom_micro_batch=smallest_oom)
    if save:
        save(document)
    return document


def allocator_settings(env, torch) -> dict:
    """Measure under the trainer's caching allocator: expandable segments unless the user set
    PYTORCH_CUDA_ALLOC_CONF (`dit_accel.distributed.accelerator.use_expandable_segments`, the same rule). Reserved bytes
    and fragmentation describe the allocator they were measured under, so the file records it."""
    from dit_accel.distributed.accelerator import ALLOCATOR_ENV, use_expandable_segments

    set_here = use_expandable_segments(env)
    value = env[ALLOCATOR_ENV]
    return {
        "alloc_conf": value,  # PYTORCH_CUDA_ALLOC_CONF
        "expandable_segments": "expandable_segments:true" in value.replace(" ", "").lower(),
        "source": "set by calibrate, as the trainer sets it" if set_here else "the environment's",
        "before_cuda_init": not torch.cuda.is_initialized(),  # False: too late to take effect
    }


def _software() -> dict:
    import accelerate
    import diffusers
    import torch

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "diffusers": diffusers.__version__,
        "accelerate": accelerate.__version__,
    }


@exits_cleanly("dit-accel calibrate")
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="dit-accel calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan.json written by dit-plan")
    parser.add_argument(
        "--micro-batches", default="8,16,32", help="micro-batches to measure and fit (default 8,16,32)"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=3,
        help="timed optimizer steps per micro-batch, after the warm-up steps (default 3)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=positive_int,
        default=1,
        help="untimed optimizer steps before each micro-batch's timed ones (default 1): more settle a small "
        "micro-batch's point, whose first steps run slow",
    )
    parser.add_argument(
        "--max-micro-batch",
        type=positive_int,
        default=None,
        help="stop the search for the largest fit here (default: none: search until the GPU runs out)",
    )
    parser.add_argument(
        "--out", default="calibration.json", help="calibration file to write (default calibration.json)"
    )
    parser.add_argument(
        "--vram",
        default=None,
        help="measure as on a card of this size (e.g. 80G) on a larger one: the caching allocator is capped "
        "there (torch.cuda.set_per_process_memory_fraction), so it releases its cache and retries, and runs "
        "out of memory, where that card would (default: none: the card's own size)",
    )
    args = parser.parse_args(argv)
    vram_bytes = parse_bytes(args.vram) if args.vram is not None else None  # refused before CUDA starts
    import torch

    from dit_accel.distributed.accelerator import planned_tf32, set_tf32

    if not torch.cuda.is_available():  # asks for the device count: does not initialise CUDA
        raise UserError(
            "no CUDA GPU here: calibrate measures real steps on the GPU you will train on", "run it there"
        )
    allocator = allocator_settings(os.environ, torch)  # before the first CUDA allocation, as the trainer does
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    micro_batches = _micro_batches(args.micro_batches)
    plan = read_plan(args.plan)
    spec = plan.spec()
    gpu = _gpu_facts(torch)
    if vram_bytes is not None:
        gpu["capped_bytes"] = cap_allocator(torch, vram_bytes, gpu["total_bytes"])
    print(f"allocator: PYTORCH_CUDA_ALLOC_CONF={allocator['alloc_conf']} ({allocator['source']})")
    # TF32 as the trainer sets it for this plan: on (its default) unless the plan is rated at IEEE fp32,
    # which the trainer runs with --no-tf32; torch's own default (TF32 matmuls off) would time another step
    tf32 = set_tf32(planned_tf32(True, plan), torch.device("cuda"))
    print(f"TF32 matmuls and convolutions: {'on' if tf32 else 'off'} ({plan.matmul} plan)")
    out = Path(args.out)
    try:
        result = calibrate(
            plan,
            micro_batches,
            args.steps,
            args.max_micro_batch,
            cuda_measure(plan, spec, args.steps, args.warmup_steps),
            gpu,
            probe=cuda_measure(plan, spec, 1),
            allocator=allocator,
            save=lambda document: write_json_atomically(out, document),
            warmup_steps=args.warmup_steps,
        )
    except UserError:
        out.unlink(missing_ok=True)  # too few points to fit: nothing the planner could use is left behind
        raise
    fit = result["fit"]
    print(
        f"fixed {fit['fixed_bytes'] / 2**30:.2f} GiB + {fit['per_sample_bytes'] / 2**20:.1f} MiB per sample; "
        f"reserved/allocated {fit['fragmentation']:.3f}; largest micro-batch that fits: {result['largest_micro_batch']}; "
        f"{fit['images_per_s']:.1f} img/s" + (f", MFU {fit['mfu']:.1%}" if fit["mfu"] else "")
    )
    print(f"wrote {args.out}: use it with `dit-plan --calibration {args.out} ...`")
    return 0
