"""REPA in the trainer: the alignment built for a run from its flags, and the clean images it needs.

Kept out of dit_accel.train.step so the step reads the same with and without it: `build_for_run` (None without
--repa-encoder) before the optimizer exists, `encoder_targets` before the network's forward (the encoder's
working set is freed before the network's activations grow), `Repa.loss` after it.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from dit_accel.errors import UserError
from dit_accel.repa.align import Repa
from planner.repa import encoder_by_shape

log = logging.getLogger("dit_accel.train")  # the run log (dit_accel.train.steplog)


def token_grid(spec) -> int:
    """The side of the network's square token grid (16 for 256 px XL/2)."""
    return spec.latent_size // spec.patch


def build_for_run(model, config, plan, spec, device, encoder=None) -> Repa | None:
    """The run's alignment from --repa-encoder/--repa-depth/--repa-coeff/--repa-projector-dim, with the
    projector attached to the unwrapped `model` (seeded: every rank draws the same one); None without REPA.
    `encoder`: an encoder already built (`dit-accel verify`'s, of the plan's shape), not read from the flag.

    The plan counted one encoder and projector (dit-plan --repa): a run without them, with another published
    backbone or another projector width contradicts it and is refused, as a launch of another precision is."""
    planned = plan.decision.repa
    check_encoder_flag(planned, config.repa_encoder)
    if not planned:
        return None
    check_projector_width(config.repa_projector_dim, plan.decision.repa_projector_dim)
    repa = Repa.build(
        model,
        encoder if encoder is not None else config.repa_encoder,
        config.repa_depth,
        config.repa_coeff,
        config.repa_projector_dim,
        token_grid(spec),
        device,
    )
    check_planned_encoder(repa.encoder, planned)
    return repa


def check_encoder_flag(planned: str, repa_encoder: str | None) -> None:
    """--repa-encoder given exactly when the plan counted an encoder (`planned`, '' for none)."""
    if planned and not repa_encoder:
        raise UserError(
            f"the plan was made for REPA with {planned} but --repa-encoder is not given",
            f"pass --repa-encoder PATH ({planned}'s weights), or re-plan without --repa",
        )
    if repa_encoder and not planned:
        raise UserError(
            "--repa-encoder is given but the plan counts no REPA encoder",
            "re-plan with dit-plan --repa ENCODER (e.g. dinov2-b) so its memory and compute are planned",
        )


def check_projector_width(width: int, planned_width: int) -> None:
    """--repa-projector-dim must be the width the plan counted."""
    if width != planned_width:
        raise UserError(
            f"--repa-projector-dim {width} but the plan counts a projector of width {planned_width}",
            "pass the plan's width, or re-plan with dit-plan --repa-projector-dim",
        )


def published_backbone(encoder, planned: str):
    """The published backbone (planner.repa.EncoderSpec) these weights have the shape of, None for none (a
    custom or test encoder); published weights of another backbone than the plan's are refused."""
    found = encoder_by_shape(encoder.dim, len(encoder.blocks), encoder.registers)
    if found is not None and found.name != planned:
        raise UserError(
            f"--repa-encoder holds {found.name}'s weights but the plan counts {planned}",
            f"pass {planned}'s weights, or re-plan with dit-plan --repa {found.name}",
        )
    return found


def check_planned_encoder(encoder, planned: str) -> None:
    """`published_backbone`, with weights of no published shape logged, since the plan can only have counted
    a published one."""
    if published_backbone(encoder, planned) is None:
        params = sum(p.numel() for p in encoder.parameters())
        log.warning(
            "REPA encoder: %d-wide, %d blocks, %d registers (%s parameters) is no published DINOv2 backbone; "
            "the plan counted %s",
            encoder.dim,
            len(encoder.blocks),
            encoder.registers,
            f"{params:,}",
            planned,
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
