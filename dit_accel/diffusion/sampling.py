"""Sampling primitives: DDPM ancestral sampling with the learned variance and DDIM, both on respaced chains;
classifier-free guidance; and a sampler that reproduces diffusers' DiTPipeline latents.

Every sampler takes a `model_fn(x_t, t, y) -> output` (see `dit_accel.models.dit.as_model_fn`), calls it with the
ORIGINAL timestep indices, draws all its noise from the given torch.Generator (so a seed fixes the result),
and returns the final x_0 (latents, or pixels for a pixel-space DiT) without any scaling.

`generator` may also be a list with one generator per sample (diffusers' randn_tensor convention): each
sample's noise then depends only on its own seed, not on the batch it was drawn in (sharded FID runs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

from dit_accel.diffusion.objective import Diffusion, ModelFn
from dit_accel.errors import UserError

GUIDANCE_CHANNELS = ("all", "first3")


def spaced_timesteps(num_timesteps: int, num_steps: int, spacing: str = "even") -> list[int]:
    """Which of the `num_timesteps` training steps a `num_steps` sampling chain keeps.

    "even":    evenly spread, both ends included, rounded (the DiT/ADM respacing: 250 of 1000 -> 0, 4, 8, ..., 999)
    "leading": 0, s, 2s, ... with s = num_timesteps // num_steps (DDIM's and diffusers' default "leading")
    """
    if not 2 <= num_steps <= num_timesteps:
        raise UserError(f"the number of sampling steps must be from 2 to {num_timesteps}, got {num_steps}")
    if spacing == "even":
        # The position is accumulated step by step in floating point, as the ADM/DiT respacing does, not
        # computed as i * stride: the two differ at exact .5 ties (21 of 1000 keeps 499 by accumulation,
        # 500 by product) for 278 of the 999 possible step counts, none of the common ones.
        stride, position, kept = (num_timesteps - 1) / (num_steps - 1), 0.0, set()
        for _ in range(num_steps):
            kept.add(round(position))
            position += stride
        return sorted(kept)
    if spacing == "leading":
        return list(range(0, num_timesteps, num_timesteps // num_steps))[:num_steps]
    raise UserError(f"spacing must be 'even' or 'leading', got {spacing!r}")


def respaced(diffusion: Diffusion, num_steps: int, spacing: str = "even") -> Diffusion:
    return diffusion.respace(spaced_timesteps(diffusion.num_timesteps, num_steps, spacing))


def classifier_free_guidance(
    model_fn: ModelFn, guidance_scale: float, null_class: int, channels: str = "all"
) -> ModelFn:
    """Wrap `model_fn` so one call runs the conditional and the null-class batch together (doubled batch) and
    returns, for the N inputs, eps = uncond + scale * (cond - uncond).

    channels="all" guides every input channel (diffusers' DiTPipeline); "first3" guides channels 0-2 only
    (the original DiT's sampling script). Unguided eps channels and the learned-variance channels come
    from the conditional half. A scale of 1 is the plain conditional model (one batch, no doubling).
    """
    if channels not in GUIDANCE_CHANNELS:
        raise UserError(f"guidance channels must be one of {', '.join(GUIDANCE_CHANNELS)}, got {channels!r}")
    if guidance_scale == 1:
        return model_fn

    def guided(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        output = model_fn(
            torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null_class)])
        )
        cond, uncond = output.chunk(2, dim=0)
        guided_channels = x.shape[1] if channels == "all" else min(3, x.shape[1])
        cond_eps, uncond_eps = cond[:, :guided_channels], uncond[:, :guided_channels]
        eps = uncond_eps + guidance_scale * (cond_eps - uncond_eps)
        return torch.cat([eps, cond[:, guided_channels:]], dim=1)

    return guided


def _start(shape: Sequence[int], noise: torch.Tensor | None, generator, device, dtype) -> torch.Tensor:
    if noise is not None:
        if tuple(noise.shape) != tuple(shape):
            raise UserError(f"initial noise has shape {tuple(noise.shape)}, expected {tuple(shape)}")
        return noise.to(device=device, dtype=dtype)
    return randn_tensor(tuple(shape), generator=generator, device=torch.device(device), dtype=dtype)


def _predict(
    model_fn: ModelFn, chain: Diffusion, x: torch.Tensor, k: int, y: torch.Tensor, clip_denoised: bool
):
    """The model's reverse-step prediction at step k of `chain` (called with the original timestep)."""
    t = torch.full((x.shape[0],), k, device=x.device, dtype=torch.long)
    output = model_fn(x, chain.model_timesteps(t), y)
    return t, chain.p_mean_variance(output.to(x.dtype), x, t, clip_denoised=clip_denoised)


def _steps(chain: Diffusion, progress: bool):
    steps = range(chain.num_timesteps - 1, -1, -1)
    if progress:
        from dit_accel.progress import progress_bar

        return progress_bar(steps, desc="sampling", unit="step", leave=False)
    return steps


@torch.no_grad()
def ddpm_sample(
    model_fn: ModelFn,
    diffusion: Diffusion,
    shape: Sequence[int],
    y: torch.Tensor,
    *,
    num_steps: int = 250,
    spacing: str = "even",
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
    clip_denoised: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> torch.Tensor:
    """Ancestral sampling x_T -> x_0 with the model's learned variance on a `num_steps` respaced chain.

    x_{k-1} = mean + exp(log_variance / 2) * z, no noise at the last step. `clip_denoised` clamps the
    predicted x_0 to [-1, 1] (for pixel-space models; DiT's latents are not clipped).
    """
    device = device or y.device
    chain = respaced(diffusion, num_steps, spacing)
    x = _start(shape, noise, generator, device, dtype)
    for k in _steps(chain, progress):
        _, step = _predict(model_fn, chain, x, k, y, clip_denoised)
        if k > 0:
            x = step["mean"] + torch.exp(0.5 * step["log_variance"]) * randn_tensor(
                x.shape, generator=generator, device=x.device, dtype=dtype
            )
        else:
            x = step["mean"]
    return x


@torch.no_grad()
def ddim_sample(
    model_fn: ModelFn,
    diffusion: Diffusion,
    shape: Sequence[int],
    y: torch.Tensor,
    *,
    num_steps: int = 50,
    eta: float = 0.0,
    spacing: str = "even",
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
    clip_denoised: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> torch.Tensor:
    """DDIM (Song et al.): deterministic for eta = 0; eta = 1 has DDPM's fixed-small variance. The learned
    variance channels, if any, are ignored.

    x_{k-1} = sqrt(abar_prev) x0_pred + sqrt(1 - abar_prev - sigma^2) eps + sigma z,
    sigma = eta sqrt((1 - abar_prev) / (1 - abar)) sqrt(1 - abar / abar_prev).
    """
    device = device or y.device
    chain = respaced(diffusion, num_steps, spacing)
    x = _start(shape, noise, generator, device, dtype)
    for k in _steps(chain, progress):
        t, step = _predict(model_fn, chain, x, k, y, clip_denoised)
        alpha_bar, alpha_bar_prev = (
            chain.coef("alphas_cumprod", t, x),
            chain.coef("alphas_cumprod_prev", t, x),
        )
        sigma = (
            eta * ((1 - alpha_bar_prev) / (1 - alpha_bar)).sqrt() * (1 - alpha_bar / alpha_bar_prev).sqrt()
        )
        x = alpha_bar_prev.sqrt() * step["pred_x0"] + (1 - alpha_bar_prev - sigma**2).sqrt() * step["eps"]
        if eta > 0 and k > 0:
            x = x + sigma * randn_tensor(x.shape, generator=generator, device=x.device, dtype=dtype)
    return x


@torch.no_grad()
def sample_with_scheduler(
    model_fn: ModelFn,
    scheduler,
    y: torch.Tensor,
    *,
    latent_channels: int,
    latent_size: int,
    num_inference_steps: int = 50,
    guidance_scale: float = 4.0,
    null_class: int = 1000,
    generator: torch.Generator | list[torch.Generator] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> torch.Tensor:
    """The latents diffusers' DiTPipeline produces (before `1 / scaling_factor` and the VAE), for the same
    generator, scheduler, step count and guidance scale.

    Mirrors DiTPipeline.__call__: initial noise from randn_tensor((N, C, S, S)); guidance only when the scale
    is > 1, on all latent channels; the learned-variance channels dropped; `scheduler.step` applied to the
    `scale_model_input` output, as the pipeline does. Exact for deterministic schedulers (DDIM with eta 0,
    DPM-Solver, ...): stochastic ones draw step noise that the pipeline does not seed. DiTPipeline's null
    class is always 1000.
    """
    device = torch.device(device or y.device)
    x = randn_tensor(
        (y.shape[0], latent_channels, latent_size, latent_size),
        generator=generator,
        device=device,
        dtype=dtype,
    )
    guided = guidance_scale > 1
    fn = classifier_free_guidance(model_fn, guidance_scale, null_class, "all") if guided else model_fn
    scheduler.set_timesteps(num_inference_steps)
    timesteps = scheduler.timesteps
    if progress:
        from dit_accel.progress import progress_bar

        timesteps = progress_bar(timesteps, desc="sampling", unit="step", leave=False)
    for t in timesteps:
        x = scheduler.scale_model_input(x, t)
        t_batch = (
            t[None].to(device).expand(x.shape[0])
            if torch.is_tensor(t)
            else torch.full((x.shape[0],), t, device=device)
        )
        eps = fn(x, t_batch, y)[:, :latent_channels]
        x = scheduler.step(eps, t, x).prev_sample
    return x
