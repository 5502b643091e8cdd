"""The training data a plan reads: the dataset of its latent mode, checked against the plan, and the
DataLoader that feeds it to one rank in the keyed order of `dit_accel.data.order`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from dit_accel.data.order import Collate, KeyedSamples, OrderedBatches, SampleNoise, SampleOrder
from dit_accel.errors import UserError
from dit_accel.run.preemption import WorkerShield
from dit_accel.train.config import (
    DEFAULT_NUM_WORKERS,
    TrainConfig,
    loader_workers,
    parse_signals,
    usable_cpus,
)
from planner.planfile import Plan
from planner.units import count

log = logging.getLogger("dit_accel.train")


def check_data_mode(plan: Plan, config: TrainConfig) -> None:
    """The data the user passed must be what the plan's latent mode expects."""
    mode = plan.decision.latents
    if mode == "precomputed" and not config.latents:
        raise UserError(
            "the plan trains on precomputed latents",
            "pass --latents DIR (from `dit-accel extract-latents`), or re-plan with `dit-plan --latents "
            "online` / `--latents pixel` for an image folder",
        )
    if mode in ("online", "pixel") and not config.data_path:
        raise UserError(
            f"the plan trains on {'images encoded online' if mode == 'online' else 'pixels'}",
            "pass --data-path DIR, or re-plan with `dit-plan --latents precomputed` to train on --latents",
        )
    if mode in ("online", "pixel") and config.latents:  # REPA beside images: they are the encoder's already
        raise UserError(
            f"--latents is given but the plan trains on {mode} latents from --data-path",
            "drop --latents, or re-plan with `dit-plan --latents precomputed` to train on the cache",
        )
    if mode == "online" and not config.vae:
        raise UserError(
            "the plan encodes images online with a VAE",
            "pass --vae DIR (a diffusers AutoencoderKL folder), or precompute latents with `dit-accel "
            "extract-latents` and re-plan with --latents precomputed",
        )
    from dit_accel.data.latent_cache import PUBLISHED_STATS

    published = mode == "precomputed" and (Path(config.latents).expanduser() / PUBLISHED_STATS).is_file()
    if mode != "online" and config.vae and not published:  # published latents name no VAE: --vae decodes
        raise UserError(
            f"--vae is only used when the plan encodes online, but this plan's latents are {mode!r}",
            "drop --vae",
        )


def check_inputs(plan: Plan, config: TrainConfig) -> None:
    """Everything about the run's inputs that costs a glance, before a process, a model or a run folder
    exists (`dit-accel train` asks it before it launches; each rank again before its run folder): the data
    the plan's mode reads (`check_data_mode`), a latent cache's manifest, an image folder or dataset that is
    there with its columns, REPA's encoder file. Reading the data itself stays the ranks' (and the
    doctor's)."""
    from dit_accel.repa.training import check_encoder_flag

    check_data_mode(plan, config)
    check_encoder_flag(plan.decision.repa, config.repa_encoder)
    if config.repa_encoder and not Path(config.repa_encoder).expanduser().is_file():
        raise UserError(
            f"--repa-encoder {config.repa_encoder} is not a file",
            "pass the encoder's published weights (e.g. dinov2_vitb14_pretrain.pth; docs/recipes.md)",
        )
    if config.latents:
        from dit_accel.data.latent_cache import read_manifest

        read_manifest(config.latents)  # there, complete, and a cache (an image folder is named as one)
    if config.data_path:
        from dit_accel.data.source_kind import DatasetOptions, dataset_kind

        kind = dataset_kind(config.data_path)
        if kind is None and not Path(config.data_path).expanduser().is_dir():
            raise UserError(
                f"--data-path {config.data_path} does not exist",
                "pass an image folder (one sub-folder per class) or a dataset (docs/data.md)",
            )
        if kind is not None:
            from dit_accel.data.hf_source import check_dataset_columns

            check_dataset_columns(
                config.data_path, DatasetOptions(config.split, config.image_column, config.label_column)
            )


