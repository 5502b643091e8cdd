"""The flow-matching objective (SiT, REPA): an interpolant between data and Gaussian noise, velocity prediction.

dit-accel's time runs as the diffusion's does: t = 0 is data, t = 1 is noise (REPA's direction; SiT's runs the
other way, see docs/model.md for the mapping). For a path (alpha_t, sigma_t):

    x_t    = alpha_t x0 + sigma_t noise
    target = d/dt x_t = alpha'_t x0 + sigma'_t noise         (the velocity)
    loss   = mean over dims of (v_pred - target)^2
             + w (1 - cos(v_pred, target))                  (LightningDiT's velocity-direction term, w = 1
                                                             there, 0 by default: the cosine over channels at
                                                             each position, averaged over positions)

    linear  alpha_t = 1 - t,          sigma_t = t            (SiT's and REPA's default)
    gvp     alpha_t = cos(pi t / 2),  sigma_t = sin(pi t / 2) (SiT's GVP; REPA's "cosine")

The network is the DiT network unchanged: it is fed t in [0, 1] as it is (no scaling to 1000, as SiT and
REPA feed theirs, so their checkpoints load) and its first C of 2C output channels are the velocity; the
learned-variance half is left untrained (SiT drops it in its forward; REPA's network has none).
"""

from __future__ import annotations

import math

import torch
from diffusers.utils.torch_utils import randn_tensor

from dit_accel.diffusion.names import FLOW_PATHS as PATHS
from dit_accel.diffusion.names import TIME_SAMPLINGS
from dit_accel.diffusion.objective import ModelFn, mean_flat
from dit_accel.errors import UserError


