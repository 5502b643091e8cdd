"""One training step of the DiT recipe, as the trainer runs it and `dit-accel verify` traces it.

`build_components` makes everything a step touches (model, EMA, AdamW, lr schedule, objective, VAE); then a
step is `grad_accum` calls of `train_micro_step` (forward and backward of one micro-batch) and one
`optimizer_step`: `check_step` (clip, and one all-reduce that agrees on whether the step is finite), the
decision, and `apply_step` (AdamW, lr schedule, EMA). `verify` runs these very functions on value-less fake
tensors, which is why none of them reads a tensor value except the decision between the two.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from dit_accel.distributed.accelerator import resolve_precision
from dit_accel.distributed.fsdp import full_tensor, shard_blocks, uses_fsdp
from dit_accel.errors import UserError
from dit_accel.train.config import TrainConfig
from dit_accel.train.ema import EMA
from dit_accel.train.flags import inherited_from
from dit_accel.train.optim import build_optimizer, build_scheduler, effective_lr
from dit_accel.train.resume import InitWeights, load_init_weights
from planner.planfile import Plan
from planner.rules import PRECISIONS


@dataclass
class Components:
    """Everything one training step touches. Built by `build_components`; the loop, the checkpointer and
    `dit-accel verify` (which traces this very step under FakeTensorMode) all use the same object."""

    spec: object  # planner.spec.DiTSpec
    plan: Plan
    config: TrainConfig
    model: nn.Module  # as prepared by accelerate (DDP-wrapped when distributed) or plain
    ema: EMA | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objective: (
        object  # --objective: dit_accel.diffusion.objective.Diffusion (DiT's mse + vb) or flow.FlowMatching
    )
    vae: nn.Module | None
    device: torch.device
    grad_accum: int
    accelerator: object | None = None  # accelerate.Accelerator, or None for a bare device
    autocast_dtype: torch.dtype | None = None  # bare device only: the dtype the step autocasts to
    latent_norm: object | None = None  # models.vae.LatentNorm: the data's (a cache's, or online the VAE's)
    repa: object | None = None  # dit_accel.repa.align.Repa (--repa-encoder): encoder, capture, coefficient
    fp8: dict | None = None  # --fp8: models.fp8's record (library, recipe, the linears converted)

    @property
    def raw_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def forward_context(self):
        """Autocast for a bare device; a prepared model already autocasts inside its forward."""
        if self.accelerator is None and self.autocast_dtype is not None:
            return torch.autocast(self.device.type, dtype=self.autocast_dtype)
        return contextlib.nullcontext()

    def sidecar(self) -> dict:
        """The model's `dit_accel.json` (spec, timestep shift) plus the objective, so that sample and export
        rebuild a flow model's objective without being told."""
        from dit_accel.diffusion.flow import objective_description
        from dit_accel.models.diffusers_format import sidecar

        record = dict(sidecar(self.raw_model), objective=objective_description(self.objective))
        if self.latent_norm is not None:  # how to decode what the model makes (sample, export)
            record["latent_norm"] = self.latent_norm.to_json()
        if self.fp8 is not None:  # how it was trained; what it holds is plain weights
            record["fp8"] = self.fp8
        return record

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)  # divides by grad_accum, scales for fp16
        else:
            (loss / self.grad_accum).backward()