def build_dataset(plan: Plan, config: TrainConfig, spec, index_dir=None, once=None):
    """The dataset the plan's latent mode reads, checked against the plan (resolution, VAE, classes).

    An image folder with `index_dir` and `once` (`once(fn)` runs fn on the main process, every rank waiting,
    as `consensus.main_decides` does): the folder is listed and checked once, by the main process, into an
    index there (`data.folder.write_folder_index`) that every rank memory-maps, instead of once per rank."""
    if plan.decision.latents == "precomputed":
        from dit_accel.data.latent_cache import LatentCache

        dataset = LatentCache(config.latents, flip=True, seed=None)  # unseeded: KeyedSamples seeds per sample
        check_latent_cache(dataset, spec, config.latents)
        if config.hflip and dataset.views != 2:
            raise UserError(
                f"--hflip asks for mirror images but latent cache {config.latents} was made with --no-hflip "
                f"(it holds no mirror images)",
                "drop --hflip (or pass --no-hflip), or re-extract the cache with --hflip",
            )
        # A two-view cache flips unless told not to; --no-hflip then reads the images only.
        dataset.flip = dataset.views == 2 and config.hflip is not False
        if plan.decision.repa and dataset.published:
            raise UserError(
                f"REPA needs each latent's source image, and the published latents {config.latents} name none",
                "extract your own cache from the images (extract-latents records each source), or train without REPA",
            )
        if plan.decision.repa:  # REPA's encoder sees each latent's image: the cache names its source
            from dit_accel.data.cache_images import CacheImages
            from dit_accel.data.source_kind import DatasetOptions

            options = DatasetOptions(config.split, config.image_column, config.label_column)
            dataset.images = CacheImages(dataset.dir, dataset.manifest, config.data_path, options)
    else:
        from dit_accel.data.folder import (
            ImageFolderData,
            read_folder_index,
            validate_image_folder,
            write_folder_index,
        )
        from dit_accel.data.source_kind import dataset_kind

        if dataset_kind(config.data_path) is not None:
            return _dataset_rows(config, spec, once)
        summary = records = None
        if index_dir is not None and once is not None:

            def list_the_folder() -> None:
                checked = validate_image_folder(
                    config.data_path, sample=True, skip_bad_images=config.skip_bad_images
                )
                write_folder_index(checked, index_dir)
                log.info(f"listed once for every rank: {checked.describe()}; index {index_dir}")

            once(list_the_folder)
            summary, records = read_folder_index(index_dir)
        # Unseeded flips draw from torch's RNG, which KeyedSamples seeds per sample: exact on resume.
        dataset = ImageFolderData(
            config.data_path,
            spec.resolution,
            flip=config.hflip is not False,
            seed=None,
            skip_bad_images=config.skip_bad_images,
            max_bad_images=config.max_bad_images,
            summary=summary,
            records=records,
        )
        _check_classes(dataset, config, spec)
    return dataset


def _check_classes(dataset, config: TrainConfig, spec) -> None:
    classes = len(dataset.classes)
    if classes > spec.num_classes:
        raise UserError(
            f"{config.data_path} has {classes} classes but the plan's model has {spec.num_classes}",
            f"re-plan with `dit-plan --num-classes {classes}`",
        )


def _dataset_rows(config: TrainConfig, spec, once=None):
    """A Hugging Face dataset's split as pixels (`hf_source.DatasetImageData`). With `once`, the main process
    checks it first (and converts parquet into datasets' Arrow cache), so the other ranks open it from there."""
    from dit_accel.data.hf_source import DatasetImageData, DatasetOptions, training_refusal, validate_dataset

    options = DatasetOptions(config.split, config.image_column, config.label_column)

    def check() -> object:
        summary = validate_dataset(
            config.data_path, options, sample=True, skip_bad_images=config.skip_bad_images
        )
        training_refusal(summary, config.data_path)
        return summary

    checked = []  # the main process's own summary, which it need not make twice

    def on_main() -> None:
        checked.append(check())
        log.info(f"checked on the main process first: {checked[0].describe()}")

    if once is not None:
        once(on_main)
    dataset = DatasetImageData(
        checked[0] if checked else check(),  # every rank drops the same undecodable rows
        spec.resolution,
        flip=config.hflip is not False,
        seed=None,
        skip_bad_images=config.skip_bad_images,
        max_bad_images=config.max_bad_images,
    )
    _check_classes(dataset, config, spec)
    return dataset


def data_fingerprint(dataset) -> dict:
    """What the run reads, in a few bytes for its checkpoints' train state: where (`source`), how many entries,
    and a sha256 of their identities in order (a latent cache's shard checksums and normalisation, wherever
    it lies; images: their place, and a dataset's fingerprint, rows and labels or a folder's paths and
    labels, and for a folder the bytes of 64 sampled images, `sampled_sha256`), so that a resume on other or
    reordered data is announced (`resume.restore`), not silent."""
    import hashlib

    from dit_accel.data.latent_cache import LatentCache

    digest, sampled = hashlib.sha256(), None
    if isinstance(dataset, LatentCache):
        source = str(dataset.dir.resolve())
        shards = [[r["file"], r["count"], r.get("sha256", r["bytes"])] for r in dataset.manifest["shards"]]
        digest.update(json.dumps([shards, dataset.manifest.get("latent_norm")]).encode())
    else:  # images: where they are is part of what they are (a listing names files, it holds no checksums)
        records, source = dataset.records, str(Path(dataset.root).resolve())
        if hasattr(records, "rows"):  # a dataset's listing (hf_source.DatasetListing)
            source = records.location
        digest.update(source.encode())
        if hasattr(records, "rows"):
            digest.update(f"{records.fingerprint}:{records.split}".encode())
            digest.update(np.asarray(records.rows, dtype=np.int64).tobytes())
            digest.update(np.asarray(records.labels, dtype=np.int64).tobytes())
        else:  # an image folder's listing: a datasets.Dataset of paths and labels
            paths = records.data.column("path").to_pylist()
            digest.update("\n".join(paths).encode())
            digest.update(np.asarray(records.data.column("label").to_pylist(), dtype=np.int64).tobytes())
            sampled = sampled_contents(Path(dataset.root), paths).hex()
    found = {"source": source, "entries": len(dataset), "sha256": digest.hexdigest()}
    return found if sampled is None else dict(found, sampled_sha256=sampled)


