"""Data checks: the data helper's own validation (its UserError becomes a FAIL row), images per class,
image sizes and decoding of a sample (every image with --full), and a latent cache's manifest against
the plan. The doctor never re-implements what the trainer checks: it calls the same functions.
"""

from __future__ import annotations

from pathlib import Path

from dit_accel.doctor.checks import Check, failed, gib, passed, warned
from dit_accel.doctor.decode_rate import DecodeBudget, check_decode_rate, listing_pixels
from dit_accel.doctor.plan import PlanFacts
from dit_accel.errors import UserError
from planner.units import plural

GROUP = "data"
SIZE_SAMPLE = 64  # image headers read for the size check: cheap, and enough to see a wrong folder
IMBALANCE_RATIO = 10  # the largest class 10x the smallest: sampling is uniform over images, not classes


def from_user_error(name: str, error: UserError) -> Check:
    """A refusal of the data helpers or the trainer as a FAIL row: its problem as the reason, its fix as the
    fix (`UserError.fix`)."""
    return failed(GROUP, name, error.problem, error.fix or "correct what the reason names")


def check_data_mode(plan: PlanFacts, data_path: Path | None, latents: Path | None, vae: str | None) -> Check:
    """What was passed (images or a latent cache) must be what the plan's latent mode trains on."""
    from dit_accel.train.config import TrainConfig
    from dit_accel.train.data import check_data_mode as trainer_check

    # with a latent cache, --vae names the VAE to compare the cache with, not one the trainer loads
    config = TrainConfig(
        plan=str(plan.path),
        output_dir="-",
        data_path=str(data_path) if data_path else None,
        latents=str(latents) if latents else None,
        vae=vae if data_path and not latents else None,
    )
    try:
        trainer_check(plan.plan, config)
    except UserError as error:
        return from_user_error("data vs plan", error)
    from dit_accel.data.source_kind import dataset_kind

    images = "the image folder" if dataset_kind(str(data_path)) is None else "the dataset"
    source = f"the latent cache {latents}" if latents else f"{images} {data_path}"
    return passed(GROUP, "data vs plan", f"the plan trains on {plan.latents} latents, from {source}")


def _class_counts(images_per_class: dict[str, int]) -> str:
    counts = sorted(images_per_class.values())
    return f"{len(counts)} classes, {counts[0]}-{counts[-1]} images per class"


def _class_check(plan: PlanFacts, images_per_class: dict[str, int], num_images: int) -> Check:
    """Labels must fit the model's class table; an epoch must hold at least one global batch."""
    smallest, largest = min(images_per_class.values()), max(images_per_class.values())
    if len(images_per_class) > plan.num_classes:
        return failed(
            GROUP,
            "classes",
            f"{_class_counts(images_per_class)}, but the model has {plan.num_classes} class labels",
            f"re-plan with --num-classes {len(images_per_class)}, or remove the extra classes",
        )
    if num_images < plan.global_batch:
        return failed(
            GROUP,
            "classes",
            f"{num_images} images, fewer than one global batch of {plan.global_batch}: "
            "an epoch would hold no full step",
            "add images, or re-plan with a smaller --global-batch",
        )
    if largest > IMBALANCE_RATIO * smallest:
        return warned(
            GROUP,
            "classes",
            f"{_class_counts(images_per_class)}: sampling follows images, so the largest classes dominate",
            "balance the classes if every class should be learnt equally",
        )
    return passed(
        GROUP,
        "classes",
        f"{_class_counts(images_per_class)}; {num_images // plan.global_batch} steps per epoch",
    )


