"""A REPA plan before the launch: the encoder weights the plan counted, and, from a latent cache, the clean
images its workers read beside the latents (found where the manifest or --data-path says, decoded as the
workers will, at the plan's rate). The trainer's own readers and refusals decide. Not checked here: the
run's --repa-depth and --repa-coeff (which the plan does not count), and, without --full, the images
beyond the sample.
"""

from __future__ import annotations

from pathlib import Path

from dit_accel.doctor.checks import Check, failed, passed, warned
from dit_accel.doctor.data import GROUP, from_user_error
from dit_accel.doctor.decode_rate import DecodeBudget, check_decode_rate, spread
from dit_accel.doctor.plan import PlanFacts
from dit_accel.errors import UserError


def check_encoder(plan: PlanFacts, repa_encoder: str | None, projector_dim: int) -> Check:
    from dit_accel.repa.encoder import load_encoder, weights_file
    from dit_accel.repa.training import (
        check_encoder_flag,
        check_projector_width,
        published_backbone,
        token_grid,
    )

    planned = plan.plan.decision.repa
    try:
        check_encoder_flag(planned, repa_encoder)
        check_projector_width(projector_dim, plan.plan.decision.repa_projector_dim)
        encoder = load_encoder(repa_encoder, token_grid(plan.plan.spec()))
        found = published_backbone(encoder, planned)
        path = weights_file(repa_encoder)
    except UserError as error:
        return from_user_error("REPA encoder", error)
    params = sum(p.numel() for p in encoder.parameters())
    if found is None:
        return warned(
            GROUP,
            "REPA encoder",
            f"{path}: {encoder.dim}-wide, {len(encoder.blocks)} blocks ({params:,} parameters), no published "
            f"DINOv2 backbone; the plan counted {planned}",
            f"pass {planned}'s weights, or expect other memory and speed than planned",
        )
    return passed(
        GROUP,
        "REPA encoder",
        f"{path}: {found.name} ({params:,} parameters), a projector of width {projector_dim}, as planned",
    )


def check_cache_images(
    latents: Path, data_path: Path | None, options, budget: DecodeBudget | None, full: bool = False
) -> list[Check]:
    """The cache's source images, read for a sample of its entries (every entry with `full`) as the workers
    will read them."""
    from dit_accel.data.cache_images import CacheImages
    from dit_accel.data.latent_cache import read_manifest

    try:
        manifest = read_manifest(latents)
    except UserError:
        return []  # the latent cache row reports it
    try:
        images = CacheImages(latents, manifest, str(data_path) if data_path else None, options)
    except UserError as error:
        return [from_user_error("REPA images", error)]
    # timed first, while the files are not yet in the page cache: the workers read them from their mount
    rate = check_decode_rate(images.pixels, len(images), budget) if budget else None
    sample = range(len(images)) if full else spread(len(images))
    unread = []
    for index in sample:
        try:
            images.pixels(index, False)
        except UserError as error:
            unread.append(error)
    if unread:
        return [
            failed(
                GROUP,
                "REPA images",
                f"{len(unread)} of {len(sample)} {'' if full else 'sampled '}source images of latent cache "
                f"{latents} cannot be read from {images.root}: {unread[0].problem}",
                "pass --data-path with the image folder or dataset the cache was made from"
                if len(unread) == len(sample)
                else "restore those images, or extract the cache again from the images as they are now",
            )
        ]
    checks = [
        passed(
            GROUP,
            "REPA images",
            f"{len(sample)} of the cache's {len(images)} source images read and decoded from {images.root}"
            + ("" if full else " (--full reads every one)"),
        )
    ]
    return checks + ([rate] if rate else [])


def check_repa(
    plan: PlanFacts,
    repa_encoder: str | None,
    projector_dim: int,
    latents: Path | None,
    data_path: Path | None,
    options,
    budget: DecodeBudget | None,
    full: bool = False,
) -> list[Check]:
    """Nothing for a plan without REPA run without --repa-encoder."""
    if not plan.plan.decision.repa and not repa_encoder:
        return []
    checks = [check_encoder(plan, repa_encoder, projector_dim)]
    if plan.plan.decision.repa and plan.latents == "precomputed" and latents is not None:
        checks += check_cache_images(latents, data_path, options, budget, full)
    return checks
