"""Samplers for flow models: the probability-flow ODE (Euler, Heun) and the SDE (Euler-Maruyama), with
classifier-free guidance on the velocity and REPA's guidance interval.

Time runs from t = 1 (noise) to t = 0 (data), dit-accel's convention (dit_accel.diffusion.flow). With the
velocity v = dx_t/dt and the score s = grad log p_t, integrating backwards over a step of size h > 0:

    ODE     x_{t-h} = x_t - h v(x_t, t)                                         (Euler; Heun averages the
                                                                                 slopes at t and t - h)
    SDE     x_{t-h} = x_t + h (-v + w(t) s) + sqrt(2 w(t) h) z,  z ~ N(0, I)    (Euler-Maruyama)

w(t) is the diffusion coefficient, SiT's `diffusion_form` choices written in this time (SiT's tau = 1 - t):
"sigma" (sigma_t; SiT's sampling default and REPA's, whose g^2 = 2t is 2 w), "SBDM" (the score-based
model's, alpha'/alpha-ratio form, infinite at t = 1 so the grid starts at 1 - SBDM_START), "constant",
"linear" (t), "decreasing" and "increasing-decreasing", each times `norm`. The SDE walks `num_steps` points
from 1 to `last_step_size` and ends with one noiseless step of the mean to 0 (SiT's and REPA's "Mean" last
step, 0.04). Guidance is applied where LOW <= t <= HIGH (REPA's interval, in the same time as here).

Every random draw comes from the given generator (or one per sample), as the DDPM samplers do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

from dit_accel.diffusion.flow import FlowMatching
from dit_accel.diffusion.names import DIFFUSION_FORMS, ODE_SOLVERS
from dit_accel.diffusion.objective import ModelFn
from dit_accel.errors import UserError

LAST_STEP_SIZE = 0.04  # SiT's and REPA's default: the noiseless last step of the SDE
SBDM_START = 1e-3  # SBDM's w(t) = alpha-ratio form is infinite at t = 1: its grid starts just below


def diffusion_coefficient(flow: FlowMatching, form: str, t: float, norm: float = 1.0) -> float:
    """w(t) of the SDE (see the module docstring); SiT's formulas with tau = 1 - t."""
    tau = 1.0 - t
    if form == "sigma":
        return norm * float(flow.coefficients(torch.tensor([t]), torch.zeros(1))[1])
    if form == "SBDM":  # SiT's compute_drift: alpha_ratio sigma^2 - sigma sigma', in tau
        alpha, sigma, d_alpha, d_sigma = (
            float(c) for c in flow.coefficients(torch.tensor([t]), torch.zeros(1))
        )
        # d/dtau = -d/dt: alpha_ratio = (d alpha / dtau) / alpha = -d_alpha / alpha, sigma'(tau) = -d_sigma
        return norm * (-d_alpha / alpha * sigma * sigma + sigma * d_sigma)
    if form == "constant":
        return norm
    if form == "linear":
        return norm * (1.0 - tau)
    if form == "decreasing":
        return 0.25 * (norm * math.cos(math.pi * tau) + 1) ** 2
    if form == "increasing-decreasing":
        return norm * math.sin(math.pi * tau) ** 2
    raise UserError(f"--diffusion-form must be one of {', '.join(DIFFUSION_FORMS)}, got {form!r}")


def guided_velocity(
    model_fn: ModelFn,
    flow: FlowMatching,
    guidance_scale: float = 1.0,
    null_class: int | None = None,
    interval: tuple[float, float] = (0.0, 1.0),
    channels: str = "all",
):
    """velocity(x, t, y) for a scalar t: the model's first C channels, guided as
    v = v_uncond + scale (v_cond - v_uncond) (one doubled batch) where interval[0] <= t <= interval[1].

    channels="first3" guides channels 0-2 only and takes the rest from the conditional half, as SiT's
    `forward_with_cfg` does (DiT's habit, kept there "for exact reproducibility"); "all" guides every one."""
    low, high = interval
    if not 0.0 <= low <= high <= 1.0:
        raise UserError(f"--cfg-interval must be LOW,HIGH with 0 <= LOW <= HIGH <= 1, got {low},{high}")

    def velocity(x: torch.Tensor, t: float, y: torch.Tensor) -> torch.Tensor:
        times = torch.full((x.shape[0],), t, device=x.device, dtype=torch.float32)
        if guidance_scale == 1 or not low <= t <= high:
            return flow.velocity(model_fn(x, times, y), x).to(x.dtype)
        output = model_fn(
            torch.cat([x, x]), torch.cat([times, times]), torch.cat([y, torch.full_like(y, null_class)])
        )
        cond, uncond = flow.velocity(output, torch.cat([x, x])).to(x.dtype).chunk(2)
        guided = x.shape[1] if channels == "all" else min(3, x.shape[1])
        mixed = uncond[:, :guided] + guidance_scale * (cond[:, :guided] - uncond[:, :guided])
        return torch.cat([mixed, cond[:, guided:]], dim=1)

    return velocity


