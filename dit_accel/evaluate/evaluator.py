"""`Evaluator`: what `dit-accel evaluate`, `sample --evaluate` and training's `--eval-every` share: the
Inception network on this rank's device, the reference batch's statistics (cached), and the five numbers.

Every rank extracts features of its share; the scores are computed on the main process only (the
precision/recall k-NN over 50,000 x 10,000 pool features wants one GPU, not eight copies of the work), and
`score` returns None on the other ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dit_accel.errors import UserError
from dit_accel.evaluate import PAPER_SAMPLES, metrics
from dit_accel.evaluate.features import ADM_BATCH, FeatureCollector, Features, NpzImages, npz_features
from dit_accel.evaluate.inception import INPUT_PX, load_inception
from dit_accel.evaluate.reference import (
    ReferenceBatch,
    cache_path,
    default_cache_dir,
    file_sha256,
    precomputed_statistics,
    read_cache,
    write_cache,
)
from dit_accel.evaluate.weights import default_weights_path

__all__ = ["PAPER_SAMPLES", "Evaluator", "check_enough"]


PLUMBING = "a random Inception network (--plumbing-check): NOT an FID, NOT an Inception Score"


class Evaluator:
    """The network and the reference statistics. `plumbing`: a random network instead of the published
    weights (`inception.random_inception`, its BatchNorm fitted to the reference's first images when the
    reference is read), so the whole path runs offline; every number it gives is labelled as no metric."""

    def __init__(
        self,
        accelerator=None,
        weights: str | Path | None = None,
        batch_size: int = ADM_BATCH,
        cache_dir: str | Path | None = None,
        input_px: int = INPUT_PX,
        plumbing: bool = False,
    ):
        self.accelerator = accelerator
        self.device = accelerator.device if accelerator else "cpu"
        self.plumbing = plumbing
        self.weights = PLUMBING if plumbing else Path(weights) if weights else default_weights_path()
        self.network = None if plumbing else load_inception(self.weights, self.device, input_px)
        self.weights_sha256 = "plumbing" if plumbing else file_sha256(self.weights)
        self.batch_size, self.input_px = batch_size, input_px
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.is_main = accelerator is None or accelerator.is_main_process

    def _wait(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def collector(self) -> FeatureCollector:
        """For features of images made on the fly (sampling): `add` each batch, then `gathered`."""
        return FeatureCollector(self.network, self.device)

    def gathered(self, collector: FeatureCollector) -> Features:
        return collector.gathered(self.accelerator)

    def npz_features(self, images: NpzImages, desc: str) -> Features:
        return npz_features(images, self.network, self.accelerator, self.batch_size, desc)

    def reference(self, path: str | Path, image_px: int | None = None) -> ReferenceBatch:
        """The reference batch's statistics: from the cache when an entry for this file and these weights
        exists, else computed (its images' features; FID/sFID statistics from the .npz when it holds them)
        and cached by the main process. Checked whole before any sample is made: its images' side against
        `image_px` (the samples'), and its statistics' shapes and values (`check_statistics`)."""
        path = Path(path)
        images = NpzImages(path, "the reference")
        if image_px is not None:
            check_same_side(images, image_px, path)
        if self.plumbing:  # fitted to the reference itself; nothing cached
            from dit_accel.evaluate.inception import random_inception

            self.network = random_inception(images.read(0, min(len(images), 64)), self.device)
        cached_at = cache_path(path, self.weights_sha256, self.input_px, self.cache_dir)
        cached = None if self.plumbing else read_cache(cached_at)
        if cached is not None:
            check_statistics(cached.fid, cached.sfid, self.network.feature_widths, cached_at)
            return cached
        check_enough(len(images), "the reference")
        precomputed = precomputed_statistics(path)
        if precomputed is not None:  # before the reference's features are computed
            check_statistics(*precomputed, self.network.feature_widths, path)
        features = self.npz_features(images, desc="reference features")
        fid, sfid = precomputed or (metrics.statistics(features.pool), metrics.statistics(features.spatial))
        reference = ReferenceBatch(features.pool, fid, sfid, len(features), precomputed is not None)
        if self.is_main and not self.plumbing:
            try:
                write_cache(cached_at, reference)
            except OSError as error:
                print(
                    f"! reference statistics not cached at {cached_at} ({error}); pass --cache-dir DIR",
                    flush=True,
                )
        self._wait()
        return reference

    def score(self, samples: Features, reference: ReferenceBatch) -> dict | None:
        """The five numbers of `samples` against `reference` (main process; None elsewhere)."""
        if not self.is_main:
            return None
        check_enough(len(samples), "the samples")
        import torch

        sample_fid = metrics.statistics(samples.pool)
        sample_sfid = metrics.statistics(samples.spatial)
        precision, recall = metrics.precision_recall(
            torch.as_tensor(reference.pool, device=self.device),
            torch.as_tensor(samples.pool, device=self.device),
        )
        return {
            "fid": metrics.frechet_distance(sample_fid, reference.fid),
            "sfid": metrics.frechet_distance(sample_sfid, reference.sfid),
            "inception_score": metrics.inception_score(metrics.softmax(samples.logits)),
            "precision": precision,
            "recall": recall,
            "num_samples": len(samples),
            "num_reference": reference.num_images,
            "reference_statistics": "precomputed" if reference.precomputed else "computed from its images",
            "inception_score_splits": math.ceil(len(samples) / metrics.IS_SPLIT_SIZE),
        } | ({"plumbing_check": PLUMBING} if self.plumbing else {})


def check_enough(count: int, what: str) -> None:
    """Precision and recall need more than k = 3 images a side (FID needs 2)."""
    least = metrics.NEAREST_NEIGHBOUR_K + 1
    if count < least:
        holds = "hold" if what.endswith("samples") else "holds"
        raise UserError(
            f"{what} {holds} {count} image{'' if count == 1 else 's'}: the k = {metrics.NEAREST_NEIGHBOUR_K} "
            f"precision/recall needs at least {least}",
            f"score {PAPER_SAMPLES:,} samples, as the papers do",
        )


def check_same_side(images: NpzImages, image_px: int, path: Path) -> None:
    """FID compares like with like: a reference made at another resolution scores samples against other
    images (the ADM evaluator resizes both to 299 px, so nothing else would say so)."""
    height, width = images.shape[1:3]
    if (height, width) != (image_px, image_px):
        raise UserError(
            f"the reference {path} holds {height} x {width} images but the samples are {image_px} x {image_px}",
            f"pass the reference batch made at {image_px} px (ADM's VIRTUAL_imagenet{image_px}_labeled.npz)",
        )


def check_statistics(fid: metrics.Statistics, sfid: metrics.Statistics, widths, path: Path) -> None:
    """mu (D,) and sigma (D, D) of the pool (FID) and spatial (sFID) features, every value finite: a
    malformed reference once failed with a traceback after all sampling, or scored FID nan."""
    pool, spatial, _ = widths
    for name, statistics, width in (("mu/sigma", fid, pool), ("mu_s/sigma_s", sfid, spatial)):
        mu, sigma = np.asarray(statistics.mu), np.asarray(statistics.sigma)
        if mu.shape != (width,) or sigma.shape != (width, width):
            raise UserError(
                f"the reference {path}'s {name} have shapes {mu.shape} and {sigma.shape}, the Inception "
                f"features {(width,)} and {(width, width)}",
                "use a reference batch made for the ADM evaluator (or one without precomputed statistics)",
            )
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            raise UserError(
                f"the reference {path}'s {name} hold NaN or infinite values",
                "use an intact reference batch (or one without precomputed statistics)",
            )


class Scorer:
    """Images scored as they are made (`sample --evaluate`, training's `--eval-every`): every rank `add`s the
    uint8 batches it sampled with their global indices; `scores` gathers the features and computes the five
    numbers on the main process (None elsewhere). The reference is read (or its cached statistics loaded)
    when the scorer is made, so a bad reference or missing weights stop the command before any sampling."""

    def __init__(
        self,
        accelerator,
        reference: str | Path,
        weights: str | Path | None = None,
        batch_size: int = ADM_BATCH,
        cache_dir: str | Path | None = None,
        input_px: int = INPUT_PX,
        num_samples: int | None = None,
        image_px: int | None = None,
        plumbing: bool = False,
        reference_flag: str = "--evaluate",
    ):
        from dit_accel.evaluate.weights import check_evaluation_files

        if num_samples is not None:
            check_enough(num_samples, "the samples")
        if plumbing:
            if not Path(reference).is_file():
                raise UserError(f"{reference_flag} {reference} does not exist", "pass a reference batch .npz")
        else:  # every missing file named at once
            check_evaluation_files(reference, weights, reference_flag)
        self.reference_path = Path(reference)
        self.evaluator = Evaluator(accelerator, weights, batch_size, cache_dir, input_px, plumbing)
        self.reference = self.evaluator.reference(self.reference_path, image_px)
        self.collector = self.evaluator.collector()

    @classmethod
    def from_flags(cls, accelerator, args, image_px: int) -> Scorer:
        """`sample --evaluate`'s: its reference, weights, batch size, cache, Inception input and count."""
        return cls(
            accelerator,
            args.evaluate,
            args.inception_weights,
            args.batch_size,
            args.cache_dir,
            args.input_px,
            args.num_samples,
            image_px,
            args.plumbing_check,
        )

    def add(self, images, indices) -> None:
        """uint8 (n, H, W, 3) images, in Inception batches of at most the evaluator's batch size."""
        size = self.evaluator.batch_size
        indices = list(indices)
        for start in range(0, len(indices), size):
            self.collector.add(images[start : start + size], indices[start : start + size])

    def scores(self) -> dict | None:
        """The scores of every image added since the last call, on every rank's call (a collective)."""
        features = self.evaluator.gathered(self.collector)
        self.collector = self.evaluator.collector()
        return self.evaluator.score(features, self.reference)

    def finish(self, out: str | Path | None, about: dict) -> dict | None:
        """`scores`, then on the main process the evaluator's table and its JSON (`about` first, then the
        numbers, then what they were measured with)."""
        from dit_accel.evaluate.report import report

        scores = self.scores()
        if scores is not None:
            scores = {**about, "reference": str(self.reference_path), **scores}
            scores["inception_weights"] = str(self.evaluator.weights)
            report(scores, self.reference, out)
        return scores