def path_coefficients(path: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(alpha_t, sigma_t, alpha'_t, sigma'_t) of a path at times t (any shape)."""
    if path == "linear":
        return 1 - t, t, -torch.ones_like(t), torch.ones_like(t)
    if path == "gvp":
        half_pi = math.pi / 2
        return (
            torch.cos(half_pi * t),
            torch.sin(half_pi * t),
            -half_pi * torch.sin(half_pi * t),
            half_pi * torch.cos(half_pi * t),
        )
    raise UserError(f"the flow path must be one of {', '.join(PATHS)}, got {path!r}")


def draw_time(time_sampling: str, path: str, generator: torch.Generator) -> torch.Tensor:
    """One sample's t in [0, 1] (a float32 scalar), from its own generator (dit_accel.data.order).

    "uniform": t ~ U[0, 1). "lognormal": the noise-to-signal ratio sigma_t / alpha_t = exp(n), n ~ N(0, 1)
    (REPA's, after EDM); for the linear path that is t = sigmoid(n), the logit-normal of SD3."""
    if time_sampling == "uniform":
        return torch.rand((), generator=generator)
    if time_sampling == "lognormal":
        ratio = torch.randn((), generator=generator).exp()
        if path == "linear":
            return ratio / (1 + ratio)
        if path == "gvp":
            return torch.atan(ratio) * (2 / math.pi)
        raise UserError(f"the flow path must be one of {', '.join(PATHS)}, got {path!r}")
    raise UserError(f"--time-sampling must be one of {', '.join(TIME_SAMPLINGS)}, got {time_sampling!r}")


def cosine_distance(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sample, 1 - the cosine similarity of the two velocities over channels at each position, averaged
    over the positions (LightningDiT's term: it rewards the right direction whatever the length)."""
    return mean_flat(1 - torch.nn.functional.cosine_similarity(predicted, target, dim=1))


def _like(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))


class FlowMatching:
    """The flow objective for one path and time sampling; velocity prediction only (see the module docstring).

    `name` is what checkpoints and exports record ("flow"), beside `path` and `time_sampling`."""

    name = "flow"

    def __init__(self, path: str = "linear", time_sampling: str = "uniform", cosine_weight: float = 0.0):
        if not (math.isfinite(cosine_weight) and cosine_weight >= 0):
            raise UserError(f"--cosine-loss-weight must be a finite number >= 0, got {cosine_weight}")
        if path not in PATHS:
            raise UserError(f"the flow path must be one of {', '.join(PATHS)}, got {path!r}")
        if time_sampling not in TIME_SAMPLINGS:
            raise UserError(
                f"--time-sampling must be one of {', '.join(TIME_SAMPLINGS)}, got {time_sampling!r}"
            )
        self.path, self.time_sampling, self.cosine_weight = path, time_sampling, float(cosine_weight)

    def describe(self) -> dict:
        """What a checkpoint records so that sample/export rebuild this objective unasked."""
        described = {"name": self.name, "path": self.path, "time_sampling": self.time_sampling}
        return described | ({"cosine_loss_weight": self.cosine_weight} if self.cosine_weight else {})

    def coefficients(self, t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(alpha, sigma, alpha', sigma') at t, in `like`'s dtype, shaped to broadcast over (N, C, H, W)."""
        return tuple(_like(c, like) for c in path_coefficients(self.path, t.double()))

    def interpolate(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        alpha, sigma, _, _ = self.coefficients(t, x0)
        return alpha * x0 + sigma * noise

    def velocity_target(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        _, _, d_alpha, d_sigma = self.coefficients(t, x0)
        return d_alpha * x0 + d_sigma * noise

    def sample_times(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.stack([draw_time(self.time_sampling, self.path, generator) for _ in range(batch)])

    def loss_terms(
        self, model_output: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-sample terms (N,) in float32: the velocity MSE of the first C output channels, and with a
        cosine weight the direction term (`cosine_distance`) added to it."""
        x0, noise = x0.float(), noise.float()
        velocity = model_output[:, : x0.shape[1]].float()
        target = self.velocity_target(x0, t, noise)
        mse = mean_flat((velocity - target) ** 2)
        if not self.cosine_weight:
            return {"mse": mse, "loss": mse}
        distance = cosine_distance(velocity, target)
        return {"mse": mse, "cosine": distance, "loss": mse + self.cosine_weight * distance}

    def training_losses(
        self,
        model_fn: ModelFn,
        x0: torch.Tensor,
        y: torch.Tensor,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """As Diffusion.training_losses: draw t and noise where not given, run the model at x_t (fed t itself)."""
        if t is None:
            t = self.sample_times(x0.shape[0], generator).to(x0.device)
        if noise is None:
            noise = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        t = t.to(x0.device, torch.float32)
        x_t = self.interpolate(x0, t, noise)
        terms = self.loss_terms(model_fn(x_t, t, y), x0, t, noise)
        terms["t"] = t
        return terms

    # --- what the samplers need ---------------------------------------------------------------------
    def velocity(self, model_output: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
        return model_output[:, : x_t.shape[1]]

    def score_from_velocity(self, velocity: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """grad log p_t(x_t) from the velocity: with x_t = alpha x0 + sigma e and v = alpha' x0 + sigma' e,
        E[e | x_t] = (alpha v - alpha' x_t) / (alpha sigma' - alpha' sigma), and the score is -E[e | x_t] / sigma."""
        alpha, sigma, d_alpha, d_sigma = self.coefficients(t, x_t)
        noise = (alpha * velocity - d_alpha * x_t) / (alpha * d_sigma - d_alpha * sigma)
        return -noise / sigma


def build_objective(
    name: str = "ddpm", path: str = "linear", time_sampling: str = "uniform", cosine_weight: float = 0.0
):
    """The training objective a run's settings name: DiT's diffusion ("ddpm") or FlowMatching ("flow")."""
    from dit_accel.diffusion.objective import Diffusion

    if name == "ddpm":
        if cosine_weight:
            raise UserError(
                "--cosine-loss-weight is a flow objective's term: use --objective flow, or drop it"
            )
        return Diffusion.linear()
    if name == "flow":
        return FlowMatching(path, time_sampling, cosine_weight)
    raise UserError(f"--objective must be ddpm or flow, got {name!r}")


def objective_description(objective) -> dict:
    """{"name": "ddpm"} or a FlowMatching's describe(): what sidecars and run records carry."""
    return objective.describe() if isinstance(objective, FlowMatching) else {"name": "ddpm"}


def objective_from_description(description: dict | None):
    """The objective a recorded description names (None or missing: DiT's ddpm, as before there was a choice)."""
    description = description or {"name": "ddpm"}
    return build_objective(
        description.get("name", "ddpm"),
        description.get("path", "linear"),
        description.get("time_sampling", "uniform"),
        description.get("cosine_loss_weight", 0.0),
    )
