"""`make_plan(...)`: every input in, the plan.json object (schema "dit-plan/1", read back by planner.planfile) out.

This is the one entry point other code uses (the CLI, the trainer's and doctor's tests):

    from planner.plan import make_plan
    plan = make_plan(gpus=8, vram="40G", global_batch=256)                       # DiT-XL/2 @ 256
    plan = make_plan(gpus=2, vram="8G", global_batch=8, model="DiT-S/2", depth=2, hidden=32, heads=2,
                     resolution=64, num_classes=4)                                # a tiny test network

Sizes are strings with units ("40G", "40GiB") or ints in bytes. Raises PlanError (one line, with the fix)
for bad or contradictory input and when nothing fits.
"""

from __future__ import annotations

import dataclasses
import math

from planner.activations import element_bytes, saved_activation_bytes
from planner.calibration import apply_calibration, check_calibration, load_calibration
from planner.components import COMPONENTS
from planner.decision import Cluster
from planner.errors import PlanError
from planner.hardware import Assumptions, gpu_preset
from planner.host import DATA_SOURCES, host_estimate
from planner.planfile import SCHEMA
from planner.repa import DEFAULT_PROJECTOR_DIM, encoder_spec
from planner.rules import OBJECTIVES, PRECISIONS, SHARDING_MODES
from planner.search import (
    SearchSpace,
    alternatives,
    check_global_batch,
    choose,
    comm_bytes_per_gpu,
    communication_warning,
    memory_bandwidth,
    nearest_valid_global_batches,
)
from planner.spec import OPTIONS, model_spec
from planner.units import UNIT_RULE, format_bytes, parse_bytes, parse_headroom

DEFAULT_MAIN_PROCESS_PORT = 29500
FAMILY_OBJECTIVE = {"dit": "ddpm", "lightningdit": "flow"}  # --objective when not given


