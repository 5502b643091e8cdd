"""Data checks: the data helper's own validation (its UserError becomes a FAIL row), images per class,
image sizes and decoding of a sample (every image with --full), and a latent cache's manifest against
the plan. The doctor never re-implements what the trainer checks: it calls the same functions.
"""

from __future__ import annotations

from pathlib import Path

from dit_accel.doctor.checks import Check, failed, passed, warned
from dit_accel.doctor.plan import PlanFacts
from dit_accel.errors import UserError

GROUP = "data"
SIZE_SAMPLE = 64  # image headers read for the size check: cheap, and enough to see a wrong folder
IMBALANCE_RATIO = 10  # the largest class 10x the smallest: sampling is uniform over images, not classes


_ADVICE_VERBS = ("pass", "use", "add", "make", "re-", "run", "fix", "drop", "move", "remove", "replace", "check", "extract")


def from_user_error(name: str, error: UserError) -> Check:
    """The data helper and the trainer write 'problem; what to do' (or 'problem: do this'): split the
    one-line message into the table's reason and fix."""
    message = str(error)
    reason, _, fix = message.partition("; ")
    if not fix:
        head, _, tail = message.partition(": ")
        if tail.startswith(_ADVICE_VERBS):
            reason, fix = head, tail
    return failed(GROUP, name, reason, fix or "correct what the reason names")


def check_data_mode(plan: PlanFacts, data_path: Path | None, latents: Path | None, vae: str | None) -> Check:
    """What was passed (images or a latent cache) must be what the plan's latent mode trains on."""
    from dit_accel.train import check_data_mode as trainer_check
    from dit_accel.train_config import TrainConfig

    config = TrainConfig(plan=str(plan.path), output_dir="-", data_path=str(data_path) if data_path else None,
                         latents=str(latents) if latents else None, vae=vae)
    try:
        trainer_check({"decision": {"latents": plan.latents}}, config)
    except UserError as error:
        return from_user_error("data vs plan", error)
    source = f"latent cache {latents}" if latents else f"image folder {data_path}"
    return passed(GROUP, "data vs plan", f"the plan trains on {plan.latents} latents; a {source} was given")


def _class_counts(images_per_class: dict[str, int]) -> str:
    counts = sorted(images_per_class.values())
    return f"{len(counts)} classes, {counts[0]}-{counts[-1]} images per class"


def check_image_folder(plan: PlanFacts, data_path: Path, full: bool) -> list[Check]:
    from PIL import Image

    from dit_accel.data.folder import validate_image_folder

    try:
        summary = validate_image_folder(data_path, sample=True, full=full, skip_bad_images=True)
    except UserError as error:
        return [from_user_error("image folder", error)]
    checks = [passed(GROUP, "image folder", summary.describe())]

    decoded = "every image" if full else "the first image of every class"
    if summary.bad_images:
        shown = ", ".join(summary.bad_images[:3])
        checks.append(failed(GROUP, "decoding", f"{len(summary.bad_images)} of {summary.images_decoded} images tried "
                             f"({decoded}) do not decode: {shown}",
                             "replace or delete them, or train with --skip-bad-images"))
    else:
        more = "" if full else " (--full decodes all)"
        checks.append(passed(GROUP, "decoding", f"{summary.images_decoded} images decoded ({decoded}){more}"))

    counts = summary.images_per_class
    num_classes = plan.num_classes
    smallest, largest = min(counts.values()), max(counts.values())
    if summary.num_classes > num_classes:
        checks.append(failed(GROUP, "classes", f"{_class_counts(counts)}, but the model has {num_classes} class labels",
                             f"re-plan with --num-classes {summary.num_classes}, or remove the extra class folders"))
    elif summary.num_images < plan.global_batch:
        checks.append(failed(GROUP, "classes", f"{summary.num_images} images, fewer than one global batch of "
                             f"{plan.global_batch}: an epoch would hold no full step",
                             "add images, or re-plan with a smaller --global-batch"))
    elif largest > IMBALANCE_RATIO * smallest:
        checks.append(warned(GROUP, "classes", f"{_class_counts(counts)}: sampling follows images, so the largest classes "
                             "dominate", "balance the classes if every class should be learnt equally"))
    else:
        checks.append(passed(GROUP, "classes", _class_counts(counts)))

    sample = summary.listing.paths[:: max(1, len(summary.listing.paths) // SIZE_SAMPLE)][:SIZE_SAMPLE]
    small, sides = [], []
    for relative in sample:
        try:
            with Image.open(summary.listing.root / relative) as image:  # reads the header only
                width, height = image.size
        except OSError:
            continue  # decoding is the decoding row's business
        sides.append(min(width, height))
        if min(width, height) < plan.resolution:
            small.append(f"{relative} ({width}x{height})")
    if sides and small:
        checks.append(warned(GROUP, "image sizes", f"{len(small)} of {len(sides)} sampled images are smaller than the plan's "
                             f"{plan.resolution} px and will be upscaled (blurry targets): {', '.join(small[:3])}",
                             f"use images of at least {plan.resolution} px, or re-plan with --resolution {min(sides) // 8 * 8 or 8}"))
    elif sides:
        checks.append(passed(GROUP, "image sizes", f"{len(sides)} sampled: shortest side {min(sides)}-{max(sides)} px, "
                             f">= the plan's {plan.resolution} px"))
    return checks


def check_data(plan: PlanFacts, data_path: Path | None, latents: Path | None, vae: str | None, full: bool) -> list[Check]:
    checks = [check_data_mode(plan, data_path, latents, vae)]
    if data_path is not None:
        checks += check_image_folder(plan, data_path, full)
    if latents is not None:
        checks += check_latent_cache(plan, latents, vae)
    return checks


def check_latent_cache(plan: PlanFacts, latents: Path, vae: str | None) -> list[Check]:
    """The cache's manifest against the plan: same resolution (latent size), same VAE, enough samples."""
    import json

    manifest_path = latents / "manifest.json"
    if not manifest_path.is_file():
        return [failed(GROUP, "latent cache", f"{manifest_path} not found: {latents} is not a complete latent cache",
                       "make one with `dit-accel extract-latents` (an interrupted extraction leaves no manifest)")]
    manifest = json.loads(manifest_path.read_text())
    checks = []
    resolution, count = manifest.get("resolution"), manifest.get("count")
    if resolution != plan.resolution:
        checks.append(failed(GROUP, "latent resolution", f"the cache holds {resolution} px latents, the plan trains at {plan.resolution} px",
                             f"extract latents at --resolution {plan.resolution}, or re-plan with --resolution {resolution}"))
    else:
        checks.append(passed(GROUP, "latent resolution", f"{resolution} px, as planned"))
    wanted_vae = vae or plan.vae
    cache_vae = manifest.get("vae")
    if wanted_vae and cache_vae and str(cache_vae) != str(wanted_vae):
        checks.append(failed(GROUP, "latent VAE", f"the cache was encoded with {cache_vae}, the run names {wanted_vae}",
                             "re-extract with the run's VAE: latents of different VAEs live in different spaces"))
    elif cache_vae:
        checks.append(passed(GROUP, "latent VAE", f"encoded with {cache_vae}"))
    if not isinstance(count, int) or count < plan.global_batch:
        checks.append(failed(GROUP, "latent count", f"{count} latents, fewer than one global batch of {plan.global_batch}",
                             "extract more images, or re-plan with a smaller --global-batch"))
    else:
        checks.append(passed(GROUP, "latent count", f"{count} latents = {count // plan.global_batch} steps per epoch"))
    return checks