def check_image_folder(
    plan: PlanFacts, data_path: Path, full: bool, options=None, budget: DecodeBudget | None = None
) -> list[Check]:
    """An image folder or a dataset (`hf_source`), checked as the trainer and extract-latents check it; with
    a `budget`, also whether this node decodes its images as fast as the plan trains."""
    from PIL import Image

    from dit_accel.data.hf_source import DatasetSummary, validate_image_source
    from dit_accel.data.source_kind import dataset_kind

    name = "image folder" if dataset_kind(data_path) is None else "dataset"
    try:
        summary = validate_image_source(data_path, options, sample=True, full=full, skip_bad_images=True)
    except UserError as error:
        return [from_user_error(name, error)]
    checks = [passed(GROUP, name, summary.describe())]
    if isinstance(summary, DatasetSummary):
        checks.append(dataset_memory(summary, str(data_path)))
        if summary.listing is None:
            return checks + _stream_checks(summary)

    total = summary.num_images + len(summary.bad_images)
    entries = "rows" if isinstance(summary, DatasetSummary) else "files"
    decoded = "every image" if full else f"sampled {summary.images_decoded} of {total} {entries}"
    remain = "" if full else f"; undecodable ones may remain among the other {total - summary.images_decoded}"
    more = "" if full else " (use --full to decode all)"
    if summary.bad_images:
        shown = ", ".join(summary.bad_images[:3])
        checks.append(
            failed(
                GROUP,
                "decoding",
                f"{len(summary.bad_images)} of {summary.images_decoded} images tried "
                f"({decoded}) do not decode: {shown}{remain}",
                "replace or delete them, or train with --skip-bad-images" + more,
            )
        )
    else:
        checks.append(
            passed(
                GROUP,
                "decoding",
                f"{summary.images_decoded} images decoded ({decoded}, the first of every class){remain}{more}"
                if not full
                else f"{summary.images_decoded} images decoded (every image)",
            )
        )

    checks.append(_class_check(plan, summary.images_per_class, summary.num_images))

    listing = summary.listing
    small, sides = [], []
    for index in range(0, len(listing), max(1, len(listing) // SIZE_SAMPLE))[:SIZE_SAMPLE]:
        try:
            with Image.open(listing.image_file(index)) as image:  # reads the header only
                width, height = image.size
        except OSError:
            continue  # decoding is the decoding row's business
        sides.append(min(width, height))
        if min(width, height) < plan.resolution:
            small.append(f"{listing.name(index)} ({width}x{height})")
    if sides and small:
        checks.append(
            warned(
                GROUP,
                "image sizes",
                f"{len(small)} of {len(sides)} sampled images are smaller than the plan's "
                f"{plan.resolution} px and will be upscaled (blurry targets): {', '.join(small[:3])}",
                f"use images of at least {plan.resolution} px, or re-plan with --resolution {min(sides) // 8 * 8 or 8}",
            )
        )
    elif sides:
        checks.append(
            passed(
                GROUP,
                "image sizes",
                f"{len(sides)} sampled: shortest side {min(sides)}-{max(sides)} px, "
                f">= the plan's {plan.resolution} px",
            )
        )
    if budget is not None:
        rate = check_decode_rate(listing_pixels(listing, plan.resolution), len(listing), budget)
        checks += [rate] if rate else []
    return checks


def dataset_memory(summary, data_path: str) -> Check:
    """What a dataset costs a rank's RAM: its row and label arrays; the Arrow table is only mapped."""
    from dit_accel.data.hf_source import resident_bytes

    if summary.listing is None:
        return passed(GROUP, "dataset memory", "a stream: a rank holds the rows in flight only")
    resident, mapped = resident_bytes(summary.listing)
    return passed(
        GROUP,
        "dataset memory",
        f"{gib(resident)} per rank resident (row and label arrays, 16 B a row); the Arrow table "
        f"({gib(mapped)}) is memory-mapped: page cache that every rank of the node shares and the kernel "
        "reclaims, not counted per rank",
    )


def _stream_checks(summary) -> list[Check]:
    """Webdataset shards: their first rows decoded; training needs latents first (it reads at random)."""
    bad = f", {len(summary.bad_images)} of them undecodable: {', '.join(summary.bad_images[:3])}"
    decoding = (
        failed(GROUP, "decoding", f"the first {summary.images_decoded} rows tried{bad}", "replace them")
        if summary.bad_images
        else passed(
            GROUP,
            "decoding",
            f"the first {summary.images_decoded} rows decode (a stream: --full is extraction)",
        )
    )
    return [
        decoding,
        warned(
            GROUP,
            "random access",
            f"{summary.kind} shards are read as a stream, so training cannot read them at random",
            f"extract latents first (`dit-accel extract-latents --data-path {summary.root} ...`), then train "
            "and check with --latents",
        ),
    ]


def check_data(
    plan: PlanFacts,
    data_path: Path | None,
    latents: Path | None,
    vae: str | None,
    full: bool,
    options=None,
    budget: DecodeBudget | None = None,
) -> list[Check]:
    checks = [check_data_mode(plan, data_path, latents, vae)]
    if data_path is not None and latents is None:  # beside --latents: REPA's images (`doctor.repa`)
        checks += check_image_folder(plan, data_path, full, options, budget)
    if latents is not None:
        checks += check_latent_cache(plan, latents, vae, full)
    return checks


def check_latent_cache(plan: PlanFacts, latents: Path, vae: str | None, full: bool) -> list[Check]:
    """The cache's manifest against the plan: complete, same resolution and latent shape, the run's VAE,
    enough samples, and with --full every shard against its checksum. The data helper's readers decide."""
    from dit_accel.data.latent_cache import check_cache_matches, read_manifest, verify_cache

    try:
        manifest = read_manifest(latents)
    except UserError as error:
        return [from_user_error("latent cache", error)]
    count = int(manifest.get("count", 0))
    checks = [
        passed(
            GROUP,
            "latent cache",
            f"{latents}: {count} images of {manifest.get('data_path', '?')}, "
            f"latents {manifest.get('latent_shape')} ({manifest.get('dtype')}), {len(manifest['shards'])} "
            f"{plural(len(manifest['shards']), 'shard')}",
        )
    ]
    try:  # the trainer's own check: resolution, latent shape, classes against the plan's model
        from dit_accel.data.latent_cache import LatentCache
        from dit_accel.train.data import check_latent_cache as trainer_check

        trainer_check(LatentCache(latents), plan.plan.spec(), str(latents))
        checks.append(
            passed(
                GROUP,
                "latent resolution",
                f"{manifest['resolution']} px, latents "
                f"{manifest.get('latent_shape')}, {len(manifest.get('classes', []))} classes, as planned",
            )
        )
    except UserError as error:
        checks.append(from_user_error("latent resolution", error))
    cached_vae = manifest.get("vae") or {}
    if vae:
        try:
            check_cache_matches(manifest, plan.resolution, vae)
            checks.append(
                passed(GROUP, "latent VAE", f"encoded with {vae} (config and weights hashes match)")
            )
        except UserError as error:
            checks.append(from_user_error("latent VAE", error))
    elif plan.vae and cached_vae.get("source") and plan.vae != cached_vae.get("source"):
        checks.append(
            warned(
                GROUP,
                "latent VAE",
                f"the plan names the VAE {plan.vae}, the cache was encoded with {cached_vae.get('source')}",
                "pass --vae PATH to compare their weights, or re-extract with the plan's VAE",
            )
        )
    else:
        checks.append(
            passed(
                GROUP,
                "latent VAE",
                f"encoded with {cached_vae.get('source', '?')} (pass --vae PATH to compare weights)",
            )
        )
    checks.append(_class_check(plan, manifest.get("images_per_class") or {"all": count}, count))
    if full:
        try:
            checked = verify_cache(latents)
            checks.append(
                passed(
                    GROUP,
                    "latent checksums",
                    f"every shard matches its sha256 ({checked / 2**20:.1f} MiB read)",
                )
            )
        except UserError as error:
            checks.append(from_user_error("latent checksums", error))
    return checks
