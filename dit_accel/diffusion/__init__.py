"""DiT's objective (objective.py) and samplers (sampling.py); see docs/model.md for the formulas."""

from dit_accel.diffusion.objective import (
    DIT_SCHEDULER_CONFIG,
    Diffusion,
    ModelFn,
    discretized_gaussian_log_likelihood,
    mean_flat,
    normal_kl,
)
from dit_accel.diffusion.sampling import (
    GUIDANCE_CHANNELS,
    classifier_free_guidance,
    ddim_sample,
    ddpm_sample,
    respaced,
    sample_with_scheduler,
    spaced_timesteps,
)

__all__ = [
    "DIT_SCHEDULER_CONFIG",
    "Diffusion",
    "GUIDANCE_CHANNELS",
    "ModelFn",
    "classifier_free_guidance",
    "ddim_sample",
    "ddpm_sample",
    "discretized_gaussian_log_likelihood",
    "mean_flat",
    "normal_kl",
    "respaced",
    "sample_with_scheduler",
    "spaced_timesteps",
]
