"""REPA in the trainer: the alignment built for a run from its flags, and the clean images it needs.

Kept out of dit_accel.step so the step reads the same with and without it: `build_for_run` (None without
--repa-encoder) before the optimizer exists, `encoder_targets` before the network's forward (the encoder's
working set is freed before the network's activations grow), `Repa.loss` after it.
"""

from __future__ import annotations

import contextlib

import torch

from dit_accel.errors import UserError
from dit_accel.repa.align import Repa


def token_grid(spec) -> int:
    """The side of the network's square token grid (16 for 256 px XL/2)."""
    return spec.latent_size // spec.patch


def build_for_run(model, config, spec, latents: str, device) -> Repa | None:
    """The run's alignment from --repa-encoder/--repa-depth/--repa-coeff/--repa-projector-dim, with the
    projector attached to the unwrapped `model` (seeded: every rank draws the same one); None without REPA."""
    if not config.repa_encoder:
        return None
    if latents == "precomputed":
        raise UserError(
            "REPA's encoder sees the clean images, and training from a latent cache reads none",
            "train on images (dit-plan --latents online, or pixel) with --data-path DIR",
        )
    return Repa.build(
        model,
        config.repa_encoder,
        config.repa_depth,
        config.repa_coeff,
        config.repa_projector_dim,
        token_grid(spec),
        device,
    )


def encoder_autocast(components):
    """The autocast the network's forward runs under, for the encoder (not a prepared module, so Accelerate's
    own autocast must be entered explicitly)."""
    if components.accelerator is not None:
        return components.accelerator.autocast()
    return components.forward_context() if components.autocast_dtype is not None else contextlib.nullcontext()


def encoder_targets(components, images: torch.Tensor) -> torch.Tensor | None:
    """The encoder's patch tokens of this micro-batch's clean images (in [-1, 1]); None without REPA."""
    repa = getattr(components, "repa", None)
    if repa is None:
        return None
    return repa.targets(images.to(components.device, non_blocking=True), encoder_autocast(components))
