"""A reference batch in the ADM layout (VIRTUAL_imagenet256_labeled.npz and the like) and its statistics,
computed once and cached.

The layout: `arr_0`, uint8 images (N, H, W, 3), and optionally `mu`, `sigma` (pool features) and `mu_s`,
`sigma_s` (spatial features), precomputed over a whole dataset; the ADM evaluator then takes FID and sFID
from those, and precision and recall from the images' own features (ImageNet's reference holds 10,000).

The cache holds the reference images' pool features and the four statistics, in one .npz named after the
reference and keyed by the sha256 of its content and of the Inception weights, so that a changed file or
other weights never reuse a stale entry. It is written atomically by the main process.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dit_accel.atomic import write_atomically
from dit_accel.errors import UserError
from dit_accel.evaluate.metrics import Statistics

STATISTICS_KEYS = ("mu", "sigma", "mu_s", "sigma_s")
CACHE_FORMAT = 1  # bump when what the cache holds, or how it is computed, changes


@dataclass(frozen=True)
class ReferenceBatch:
    pool: np.ndarray  # pool features of the reference images: precision and recall
    fid: Statistics
    sfid: Statistics
    num_images: int
    precomputed: bool  # fid/sfid from the .npz's own mu/sigma/mu_s/sigma_s, not from its images

    def describe(self) -> str:
        if self.precomputed:
            return f"the reference's precomputed statistics, {self.num_images:,} of its images for precision/recall"
        return f"{self.num_images:,} reference images"


def precomputed_statistics(path: Path) -> tuple[Statistics, Statistics] | None:
    """(FID, sFID) statistics stored in the reference .npz, or None when it holds none."""
    with np.load(path) as archive:
        present = [key for key in STATISTICS_KEYS if key in archive.files]
        if not present:
            return None
        if len(present) != len(STATISTICS_KEYS):
            missing = ", ".join(key for key in STATISTICS_KEYS if key not in present)
            raise UserError(
                f"the reference {path} holds {', '.join(present)} but not {missing}",
                "give it all four statistics (mu, sigma, mu_s, sigma_s) or none",
            )
        try:
            return (
                Statistics(archive["mu"].astype(np.float64), archive["sigma"].astype(np.float64)),
                Statistics(archive["mu_s"].astype(np.float64), archive["sigma_s"].astype(np.float64)),
            )
        except ValueError as error:
            raise UserError(f"the reference {path}'s statistics are malformed: {error}") from None


def file_sha256(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dit-accel" / "reference-stats"


def cache_path(reference: Path, weights_sha256: str, input_px: int, cache_dir: Path) -> Path:
    key = hashlib.sha256(f"{file_sha256(reference)} {weights_sha256} {input_px} {CACHE_FORMAT}".encode())
    return cache_dir / f"{reference.stem}-{key.hexdigest()[:16]}.npz"


def read_cache(path: Path) -> ReferenceBatch | None:
    try:
        with np.load(path) as cached:
            return ReferenceBatch(
                pool=cached["pool"],
                fid=Statistics(cached["mu"], cached["sigma"]),
                sfid=Statistics(cached["mu_s"], cached["sigma_s"]),
                num_images=len(cached["pool"]),
                precomputed=bool(cached["precomputed"]),
            )
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):  # absent or unreadable: computed again
        return None


def write_cache(path: Path, reference: ReferenceBatch) -> None:
    arrays = {
        "pool": reference.pool,
        "mu": reference.fid.mu,
        "sigma": reference.fid.sigma,
        "mu_s": reference.sfid.mu,
        "sigma_s": reference.sfid.sigma,
        "precomputed": np.array(reference.precomputed),
    }
    write_atomically(path, lambda file: np.savez(file, **arrays))