def shifted_time(t: float, shift: float) -> float:
    """LightningDiT's sampling timestep shift in dit-accel's time. Theirs, with u = 0 noise, maps the even grid
    by u' = s u / (1 + (s - 1) u); with u = 1 - t that is t' = t / (s + (1 - s) t) here. s = 1 leaves t;
    s < 1 (their 0.3) crowds the steps near the noise; t = 0 and t = 1 stay."""
    if not (math.isfinite(shift) and shift > 0):
        raise UserError(f"--time-shift must be a positive number, got {shift}")
    return t / (shift + (1 - shift) * t)


def _start(shape, noise, generator, device, dtype) -> torch.Tensor:
    if noise is not None:
        if tuple(noise.shape) != tuple(shape):
            raise UserError(f"initial noise has shape {tuple(noise.shape)}, expected {tuple(shape)}")
        return noise.to(device=device, dtype=dtype)
    return randn_tensor(tuple(shape), generator=generator, device=torch.device(device), dtype=dtype)


def _progress(steps, progress: bool):
    if progress:
        from dit_accel.progress import progress_bar

        return progress_bar(steps, desc="sampling", unit="step", leave=False)
    return steps


@torch.no_grad()
def ode_sample(
    model_fn: ModelFn,
    flow: FlowMatching,
    shape: Sequence[int],
    y: torch.Tensor,
    *,
    num_steps: int = 50,
    solver: str = "heun",
    guidance_scale: float = 1.0,
    null_class: int | None = None,
    cfg_interval: tuple[float, float] = (0.0, 1.0),
    guidance: str = "all",
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    time_shift: float = 1.0,
) -> torch.Tensor:
    """The probability-flow ODE from t = 1 to 0 on `num_steps` steps: Euler (1 model call a step) or Heun (2:
    the slopes at both ends of the step averaged, including the last step to t = 0). The grid is even, or with
    `time_shift` s != 1 LightningDiT's shifted one (`shifted_time`)."""
    if solver not in ODE_SOLVERS:
        raise UserError(f"--ode-solver must be one of {', '.join(ODE_SOLVERS)}, got {solver!r}")
    velocity = guided_velocity(model_fn, flow, guidance_scale, null_class, cfg_interval, guidance)
    x = _start(shape, noise, generator, device or y.device, dtype)
    times = [
        shifted_time(t, time_shift)
        for t in torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64).tolist()
    ]
    for t, t_next in _progress(list(zip(times[:-1], times[1:])), progress):
        slope = velocity(x, t, y)
        step = x + (t_next - t) * slope
        if solver == "heun":
            step = x + (t_next - t) * 0.5 * (slope + velocity(step, t_next, y))
        x = step
    return x


@torch.no_grad()
def sde_sample(
    model_fn: ModelFn,
    flow: FlowMatching,
    shape: Sequence[int],
    y: torch.Tensor,
    *,
    num_steps: int = 250,
    diffusion_form: str = "sigma",
    diffusion_norm: float = 1.0,
    last_step_size: float = LAST_STEP_SIZE,
    guidance_scale: float = 1.0,
    null_class: int | None = None,
    cfg_interval: tuple[float, float] = (0.0, 1.0),
    guidance: str = "all",
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> torch.Tensor:
    """Euler-Maruyama on the reverse SDE (module docstring): `num_steps` model calls, the last one the
    noiseless mean step from `last_step_size` to 0."""
    if num_steps < 2:
        raise UserError(f"the SDE sampler needs at least 2 steps, got {num_steps}")
    if diffusion_form not in DIFFUSION_FORMS:
        raise UserError(
            f"--diffusion-form must be one of {', '.join(DIFFUSION_FORMS)}, got {diffusion_form!r}"
        )
    velocity = guided_velocity(model_fn, flow, guidance_scale, null_class, cfg_interval, guidance)
    x = _start(shape, noise, generator, device or y.device, dtype)
    first = 1.0 - SBDM_START if diffusion_form == "SBDM" else 1.0
    times = [*torch.linspace(first, last_step_size, num_steps, dtype=torch.float64).tolist(), 0.0]
    for i, (t, t_next) in enumerate(_progress(list(zip(times[:-1], times[1:])), progress)):
        h = t - t_next
        v = velocity(x, t, y)
        w = diffusion_coefficient(flow, diffusion_form, t, diffusion_norm)
        score = flow.score_from_velocity(v, x, torch.full((x.shape[0],), t, dtype=torch.float64))
        x = x + h * (-v + w * score)
        if i < num_steps - 1:  # every step but the last adds its noise
            x = x + math.sqrt(2 * w * h) * randn_tensor(
                x.shape, generator=generator, device=x.device, dtype=dtype
            )
    return x
