"""DiT's training objective: a Gaussian diffusion with a linear beta schedule, epsilon-prediction MSE plus the
variational-bound term that trains the learned variance (Nichol & Dhariwal's "learned range").

    loss = mse + vb
    mse  = mean over dims of (noise - eps_pred)^2
    vb   = KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t))          for t > 0,  in bits per dimension
         = -log p(x_0 | x_1) under a discretised Gaussian         for t = 0,  in bits per dimension

The model predicts 2C channels: epsilon, and v in [-1, 1] that interpolates the log-variance between the
posterior variance (clipped) and beta_t. Inside vb the predicted mean is DETACHED, so vb trains only the
variance and the mean is trained by the MSE alone. The schedule is held in float64 and gathered per step
into the data's float32, as the DiT reference does. docs/model.md derives every formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from dit_accel.errors import UserError

# The schedule DiT trains with; also the config of the scheduler an exported pipeline carries.
DIT_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 1e-4,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "clip_sample": False,
}

ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x_t, t, y) -> output


class Diffusion:
    """The forward process, the posterior, the model's reverse step and the DiT loss for one beta schedule.

    `timestep_map[k]` is the ORIGINAL timestep index of step k; it is the identity for the training schedule
    and a subset for a respaced sampling chain (see `respace`): the model is always called with it.
    """

    def __init__(
        self,
        betas: Sequence[float] | np.ndarray | torch.Tensor,
        timestep_map: Sequence[int] | torch.Tensor | None = None,
    ):
        # The schedule is float64 arithmetic on the CPU, in numpy as the DiT reference computes it, so that
        # building it reads no tensor value: `dit-accel verify` builds the objective on value-less fake tensors.
        betas = np.asarray(betas, dtype=np.float64).reshape(-1)
        if len(betas) < 2 or not ((betas > 0) & (betas <= 1)).all():
            raise UserError("a diffusion schedule needs at least 2 steps with betas in (0, 1]")
        self.num_timesteps = len(betas)
        self.timestep_map = (
            torch.arange(self.num_timesteps)
            if timestep_map is None
            else torch.as_tensor(timestep_map, dtype=torch.long)
        )
        alphas = 1.0 - betas
        alphas_cumprod = np.cumprod(alphas)
        alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        tables = {
            "betas": betas,
            "log_betas": np.log(betas),
            "alphas_cumprod": alphas_cumprod,
            "alphas_cumprod_prev": alphas_cumprod_prev,
            "sqrt_alphas_cumprod": np.sqrt(alphas_cumprod),
            "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - alphas_cumprod),
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / alphas_cumprod - 1.0),
            # The posterior variance is 0 at t = 0; its log is clipped to the value at t = 1.
            "posterior_log_variance_clipped": np.log(
                np.append(posterior_variance[1], posterior_variance[1:])
            ),
            "posterior_mean_coef1": betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - alphas_cumprod),
            # Without learned sigma: the "fixed large" variance (beta_t, with beta_0 -> posterior variance at 1).
            "fixed_large_log_variance": np.log(np.append(posterior_variance[1], betas[1:])),
            "posterior_variance": posterior_variance,
        }
        self.tables = {name: torch.tensor(values) for name, values in tables.items()}  # float64, CPU
        self._on_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    @classmethod
    def linear(cls, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> Diffusion:
        """DiT's schedule: betas evenly spaced from beta_start to beta_end (float64, like diffusers' in float32)."""
        return cls(np.linspace(beta_start, beta_end, num_timesteps, dtype=np.float64))

    @classmethod
    def from_scheduler_config(cls, config=None) -> Diffusion:
        """The schedule of a diffusers scheduler (its config), so training and exported sampling agree."""
        config = dict(DIT_SCHEDULER_CONFIG if config is None else config)
        if config.get("beta_schedule", "linear") != "linear" or config.get("trained_betas") is not None:
            raise UserError(
                f"only the linear beta schedule is supported, got {config.get('beta_schedule')!r}"
            )
        return cls.linear(
            config.get("num_train_timesteps", 1000),
            config.get("beta_start", 1e-4),
            config.get("beta_end", 0.02),
        )

    def table(self, name: str) -> torch.Tensor:
        return self.tables[name]

    # --- helpers ------------------------------------------------------------------------------------
    def coef(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """tables[name][t] as `like`'s float dtype, shaped to broadcast over (N, C, H, W)."""
        device = t.device
        if device not in self._on_device:  # float64 on the device (MPS has none: float32 there)
            dtype = torch.float32 if device.type == "mps" else torch.float64
            self._on_device[device] = {key: value.to(device, dtype) for key, value in self.tables.items()}
        values = self._on_device[device][name][t].to(like.dtype)
        return values.view(-1, *([1] * (like.ndim - 1)))

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """The original timestep indices the network must see for steps `t` of this (maybe respaced) chain."""
        return self.timestep_map.to(t.device)[t]

    def sample_timesteps(
        self, batch: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Uniform timesteps in [0, num_timesteps), one per sample."""
        draw_device = generator.device if generator is not None else device
        return torch.randint(0, self.num_timesteps, (batch,), generator=generator, device=draw_device).to(
            device
        )

    # --- forward process and posterior --------------------------------------------------------------
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise."""
        return (
            self.coef("sqrt_alphas_cumprod", t, x0) * x0
            + self.coef("sqrt_one_minus_alphas_cumprod", t, x0) * noise
        )

    def q_posterior(
        self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and clipped log-variance of q(x_{t-1} | x_t, x0)."""
        mean = (
            self.coef("posterior_mean_coef1", t, x_t) * x0 + self.coef("posterior_mean_coef2", t, x_t) * x_t
        )
        return mean, self.coef("posterior_log_variance_clipped", t, x_t).expand_as(x_t)

    def predict_x0(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return (
            self.coef("sqrt_recip_alphas_cumprod", t, x_t) * x_t
            - self.coef("sqrt_recipm1_alphas_cumprod", t, x_t) * eps
        )

    def predict_eps(self, x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return (self.coef("sqrt_recip_alphas_cumprod", t, x_t) * x_t - x0) / self.coef(
            "sqrt_recipm1_alphas_cumprod", t, x_t
        )

    def p_mean_variance(
        self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, clip_denoised: bool = False
    ) -> dict[str, torch.Tensor]:
        """The model's reverse step p(x_{t-1} | x_t): mean, log_variance, pred_x0, eps.

        With 2C output channels the second half is v in [-1, 1]: log var = (v+1)/2 log beta_t + (1-v)/2 log
        posterior_var_clipped. With C channels the variance is the fixed "large" one (beta_t).
        """
        channels = x_t.shape[1]
        if model_output.shape[1] == 2 * channels:
            eps, v = model_output.split(channels, dim=1)
            fraction = (v + 1) / 2
            log_variance = fraction * self.coef("log_betas", t, x_t) + (1 - fraction) * self.coef(
                "posterior_log_variance_clipped", t, x_t
            )
        elif model_output.shape[1] == channels:
            eps = model_output
            log_variance = self.coef("fixed_large_log_variance", t, x_t).expand_as(x_t)
        else:
            raise UserError(
                f"model output has {model_output.shape[1]} channels for {channels}-channel inputs: "
                f"expected {channels} or {2 * channels}"
            )
        pred_x0 = self.predict_x0(x_t, t, eps)
        if clip_denoised:
            pred_x0 = pred_x0.clamp(-1, 1)
            eps = self.predict_eps(x_t, t, pred_x0)
        mean, _ = self.q_posterior(pred_x0, x_t, t)
        return {"mean": mean, "log_variance": log_variance, "pred_x0": pred_x0, "eps": eps}

    # --- the loss -----------------------------------------------------------------------------------
    def loss_terms(
        self, model_output: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-sample DiT loss terms (each of shape (N,)) for a model output at x_t = q_sample(x0, t, noise).

        Computed in float32 even when the model ran in bf16/fp16 (the vb term takes logs and exps).
        `vb` is in bits per dimension and is not rescaled (the reference scales it by T/1000 = 1).
        """
        model_output, x0, noise = model_output.float(), x0.float(), noise.float()
        channels = x0.shape[1]
        x_t = self.q_sample(x0, t, noise)
        eps = model_output[:, :channels]
        mse = mean_flat((noise - eps) ** 2)
        if model_output.shape[1] == channels:  # no learned variance: nothing for vb to train
            vb = torch.zeros_like(mse)
        else:
            frozen = torch.cat([eps.detach(), model_output[:, channels:]], dim=1)  # vb must not move the mean
            vb = self.vb_terms_bpd(frozen, x0, x_t, t)
        return {"mse": mse, "vb": vb, "loss": mse + vb}

    def vb_terms_bpd(
        self, model_output: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """One term of the variational bound, in bits per dimension: the KL for t > 0, the decoder NLL at t = 0."""
        true_mean, true_log_variance = self.q_posterior(x0, x_t, t)
        model = self.p_mean_variance(model_output, x_t, t)
        kl = mean_flat(
            normal_kl(true_mean, true_log_variance, model["mean"], model["log_variance"])
        ) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, model["mean"], 0.5 * model["log_variance"])
        nll = mean_flat(nll) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    def training_losses(
        self,
        model_fn: ModelFn,
        x0: torch.Tensor,
        y: torch.Tensor,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """Draw t (uniform) and noise where not given, run the model at x_t, return loss_terms plus t."""
        if t is None:
            t = self.sample_timesteps(x0.shape[0], x0.device, generator)
        if noise is None:
            noise = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        x_t = self.q_sample(x0, t, noise)
        terms = self.loss_terms(model_fn(x_t, self.model_timesteps(t), y), x0, t, noise)
        terms["t"] = t
        return terms

    # --- respacing ----------------------------------------------------------------------------------
    def respace(self, kept_timesteps: Sequence[int]) -> Diffusion:
        """A shorter chain through `kept_timesteps` (indices of this chain) with the same marginals.

        Its betas come from alphas_cumprod at the kept steps: beta'_k = 1 - abar[t_k] / abar[t_{k-1}].
        The network is still called with the original indices (timestep_map).
        """
        kept = sorted(set(int(k) for k in kept_timesteps))
        if len(kept) < 2 or kept[0] < 0 or kept[-1] >= self.num_timesteps:
            raise UserError(
                f"respacing needs at least 2 distinct steps within [0, {self.num_timesteps}), got {len(kept)}"
            )
        alphas_cumprod = self.tables["alphas_cumprod"][kept]
        previous = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        return Diffusion(1.0 - alphas_cumprod / previous, timestep_map=self.timestep_map[kept])


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the batch."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(
    mean1: torch.Tensor, log_var1: torch.Tensor, mean2: torch.Tensor, log_var2: torch.Tensor
) -> torch.Tensor:
    """KL(N(mean1, var1) || N(mean2, var2)) elementwise, in nats."""
    return 0.5 * (
        -1.0
        + log_var2
        - log_var1
        + torch.exp(log_var1 - log_var2)
        + (mean1 - mean2) ** 2 * torch.exp(-log_var2)
    )


def approx_standard_normal_cdf(z: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of the standard normal CDF, 0.5 (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))),
    within 2e-4 of the exact CDF. The DiT recipe (ADM's code) scores the t = 0 term with it, so dit-accel
    does too: the same weights and batch then give the reference's loss to float rounding."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z.pow(3))))


def discretized_gaussian_log_likelihood(
    x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor
) -> torch.Tensor:
    """log P(x) for data in [-1, 1] quantised to 256 bins (width 2/255), under N(mean, exp(log_scale)^2).

    The edge bins extend to -inf / +inf. As in the recipe, the CDF is `approx_standard_normal_cdf` and each
    probability is clamped at 1e-12 before its log.
    """
    half_bin = 1.0 / 255.0
    inv_std = torch.exp(-log_scale)
    cdf_upper = approx_standard_normal_cdf(inv_std * (x - mean + half_bin))  # P(X <= x + half bin)
    cdf_lower = approx_standard_normal_cdf(inv_std * (x - mean - half_bin))  # P(X <= x - half bin)
    log_lowest_bin = torch.log(cdf_upper.clamp(min=1e-12))
    log_highest_bin = torch.log((1.0 - cdf_lower).clamp(min=1e-12))
    log_bin = torch.log((cdf_upper - cdf_lower).clamp(min=1e-12))
    return torch.where(x < -0.999, log_lowest_bin, torch.where(x > 0.999, log_highest_bin, log_bin))