def run_objective(plan: Plan, config: TrainConfig) -> str:
    """The run's objective: --objective, else the plan's (dit-plan --objective). A launch that contradicts
    the plan is refused, as a precision the plan did not size is: the plan's sizes and recipe are one."""
    chosen = config.objective or plan.objective
    record = inherited_from("objective")
    if chosen != plan.objective and record is not None:  # the run's own objective, not a flag typed now
        raise UserError(
            f"the run in {config.output_dir} trains {chosen} (its recorded settings {record} say so), but the "
            f"plan {config.plan} plans {plan.objective}",
            f"resume it under a plan made with `dit-plan --objective {chosen}`, or train {plan.objective} as a "
            "new run (another --output-dir)",
        )
    if chosen != plan.objective:
        raise UserError(
            f"--objective {chosen} contradicts the plan's objective {plan.objective} ({config.plan})",
            f"re-plan with `dit-plan --objective {chosen}`, or drop --objective",
        )
    if chosen == "ddpm" and (config.time_sampling, config.flow_path) != ("uniform", "linear"):
        raise UserError(
            "--time-sampling and --flow-path are the flow objective's, but this run trains ddpm (DiT's draws t "
            "uniformly)",
            "re-plan with `dit-plan --objective flow` and pass --objective flow, or drop them",
        )
    return chosen


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision (planner.rules.PRECISIONS); None for fp32."""
    name = PRECISIONS[precision].torch_dtype
    return getattr(torch, name) if name else None


def build_components(
    plan: Plan,
    config: TrainConfig,
    accelerator=None,
    device: torch.device | str | None = None,
    spec=None,
    precision: str | None = None,
    init: InitWeights | None = None,
    timestep_freq_shift: int | None = None,
    repa_encoder=None,
    latent_norm=None,
) -> Components:
    """Model, EMA, optimizer, lr schedule and objective, exactly as the plan says.

    The model is built on its device (`with device:`), seeded: no CPU copy to move over, and the same weights
    on every rank (each device type draws its own seeded stream: a CUDA run starts from other weights than a
    CPU run of the same seed). With an `accelerator`, the model and optimizer are prepared (DDP or FSDP2,
    mixed precision); the scheduler is NOT (see optim.py), nor registered for checkpointing (its state is JSON
    in each checkpoint: run.pickles). With one, the blocks are compiled when the run compiles (models.compile:
    --compile, or the plan's on CUDA), after checkpointing is set and before sharding and wrapping, as
    torchtitan orders them. Under FSDP the blocks are sharded here (`shard_blocks`) before the optimizer sees
    the parameters, and `prepare` adds the root unit; the EMA is then made of each rank's shards.

    Without one, everything lives on `device` and the step autocasts itself to `precision` (default: the
    plan's, resolved for the device, so fp16 on a CPU runs fp32): that is how `dit-accel verify` traces it,
    asking for the plan's own precision, and `spec` overrides the plan's network (a shallower copy for
    per-block extrapolation).

    The objective is --objective or the plan's (`run_objective`, which refuses a contradiction), written back
    into `config` so that the run records it.

    `init` (--init-from) replaces the seeded weights before anything else sees them, so the EMA starts equal to
    them and the optimizer state is fresh; the model then uses the init's timestep shift. `timestep_freq_shift`
    (a resumed run's, from its checkpoint) overrides it; the default is diffusers' (1).
    """
    from dit_accel.diffusion.flow import build_objective
    from dit_accel.models.compile import compile_for_run
    from dit_accel.models.dit import DIFFUSERS_FREQ_SHIFT, build_model, set_checkpointed_blocks
    from dit_accel.repa.training import build_for_run

    spec = spec or plan.spec()
    decision = plan.decision
    config.objective = run_objective(plan, config)  # resolved here, so the run records what it trains
    if init is not None and init.objective != config.objective:  # a flow model's output is a velocity
        raise UserError(
            f"--init-from {init.source} holds a {init.objective} model but this run trains {config.objective}",
            f"re-plan with `dit-plan --objective {init.objective}`, or start from a {config.objective} model",
        )
    if accelerator is not None and precision is not None:
        raise ValueError("precision is the Accelerator's (mixed_precision); pass it only for a bare device")
    device = torch.device(accelerator.device if accelerator is not None else (device or "cpu"))
    if timestep_freq_shift is None:
        timestep_freq_shift = init.timestep_freq_shift if init is not None else DIFFUSERS_FREQ_SHIFT
    torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    with device:
        model = build_model(spec, timestep_freq_shift=timestep_freq_shift)
    if init is not None:
        load_init_weights(model, init)  # on every rank, before sharding: each rank then keeps its shard
    # REPA: its projector joins the network, seeded (`repa_encoder`: a built one, for traces)
    repa = build_for_run(model, config, plan, spec, device, repa_encoder)
    set_checkpointed_blocks(model, decision.checkpointed_blocks)
    fp8 = None
    if config.fp8:  # the blocks' linears in FP8 (torchao), before compiling and sharding them
        from dit_accel.models.fp8 import use_float8

        fp8 = use_float8(model, device.type, decision.precision)
    if accelerator is not None:  # the trainer's step; verify traces the eager step on fake tensors
        compile_for_run(model, config.compile, plan.compile, device)  # after checkpointing, before FSDP/DDP
    model.train()
    if uses_fsdp(accelerator):
        shard_blocks(model, accelerator.state.fsdp_plugin)
    lr = effective_lr(config.lr, plan.global_batch, config.scale_lr)
    optimizer = build_optimizer(model, lr, config.betas, config.weight_decay, device, decision.adamw)
    scheduler = build_scheduler(optimizer, config.warmup_steps)
    autocast_dtype = None
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        if precision is None:
            precision = resolve_precision(decision.precision, device.type)
        elif precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        autocast_dtype = compute_dtype(precision)
    raw = accelerator.unwrap_model(model) if accelerator is not None else model
    ema = EMA(raw, config.ema_decay, warmup=config.ema_warmup) if decision.ema else None
    vae = None  # `latent_norm`: a latent cache's (the trainer passes its dataset's); online, the VAE's
    if decision.latents == "online":
        vae, latent_norm = load_vae(config.vae, device, config.latent_stats)
    return Components(
        spec=spec,
        plan=plan,
        config=config,
        model=model,
        ema=ema,
        optimizer=optimizer,
        scheduler=scheduler,
        objective=build_objective(
            config.objective, config.flow_path, config.time_sampling, config.cosine_loss_weight
        ),
        vae=vae,
        device=device,
        grad_accum=decision.grad_accum,
        accelerator=accelerator,
        autocast_dtype=autocast_dtype,
        latent_norm=latent_norm,
        repa=repa,
        fp8=fp8,
    )


def load_vae(path: str, device: torch.device, latent_stats: str | None = None):
    """A frozen diffusers AutoencoderKL for online encoding, in fp32 as DiT encodes; and its `LatentNorm`:
    the config's factors, or for a VA-VAE per-channel statistics (--latent-stats, else the VAE folder's)."""
    from dit_accel.models.vae import load_vae as load_frozen_vae
    from dit_accel.models.vae import online_latent_norm

    vae, identity = load_frozen_vae(path)
    vae.to(device)
    return vae, online_latent_norm(vae, identity, latent_stats)


# --- one micro-step and one optimizer step -----------------------------------------------------------------


@torch.no_grad()
def encode_online(
    components: Components, images: torch.Tensor, posterior_noise: torch.Tensor
) -> torch.Tensor:
    """Images in [-1, 1] -> scaled latents, the posterior drawn with each sample's own noise."""
    from dit_accel.models.vae import encode_posterior

    mean, std = encode_posterior(components.vae, images.to(components.device))
    return components.latent_norm.normalize(mean + std * posterior_noise.to(components.device))


def train_micro_step(components: Components, batch: dict) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns the (detached, fp32) mean loss of the micro-batch.

    Class dropout is applied here, once per sample, from the batch's per-sample draw (`batch["drop"]`).
    """
    from dit_accel.models.dit import as_model_fn, null_class
    from dit_accel.repa.training import encoder_targets

    device = components.device
    x0 = batch["x"].to(device, non_blocking=True)
    # REPA: the clean images' tokens, before the forward (a latent cache's batch carries its images)
    repa_targets = encoder_targets(components, batch.get("image", x0))
    if components.vae is not None:
        x0 = encode_online(components, x0, batch["posterior_noise"])
    labels = batch["y"].to(device, non_blocking=True)
    labels = torch.where(
        batch["drop"].to(device, non_blocking=True),
        torch.full_like(labels, null_class(components.spec)),
        labels,
    )
    t = batch["t"].to(device, non_blocking=True)
    noise = batch["noise"].to(device, non_blocking=True)
    model_fn = as_model_fn(components.model)
    with components.forward_context():
        terms = components.objective.training_losses(model_fn, x0, labels, t=t, noise=noise)
    loss = terms["loss"].float().mean()
    if repa_targets is not None:  # the objective's loss plus coeff x the alignment of block K's tokens
        loss = loss + components.repa.loss(repa_targets).mean()
    components.backward(loss)
    return loss.detach()


NON_FINITE = "non-finite"  # a NaN/Inf loss or gradient on some rank: the NaN policy decides
SCALER_OVERFLOW = "scaler-overflow"  # fp16's GradScaler skipped an overflowing step and lowered its scale


@dataclass
class StepResult:
    applied: bool
    loss: float  # mean over every sample of the global batch, all ranks
    grad_norm: float | None  # before clipping; None on a step that did not measure it (see check_step)
    lr: float  # the lr this step used
    skipped: str | None = None  # why the step was not applied: NON_FINITE or SCALER_OVERFLOW
    stop_ranks: int = 0  # how many ranks were asked to stop (a preemption signal) before this step's vote
    stop_signum: int = 0  # the signal that asked, as this rank knows it


@dataclass
class StepCheck:
    """What every rank knows after its last micro-step, as tensors: nothing here has been read yet."""

    grad_norm: torch.Tensor | None  # this rank's view of the global gradient norm, before clipping; None:
    #                                 not measured (clipping off and measure_grad_norm=False)
    loss_mean: torch.Tensor  # this rank's mean loss over its micro-steps
    bad: torch.Tensor  # this rank saw a non-finite loss (or measured gradient norm)
    stats: torch.Tensor  # over all ranks: [mean loss, ranks that saw a non-finite value, ranks asked to stop,
    #                      sum of their stop signals]

    def all_finite(self) -> bool:
        """The step's one decision made on a value (a device sync); the same on every rank."""
        return bool(self.stats[1].item() == 0)

    def read(self) -> list[float]:
        """`stats` and the gradient norm (NaN when not measured) in one device->host copy: the step's only
        sync, which the vote needs anyway."""
        norm = self.grad_norm if self.grad_norm is not None else torch.full_like(self.loss_mean, math.nan)
        return torch.cat([self.stats, norm.reshape(1).to(self.stats.dtype)]).tolist()


def _fp16_scaled(components: Components) -> bool:
    return components.accelerator is not None and components.accelerator.scaler is not None


def check_step(
    components: Components, loss_sum: torch.Tensor, stop_signum: int = 0, measure_grad_norm: bool = True
) -> StepCheck:
    """Clip the gradients and agree across ranks on whether the step is finite, without reading a value.

    `loss_sum` is this rank's sum of micro-step mean losses. With --grad-clip the gradient norm is measured
    and the gradients clipped on every step, and under --nan-policy skip measured on every step (a skipped
    step must never have been applied). Otherwise it is measured only when `measure_grad_norm` (the loop
    asks on logging and checkpoint steps): any other step reads no gradient here, and its vote covers the
    loss only (docs/training.md, "NaN and Inf", says what an unmeasured non-finite gradient does). One
    all-reduce carries the loss, the non-finite flag and whether this rank was asked to stop (`stop_signum`,
    from dit_accel.run.preemption): no collective of its own.
    """
    accelerator, model = components.accelerator, components.model
    clip = components.config.grad_clip
    grad_norm = None
    if clip is not None or measure_grad_norm or components.config.nan_policy == "skip":
        params = [p for p in model.parameters() if p.requires_grad]
        max_norm = clip if clip is not None else math.inf  # inf: measured, gradients left as they are
        if accelerator is not None:  # unscales fp16 first; FSDP2's DTensor gradients, mesh by mesh
            grad_norm = accelerator.clip_grad_norm_(params, max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        grad_norm = torch.as_tensor(full_tensor(grad_norm), device=components.device, dtype=torch.float32)
    loss_mean = loss_sum.float() / components.grad_accum
    # Under fp16 the grad scaler owns overflowing gradients (it skips and lowers its scale); a NaN loss is ours.
    bad = ~torch.isfinite(loss_mean)
    if grad_norm is not None and not _fp16_scaled(components):
        bad = bad | ~torch.isfinite(grad_norm)
    stopping = torch.full_like(loss_mean, float(stop_signum != 0))
    stats = torch.stack([loss_mean, bad.float(), stopping, torch.full_like(loss_mean, float(stop_signum))])
    if accelerator is not None and accelerator.num_processes > 1:
        stats = accelerator.reduce(stats, reduction="sum")
        stats[0] /= accelerator.num_processes
    return StepCheck(grad_norm=grad_norm, loss_mean=loss_mean, bad=bad, stats=stats)


def apply_step(components: Components) -> bool:
    """AdamW step, then the lr schedule and the EMA; then the gradients go. Reads no tensor value itself.

    Returns whether the step was applied: always, except under fp16 with Accelerate, whose GradScaler
    (reading its overflow flag) skips a step with overflowing gradients, and then so do the schedule and EMA.
    """
    components.optimizer.step()
    applied = not (_fp16_scaled(components) and components.accelerator.optimizer_step_was_skipped)
    if applied:
        components.scheduler.step()
        if components.ema is not None:
            components.ema.update(components.raw_model)
    components.optimizer.zero_grad(set_to_none=True)
    return applied


def optimizer_step(
    components: Components, loss_sum: torch.Tensor, stop_signum: int = 0, measure_grad_norm: bool = True
) -> StepResult:
    """After the last micro-step: clip and vote (`check_step`), then apply the step (`apply_step`) or not.

    Every rank takes the same decision; a skipped step changes no weight, optimizer moment, EMA or
    lr-schedule position. The tensor work is in the two functions, which `dit-accel verify` traces on
    value-less fake tensors. One device->host copy per step (`StepCheck.read`) carries the decision, the
    loss and the stop vote, and the gradient norm when measured: a step that some rank was asked to stop
    on is checkpointed, so its gradient is measured then (a second check, on that step only) if it was not.
    """
    check = check_step(components, loss_sum, stop_signum, measure_grad_norm)
    values = check.read()
    if check.grad_norm is None and values[2] > 0:  # every rank sees the same stop vote: all measure
        check = check_step(components, loss_sum, stop_signum, measure_grad_norm=True)
        values = check.read()
    loss, bad_ranks, stop_ranks, stop_signals, grad_norm = values
    lr = components.scheduler.get_last_lr()[0]
    if bad_ranks == 0:
        skipped = None if apply_step(components) else SCALER_OVERFLOW
    else:
        skipped = NON_FINITE
        components.optimizer.zero_grad(set_to_none=True)
    stop_ranks = round(stop_ranks)
    return StepResult(
        applied=skipped is None,
        loss=loss,
        grad_norm=grad_norm if check.grad_norm is not None else None,
        lr=lr,
        skipped=skipped,
        stop_ranks=stop_ranks,
        stop_signum=stop_signum or (round(stop_signals / stop_ranks) if stop_ranks else 0),
    )