FINGERPRINT_IMAGES = 64  # images whose bytes join an image folder's fingerprint
FINGERPRINT_BYTES = 1 << 16  # of each, its size and first 64 KiB


def sampled_contents(root: Path, paths: list[str]) -> bytes:
    """A sha256 over the size and first 64 KiB of 64 images spread over the listing: an image replaced under
    its name is caught when it is one of those, at 64 small reads per start, not a read of the data set."""
    import hashlib

    digest = hashlib.sha256()
    picked = sorted({int(i) for i in np.linspace(0, len(paths) - 1, FINGERPRINT_IMAGES)}) if paths else []
    for index in picked:
        path = root / paths[index]
        try:
            with path.open("rb") as handle:
                digest.update(f"{path.stat().st_size}:".encode() + handle.read(FINGERPRINT_BYTES))
        except OSError:
            digest.update(b"unreadable")  # the loader names it when it reads it
    return digest.digest()


def data_change(recorded: dict | None, current: dict) -> str:
    """How the data read now differs from what a checkpoint recorded, as a sentence; "" when it does not (or
    the checkpoint recorded none)."""
    if not recorded:
        return ""
    if recorded.get("sha256") == current["sha256"]:
        before, now = recorded.get("sampled_sha256"), current.get("sampled_sha256")
        if before and now and before != now:
            return (
                f"the data changed on resume (the same {current['entries']:,} images by name, some of them with "
                f"other contents: {FINGERPRINT_IMAGES} sampled images' bytes differ)"
            )
        return ""
    changes = []
    if recorded.get("source") != current["source"]:
        changes.append(f"source {recorded.get('source')} -> {current['source']}")
    if recorded.get("entries") != current["entries"]:
        changes.append(f"{recorded.get('entries'):,} -> {current['entries']:,} entries")
    if not changes:
        changes.append(f"the same {current['entries']:,} entries, other ones or in another order")
    return "the data changed on resume (" + "; ".join(changes) + ")"


def check_latent_cache(cache, spec, path: str) -> None:
    """The cache must hold what the plan's model takes: resolution, latent shape, classes."""
    from dit_accel.data.latent_cache import check_cache_matches

    check_cache_matches(cache.manifest, spec.resolution)  # resolution; its message says how to fix it
    expected = (spec.in_channels, spec.latent_size, spec.latent_size)
    if tuple(cache.latent_shape) != expected:
        raise UserError(
            f"latent cache {path} holds latents of shape {tuple(cache.latent_shape)} but the plan's "
            f"model takes {expected}",
            "re-plan for this cache, or extract latents with a matching VAE",
        )
    if len(cache.classes) > spec.num_classes:
        raise UserError(
            f"latent cache {path} has {len(cache.classes)} classes but the plan's model has "
            f"{spec.num_classes}",
            f"re-plan with `dit-plan --num-classes {len(cache.classes)}`",
        )


class _OneLineErrorLoader(torch.utils.data.DataLoader):
    """A DataLoader whose workers' UserErrors (a bad image, too many bad images) come back as the one line
    they were, not as the worker's whole traceback that torch re-raises them with."""

    def __iter__(self):
        iterator = super().__iter__()
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except UserError as error:
                last = [line for line in str(error).splitlines() if line.strip()][-1]
                raise UserError(last.split("UserError: ", 1)[-1]) from None
            yield batch


def make_loader(
    dataset,
    order: SampleOrder,
    noise: SampleNoise,
    config: TrainConfig,
    start_step: int,
    rank: int,
    device: torch.device,
) -> torch.utils.data.DataLoader:
    """This rank's micro-batches from `start_step` on, forever, each with its samples' own randomness. The
    workers ignore the run's stop signals (`preemption.WorkerShield`): the rank saves, then ends them. The
    loader draws its workers' base seed from its own generator, not torch's global RNG, so a resumed run's
    global RNG (saved in random_states_R.pkl) stays the straight run's."""
    ranks_per_node, cpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), usable_cpus()
    workers = loader_workers(config.num_workers, ranks_per_node, cpus)
    if config.num_workers is None and workers < DEFAULT_NUM_WORKERS:
        log.info(
            f"{count(workers, 'DataLoader worker')} per rank instead of {DEFAULT_NUM_WORKERS}: "
            f"{count(cpus, 'CPU')} for {count(ranks_per_node, 'rank')} on this node (--num-workers N to choose)"
        )
    return _OneLineErrorLoader(
        KeyedSamples(dataset, config.seed),
        batch_sampler=OrderedBatches(order, start_step, rank),
        collate_fn=Collate(noise),
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=WorkerShield(parse_signals(config.preempt_signals)),
        generator=torch.Generator().manual_seed(config.seed + rank),
    )