def _positive_int(value, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{flag} must be a positive whole number, got {value!r}")
    return value


def _bytes(value, flag: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise PlanError(f"{flag} must be a positive size, got {value}")
        return value
    return parse_bytes(value, flag)


PLAN_PRECISIONS = ("bf16", "fp16", "tf32", "fp32")  # what --precision takes besides auto


def resolve_precision(precision: str, gpu) -> str:
    """auto: bf16 where the GPU has it (or is unknown), else fp16 with loss scaling. tf32 is fp32 storage
    with TF32 matmuls: plan.json says precision fp32 and matmul tf32 (`resolve_matmul`)."""
    if precision == "auto":
        return "bf16" if gpu is None or gpu.bf16 else "fp16"
    if precision == "tf32":
        return "fp32"
    if precision not in PRECISIONS:
        raise PlanError(f"--precision must be auto, {', '.join(PLAN_PRECISIONS)}, got {precision!r}")
    if gpu is not None and precision == "bf16" and not gpu.bf16:
        raise PlanError(
            f"--precision bf16: {gpu.name} has no bf16 tensor cores", "use --precision fp16 (or auto)"
        )
    return precision


def resolve_matmul(precision: str, gpu) -> str:
    """The rate the DiT's matmuls are estimated at: bf16/fp16 tensor cores; tf32 (fp32 storage, TF32 matmuls,
    what `dit-accel train` does with an fp32 plan by default); fp32 -> ieee-fp32 (the trainer's --no-tf32).
    A GPU without TF32 (V100) runs tf32 as IEEE fp32."""
    if precision in ("bf16", "fp16"):
        return precision
    if precision == "fp32":
        return "ieee-fp32"
    if precision == "tf32":
        return "tf32" if gpu is None or gpu.peak_flops.get("tf32") else "ieee-fp32"
    return "bf16" if gpu is None or gpu.bf16 else "fp16"  # auto


def _positive_number(value, flag: str, whole: bool = False) -> float:
    """A finite number > 0 (a whole one with `whole`): steps, epochs, dataset size, a price."""
    if isinstance(value, bool):
        raise PlanError(f"{flag} must be a positive number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{flag} must be a positive number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise PlanError(f"{flag} must be a positive finite number, got {value!r}")
    if whole:
        if (
            isinstance(value, float)
            and not value.is_integer()
            or isinstance(value, str)
            and not value.strip().isdigit()
        ):
            raise PlanError(f"{flag} must be a positive whole number, got {value!r}")
        return int(number)
    return number


def train_steps(global_batch: int, steps=None, epochs=None, dataset_size=None) -> int | None:
    """Optimizer steps of the run: --steps N, or ceil(epochs x dataset size / global batch); None if not
    asked."""
    if steps is not None and epochs is not None:
        raise PlanError("give --steps or --epochs with --dataset-size, not both")
    if steps is not None:
        if dataset_size is not None:
            raise PlanError("--dataset-size goes with --epochs: drop it, or give --epochs instead of --steps")
        return _positive_number(steps, "--steps", whole=True)
    if epochs is None and dataset_size is None:
        return None
    if epochs is None or dataset_size is None:
        raise PlanError("--epochs and --dataset-size go together: give both (or --steps N)")
    epochs = _positive_number(epochs, "--epochs")
    size = _positive_number(dataset_size, "--dataset-size", whole=True)
    return math.ceil(epochs * size / global_batch)


EVAL_DEFAULTS = {"samples": 10_000, "steps": 250, "cfg_scale": 1.0}  # the trainer's --eval-* defaults


def evaluation_time(
    steps: int | None,
    every,
    samples,
    sample_steps,
    cfg_scale,
    objective: str,
    spec,
    world_size: int,
    throughput,
) -> dict | None:
    """The sampling time of the trainer's --eval-every evaluations (dit_accel.train.evaluation), None without it.

    One evaluation samples `samples` images over every GPU; each image costs `sample_steps` x model calls per
    step (1 for DDPM, 2 for a flow model's Heun ODE) x 2 with guidance (cfg scale not 1: the conditional and
    the unconditional half) forwards of spec.fwd_flops_per_image, at the DiT's matmul rate of the plan
    (peak x MFU, its range from the MFU range; sampling batches are taken as saturating). There are
    floor(steps / every) evaluations (multiples of `every`, never step 0). The Inception (5.7 G multiply-adds
    an image) and the VAE decoder (of the order of its encoder's 136 G at 256 px) are left out: about 1% of
    250 DiT-XL/2 forwards of 118.6 G each."""
    if every is None:
        return None
    if steps is None:
        raise PlanError("--eval-every adds its sampling time to the time to train: give --steps N too")
    every = _positive_number(every, "--eval-every", whole=True)
    samples = _positive_number(samples, "--eval-samples", whole=True)
    sample_steps = _positive_number(sample_steps, "--eval-steps", whole=True)
    try:
        cfg_scale = float(cfg_scale)
    except (TypeError, ValueError):
        cfg_scale = math.nan
    if not (math.isfinite(cfg_scale) and cfg_scale >= 0):
        raise PlanError(f"--eval-cfg-scale must be a finite number >= 0, got {cfg_scale!r}", "pass 1 (none)")
    calls = 2 if objective == "flow" else 1
    guidance = 1 if cfg_scale == 1.0 else 2
    image_flops = sample_steps * calls * guidance * spec.fwd_flops_per_image
    evaluations = steps // every
    rate = world_size * throughput.peak_flops_per_gpu  # FLOP/s of the cluster at 100% MFU
    point, low, high = (
        evaluations * samples * image_flops / (rate * mfu)
        for mfu in (throughput.assumed_mfu, throughput.mfu_high, throughput.mfu_low)
    )
    return {
        "every": every,
        "samples": samples,
        "steps": sample_steps,
        "cfg_scale": cfg_scale,
        "model_calls_per_step": calls,
        "guidance_factor": guidance,
        "sample_flops_per_image": image_flops,
        "evaluations": evaluations,
        "time_s": point,
        "time_s_low": low,
        "time_s_high": high,
    }


def time_to_train(
    steps: int | None, global_batch: int, world_size: int, throughput, price, evaluation: dict | None = None
) -> dict:
    """Wall-clock time, GPU-hours and cost of `steps` optimizer steps at the estimate and its range, with the
    sampling time of `evaluation` (`evaluation_time`) added when there is one."""
    if steps is None:
        return {"train_steps": None, "time_to_train_s": None, "gpu_hours": None, "cost": None}
    images = steps * global_batch
    extra = (
        (evaluation["time_s"], evaluation["time_s_low"], evaluation["time_s_high"])
        if evaluation
        else (0, 0, 0)
    )
    point, low, high = (
        images / throughput.images_per_s + extra[0],
        images / throughput.images_per_s_high + extra[1],  # the fast end of the range gives the short time
        images / throughput.images_per_s_low + extra[2],
    )
    hours = [t * world_size / 3600 for t in (point, low, high)]
    out = {
        "train_steps": steps,
        "time_to_train_s": point,
        "time_to_train_s_low": low,
        "time_to_train_s_high": high,
        "gpu_hours": hours[0],
        "gpu_hours_low": hours[1],
        "gpu_hours_high": hours[2],
        "cost": None,
    }
    if price is not None:
        out.update(cost=hours[0] * price, cost_low=hours[1] * price, cost_high=hours[2] * price)
    return out


def _checkpointing(value) -> str | int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("auto", "none", "all"):
        return text
    if text.isdigit():
        return int(text)
    raise PlanError(f"--checkpointing must be auto, none, all or a number of blocks, got {value!r}")


def _assumptions(value) -> Assumptions:
    if value is None:
        return Assumptions()
    if isinstance(value, Assumptions):
        value.validate()
        return value
    return Assumptions().replace(**dict(value))


def make_plan(
    gpus: int = 8,
    global_batch: int = 256,
    *,
    vram=None,
    gpu: str | None = None,
    nodes: int = 1,
    model: str = "DiT-XL/2",
    resolution: int = 256,
    precision: str = "auto",
    latents: str = "precomputed",
    ema: bool = True,
    sharding: str = "auto",
    checkpointing="auto",
    headroom="5%",
    max_micro_batch: int | None = None,
    host_ram=None,
    round_global_batch: bool = False,
    adamw: str = "fused",
    gradient_as_bucket_view: bool = True,
    compile: bool = True,
    depth: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    patch: int | None = None,
    num_classes: int | None = None,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
    assumptions=None,
    calibration=None,
    steps=None,
    epochs=None,
    dataset_size=None,
    gpu_hour_cost=None,
    repa: str = "",
    repa_projector_dim: int = DEFAULT_PROJECTOR_DIM,
    objective: str | None = None,
    data_source: str = "folder",
    eval_every=None,
    eval_samples=EVAL_DEFAULTS["samples"],
    eval_steps=EVAL_DEFAULTS["steps"],
    eval_cfg_scale=EVAL_DEFAULTS["cfg_scale"],
    model_options: dict | None = None,
    recipe: str | None = None,
    target_fid=None,
    target_guidance: str = "guided",
) -> dict:
    """The plan for training `model` on `nodes` x `gpus` GPUs (see the module docstring).

    `assumptions`: overrides of assumed constants (a dict, or an `Assumptions`). `calibration`: a file written
    by `dit-accel calibrate` (path) or its parsed dict; its measured figures replace the assumed ones where
    they apply to this plan (planner/calibration.py), and `assumptions` still override them. `steps` (or
    `epochs` with `dataset_size`) adds the time to train, GPU-hours and, with `gpu_hour_cost`, the cost;
    `eval_every` (with `eval_samples`, `eval_steps`, `eval_cfg_scale`) the trainer's evaluations' sampling.
    `recipe` ("" or "auto": the one the flags imply) or `target_fid` adds `forecast`: the published FID
    milestones at this plan's hours (planner.forecast).
    """
    inputs = {k: v for k, v in locals().items() if k not in ("assumptions", "calibration")}  # as given
    inputs["assumptions"] = dict(assumptions) if isinstance(assumptions, dict) else None
    inputs["calibration"] = (
        str(calibration) if calibration is not None and not isinstance(calibration, dict) else None
    )

    gpus_per_node = _positive_int(gpus, "--gpus")
    nodes = _positive_int(nodes, "--nodes")
    global_batch = _positive_int(global_batch, "--global-batch")
    resolution = _positive_int(resolution, "--resolution")
    if max_micro_batch is not None:
        _positive_int(max_micro_batch, "--max-micro-batch")
    if adamw not in ("foreach", "fused"):
        raise PlanError(f"--adamw must be foreach or fused, got {adamw!r}")
    if data_source not in DATA_SOURCES:
        raise PlanError(f"--data-source must be {' or '.join(DATA_SOURCES)}, got {data_source!r}")
    if objective is not None and objective not in OBJECTIVES:
        raise PlanError(f"--objective must be {' or '.join(OBJECTIVES)}, got {objective!r}")
    if main_process_ip and nodes == 1:
        raise PlanError("--main-process-ip only matters with --nodes 2 or more: drop it, or give --nodes")
    if main_process_port is not None and not 0 < int(main_process_port) < 65536:
        raise PlanError(f"--main-process-port must be a TCP port 1..65535, got {main_process_port}")
    assumed = _assumptions(assumptions)

    preset = gpu_preset(gpu) if gpu else None
    if vram is None and preset is None:
        raise PlanError("give the GPU memory: --vram 40GB (or 40GiB), or a preset with --gpu a100-40g")
    vram_bytes = _bytes(vram, "--vram") if vram is not None else preset.memory_bytes
    if preset is not None and vram_bytes > preset.memory_bytes:
        raise PlanError(
            f"--vram {format_bytes(vram_bytes)} is more than {preset.name}'s {format_bytes(preset.memory_bytes)}: "
            f"drop --vram, or choose the --gpu that has it"
        )
    headroom_bytes = parse_headroom(headroom, vram_bytes)
    budget_bytes = vram_bytes - headroom_bytes
    host_ram_bytes = _bytes(host_ram, "--host-ram") if host_ram is not None else None

    overrides = {"depth": depth, "hidden": hidden, "heads": heads, "patch": patch, "num_classes": num_classes}
    overrides.update(model_options or {})
    spec = model_spec(model, resolution, latents, **{k: v for k, v in overrides.items() if v is not None})
    objective = objective or FAMILY_OBJECTIVE[spec.family]
    if spec.family == "lightningdit" and objective != "flow":
        raise PlanError(f"{spec.name} predicts a velocity: plan it with --objective flow (its default)")
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node, vram_bytes=vram_bytes, gpu=preset)
    warnings = []

    world = cluster.world_size
    if global_batch % world and round_global_batch:
        below, above = nearest_valid_global_batches(global_batch, world)
        rounded = above if below is None or above - global_batch <= global_batch - below else below
        warnings.append(
            f"--global-batch {global_batch} rounded to {rounded}, the nearest multiple of {world} GPUs "
            f"(--round-global-batch); the learning rate is the recipe's, not rescaled"
        )
        global_batch = rounded
    check_global_batch(global_batch, world)

    resolved_precision = resolve_precision(precision, preset)
    matmul = resolve_matmul(precision, preset)
    steps = train_steps(global_batch, steps, epochs, dataset_size)
    price = _positive_number(gpu_hour_cost, "--gpu-hour-cost") if gpu_hour_cost is not None else None
    if price is not None and steps is None and recipe is None and target_fid is None:
        raise PlanError(
            "--gpu-hour-cost prices a run: give --steps N (or --epochs E --dataset-size S), --recipe or "
            "--target-fid too"
        )
    calibrated = None
    if calibration is not None:
        if isinstance(calibration, dict):
            data, source = check_calibration(calibration), None
        else:
            data, source = load_calibration(calibration), str(calibration)
        base = assumptions if isinstance(assumptions, Assumptions) else Assumptions()
        base, calibrated, calibration_warnings = apply_calibration(
            data, source, base, spec, resolved_precision, preset.name if preset else None, vram_bytes
        )
        assumed = base.replace(**dict(assumptions)) if isinstance(assumptions, dict) else base
        warnings += calibration_warnings
    space = SearchSpace(
        global_batch=global_batch,
        precision=resolved_precision,
        latents=latents,
        ema=bool(ema),
        sharding=sharding,
        checkpointing=_checkpointing(checkpointing),
        max_micro_batch=max_micro_batch,
        adamw=adamw,
        gradient_as_bucket_view=bool(gradient_as_bucket_view),
        matmul=matmul,
        repa=_repa_encoder(repa, repa_projector_dim),
        repa_projector_dim=repa_projector_dim,
        compile=bool(compile),
    )
    best, path = choose(spec, space, cluster, assumed, budget_bytes)
    decision, memory, throughput = best.decision, best.memory, best.throughput
    others = alternatives(spec, space, cluster, assumed, budget_bytes, decision)
    rows = int(dataset_size) if dataset_size is not None else None
    host, host_warnings = host_estimate(spec, decision, cluster, assumed, host_ram_bytes, data_source, rows)
    warnings += host_warnings
    warnings += _advice(
        spec, decision, cluster, preset, precision, main_process_ip, others, throughput, assumed
    )
    evaluation = evaluation_time(
        steps, eval_every, eval_samples, eval_steps, eval_cfg_scale, objective, spec, world, throughput
    )
    training = time_to_train(steps, global_batch, world, throughput, price, evaluation)

    def timed(candidate) -> dict:  # the same evaluations: their time does not depend on the choice
        t = time_to_train(steps, global_batch, world, candidate.throughput, price, evaluation)
        return {key: t[key] for key in ("time_to_train_s", "gpu_hours", "cost")}

    return {
        "schema": SCHEMA,
        "inputs": inputs,
        "units": UNIT_RULE,
        "model": {
            "name": spec.name,
            "resolution": spec.resolution,
            "latent_size": spec.latent_size,
            "in_channels": spec.in_channels,
            "out_channels": spec.out_channels,
            "tokens": spec.tokens,
            "depth": spec.depth,
            "hidden": spec.hidden,
            "heads": spec.heads,
            "patch": spec.patch,
            "num_classes": spec.num_classes,
            "family": spec.family,
            "tokenizer": spec.tokenizer,
            **({key: getattr(spec, key) for key in OPTIONS} if spec.family != "dit" else {}),
            "params_trainable": spec.params_trainable,
            "fwd_flops_per_image": spec.fwd_flops_per_image,
        },
        "cluster": {
            "nodes": nodes,
            "gpus_per_node": gpus_per_node,
            "world_size": world,
            "vram_bytes": vram_bytes,
            "gpu": preset.name if preset else None,
            "gpu_description": preset.description if preset else None,
            "main_process_ip": main_process_ip,
            "main_process_port": int(main_process_port)
            if main_process_port is not None
            else DEFAULT_MAIN_PROCESS_PORT,
        },
        "global_batch": global_batch,
        "objective": objective,  # what the trainer trains (dit_accel.train.step.run_objective)
        "decision": {
            **dataclasses.asdict(decision),
            "matmul": matmul,  # bf16 | fp16 | tf32 | ieee-fp32 (--precision fp32: the trainer's --no-tf32)
            "mixed_precision": PRECISIONS[decision.precision].accelerate_mixed_precision,
            "fsdp_sharding_strategy": SHARDING_MODES[decision.sharding].fsdp1_strategy,
            "sync_each_batch": decision.sharded,  # FSDP: reduce-scatter every micro-step, grads stay sharded
            # torch.compile per block on CUDA (dit_accel.models.compile); the memory model is the eager one, an upper
            # bound on the CPU measurements (docs/planner-accuracy.md, "Compiled blocks")
            "compile": bool(compile),
        },
        "memory": {
            **{name: memory.components[name] for name in COMPONENTS},
            "peak_bytes": memory.peak_bytes,  # reserved peak + overhead: what the budget holds
            "allocated_peak_bytes": memory.allocated_peak_bytes,  # the tensors (max_memory_allocated)
            "reserved_peak_bytes": memory.reserved_peak_bytes,  # the caching allocator (max_memory_reserved)
            # the least it runs in, the allocator releasing its cache under pressure: what must fit the budget
            "needed_bytes": memory.needed_bytes,
            "allocator_segments": assumed.allocator_segments,
            "budget_bytes": budget_bytes,
            "vram_bytes": vram_bytes,
            "headroom_bytes": headroom_bytes,
            "peak_phase": memory.peak_phase,
            "phases": {
                phase: dict(parts, total_bytes=sum(parts.values())) for phase, parts in memory.phases.items()
            },
            "activation_breakdown": activation_breakdown(spec, decision, assumed),
        },
        "throughput": {
            "step_flops": throughput.step_flops,
            "est_images_per_s": throughput.images_per_s,
            "est_images_per_s_low": throughput.images_per_s_low,
            "est_images_per_s_high": throughput.images_per_s_high,
            "assumed_mfu": throughput.assumed_mfu,
            "mfu_low": throughput.mfu_low,
            "mfu_high": throughput.mfu_high,
            "mfu_source": throughput.mfu_source,
            "matmul": throughput.matmul,
            "step_time_s": throughput.step_time_s,
            "compute_time_s": throughput.compute_time_s,
            "exposed_comm_time_s": throughput.exposed_comm_time_s,
            "fixed_time_s": throughput.fixed_time_s,
            "vae_time_s": throughput.vae_time_s,
            "small_batch_efficiency": throughput.efficiency,
            "peak_flops_per_gpu": throughput.peak_flops_per_gpu,
            "comm_bytes_per_gpu": comm_bytes_per_gpu(spec, decision, cluster),
            "memory_bandwidth_bytes_per_s": memory_bandwidth(cluster, assumed),
            **training,
            "evaluation": evaluation,  # --eval-every's sampling, included in time_to_train_s (null: none)
            "gpu_hour_cost": price,
        },
        "host": host,
        "alternatives": [
            {
                **dataclasses.asdict(c.decision),
                "peak_bytes": c.memory.peak_bytes,
                "needed_bytes": c.memory.needed_bytes,
                "est_images_per_s": c.throughput.images_per_s,
                "est_images_per_s_low": c.throughput.images_per_s_low,
                "est_images_per_s_high": c.throughput.images_per_s_high,
                **timed(c),
            }
            for c in others
        ],
        "search": {
            "rule": "furthest point that fits on a fixed path from the leanest configuration; each step takes the move "
            "(larger micro-batch | one checkpointed block fewer | less sharding) with the most img/s per "
            "byte, never one estimated slower (less sharding: more than 5% slower)",
            "path": [
                [
                    c.decision.sharding,
                    c.decision.micro_batch,
                    c.decision.checkpointed_blocks,
                    c.memory.peak_bytes,
                    round(c.throughput.images_per_s, 2),
                ]
                for c in path
            ],
        },
        "assumptions": dataclasses.asdict(assumed),
        "calibration": calibrated,  # null, or the file, GPU and date of the measured figures used
        "warnings": warnings,
        "forecast": plan_forecast(
            spec, objective, repa, global_batch, world, throughput, price, recipe, target_fid, target_guidance
        ),
    }


def plan_forecast(
    spec, objective, repa, global_batch, world, throughput, price, recipe, target_fid, guidance
):
    """`forecast.forecast` for this plan, or None when neither --recipe nor --target-fid asked for one."""
    from planner.forecast import forecast, implied_method, method_of

    if recipe is None and target_fid is None:
        return None
    method = (
        implied_method(spec.family, objective, repa) if recipe in (None, "", "auto") else method_of(recipe)
    )
    return forecast(
        model=spec.name,
        tokenizer=spec.tokenizer,
        resolution=spec.resolution,
        method=method,
        global_batch=global_batch,
        world_size=world,
        rates=(throughput.images_per_s, throughput.images_per_s_low, throughput.images_per_s_high),
        price=price,
        target_fid=None if target_fid is None else _positive_number(target_fid, "--target-fid"),
        guidance=guidance,
    )


def _repa_encoder(name: str, projector_dim: int) -> str:
    """--repa's encoder, checked: a known one. With a latent cache the trainer reads each latent's source
    image beside it (dit_accel.data.cache_images), which the host estimate counts."""
    if not name:
        return ""
    encoder_spec(name)
    if not isinstance(projector_dim, int) or projector_dim <= 0:
        raise PlanError(f"--repa-projector-dim must be a positive integer, got {projector_dim!r}")
    return name


def activation_breakdown(spec, decision, assumed: Assumptions) -> dict:
    """The activation and backward terms of the memory model, for plan.md's arithmetic and checks against traces."""
    from planner import activations
    from planner.components import backward_start, casts_weights, loss_tensors

    eb = element_bytes(decision.precision, assumed.autocast_device, pure=decision.sharded)
    b, c = decision.micro_batch, decision.checkpointed_blocks
    block = sum(activations.block_saved_bytes(spec, b, eb, assumed.attention).values())
    return {
        "autocast_device": assumed.autocast_device,
        # sharded plans: FSDP2's bf16/fp16 parameters and no autocast, every op in the compute dtype
        "pure_low_precision": decision.sharded and decision.precision != "fp32",
        "attention": assumed.attention,
        "stored_blocks": spec.depth - c,
        "stored_block_bytes": block,
        "bytes_per_token_hidden_block": block / (b * spec.tokens * spec.hidden),
        "checkpointed_blocks": c,
        "checkpointed_block_bytes": activations.checkpointed_block_saved_bytes(spec, b, eb),
        "head_and_tail_bytes": activations.head_and_tail_saved_bytes(spec, b, eb),
        "saved_bytes": saved_activation_bytes(spec, b, eb, c, assumed.attention),
        "loss_bytes": activations.loss_saved_bytes(spec, b, loss_tensors(spec, assumed)),
        "recompute_bytes": activations.recompute_bytes(spec, b, eb, assumed.attention) if c else 0,
        "checkpointed_forward_bytes": activations.checkpointed_forward_working_bytes(
            spec, b, eb, casts_weights(decision)
        )
        if c
        else 0,
        "backward_temporary_bytes": activations.backward_temporary_bytes(spec, b, eb),
        "backward_starts_in": backward_start(spec, decision, assumed).where,  # "last block" | "final layer"
    }


def _advice(
    spec, decision, cluster, preset, asked_precision, main_process_ip, others, throughput, assumed
) -> list[str]:
    notes = []
    if preset is None:
        notes.append(
            "throughput assumes an A100-class peak (312 TFLOP/s bf16) because only --vram was given: "
            "pass --gpu for the real rates"
        )
        if asked_precision == "auto":
            notes.append(
                "--precision auto chose bf16 assuming a GPU with bf16 (Ampere or newer); "
                "for V100 or T4 pass --precision fp16 or --gpu"
            )
    if cluster.nodes > 1 and not main_process_ip:
        notes.append(
            "no --main-process-ip: the SLURM script takes the first node's address; with another launcher "
            "pass --main_process_ip to every `accelerate launch`"
        )
    if decision.precision == "fp16":
        notes.append(
            "fp16 trains with dynamic loss scaling (Accelerate's GradScaler); bf16 needs none where available"
        )
    if decision.latents == "online":
        notes.append(
            "--latents online runs the VAE encoder on every image of every step; precomputed latents "
            "(dit-accel extract-latents) save its compute and memory"
        )
    if decision.sharded:
        notes.append(
            f"{decision.sharding} shards with FSDP2 (the layout FSDP1 called "
            f"{SHARDING_MODES[decision.sharding].fsdp1_strategy}): the shared embedder "
            f"must sit in the root FSDP unit, and grads are reduce-scattered every micro-step (sync_each_batch)"
        )
    communication = communication_warning(spec, decision, cluster, assumed, throughput)
    if communication:
        notes.append(communication)
    # TF32 is a GPU's: a plan made by --vram alone may be the CPU tour's, where the advice cannot apply
    if decision.precision == "fp32" and throughput.matmul == "ieee-fp32" and preset is not None:
        notes.append(
            "--precision fp32 plans IEEE fp32 matmuls: train with --no-tf32 (dit-accel train turns TF32 on "
            "by default and then runs faster than planned); --precision tf32 plans the TF32 rate"
        )
    faster = [c for c in others if c.throughput.images_per_s > throughput.images_per_s * 1.03]
    if faster:
        f = faster[0].decision
        notes.append(
            f"an off-path choice estimates {faster[0].throughput.images_per_s / throughput.images_per_s - 1:.0%} "
            f"faster ({f.sharding}, micro-batch {f.micro_batch}, {f.checkpointed_blocks} checkpointed) and "
            f"fits; "
            f"it was not taken because the search keeps to one budget-free path (more memory never gives a "
            f'smaller micro-batch, more checkpointing or more sharding: docs/planner.md, "The search rule")'
            + (", and prefers replicas within 5%" if f.sharded and not decision.sharded else "")
            + ": pin it with --sharding/--checkpointing/--max-micro-batch if you trust the throughput model"
        )
    return notes
