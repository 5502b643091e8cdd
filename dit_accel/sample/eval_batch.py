"""The evaluation batch of `sample --npz`: num_samples images cut into fixed batches of global indices, each
finished batch one shard file written atomically, assembled once into the ADM layout (`arr_0` images, `arr_1`
labels); a rerun with any number of processes skips the shards that exist."""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from dit_accel.atomic import write_atomically, write_json_atomically
from dit_accel.errors import UserError
from dit_accel.sample.generate import balanced_labels, random_labels


# --- the evaluation batch: shards per batch, assembled once ---------------------------------------------
@dataclass(frozen=True)
class EvalBatch:
    """num_samples images cut into fixed batches of global indices [b*batch_size, (b+1)*batch_size).

    Batch b belongs to rank b % world_size; each finished batch is one shard file written atomically, so a
    rerun (with any number of processes) skips what exists and a kill loses at most the batches in flight.
    """

    npz_path: Path | None  # None: scored (--evaluate) and not kept
    num_samples: int
    batch_size: int
    classes: tuple[int, ...]  # the labels to draw from (usually every class of the model)
    seed: int
    label_mode: str = "balanced"  # or "random", as the papers draw them

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    @property
    def shard_dir(self) -> Path:
        return self.npz_path.with_name(self.npz_path.name + ".parts")

    @cached_property
    def labels(self) -> np.ndarray:
        draw = random_labels if self.label_mode == "random" else balanced_labels
        return np.asarray(self.classes, dtype=np.int64)[draw(self.num_samples, len(self.classes), self.seed)]

    def indices(self, batch: int) -> range:
        return range(batch * self.batch_size, min((batch + 1) * self.batch_size, self.num_samples))

    def batches_for_rank(self, rank: int, world_size: int) -> list[int]:
        return list(range(rank, self.num_batches, world_size))

    def shard_path(self, batch: int) -> Path:
        return self.shard_dir / f"batch_{batch:06d}.npz"

    def shard_is_done(self, batch: int) -> bool:
        """A shard counts when it exists (it was renamed into place whole) and holds the expected labels."""
        path = self.shard_path(batch)
        if not path.exists():
            return False
        try:
            with np.load(path) as shard:
                expected = self.labels[self.indices(batch).start : self.indices(batch).stop]
                return shard["images"].shape[0] == len(expected) and np.array_equal(shard["labels"], expected)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            return False

    def read_shard(self, batch: int) -> np.ndarray:
        with np.load(self.shard_path(batch)) as shard:
            return shard["images"]

    def save_shard(self, batch: int, images: np.ndarray, labels: np.ndarray) -> None:
        write_atomically(self.shard_path(batch), lambda file: np.savez(file, images=images, labels=labels))

    def check_or_write_settings(self, fingerprint: dict, write: bool) -> None:
        """Shards of another job (other checkpoint, seed, cfg...) must never be mixed into this one."""
        settings_path = self.shard_dir / "settings.json"
        if settings_path.exists():
            found = json.loads(settings_path.read_text())
            if found != fingerprint:
                changed = sorted(
                    key for key in set(found) | set(fingerprint) if found.get(key) != fingerprint.get(key)
                )
                raise UserError(
                    f"{self.shard_dir} holds shards made with other settings ({', '.join(changed)} differ): "
                    f"rerun with the same settings to resume, or delete {self.shard_dir} to start over"
                )
        elif write:
            write_json_atomically(settings_path, fingerprint)

    def assemble(self) -> Path:
        """Stream every shard, in global order, into npz_path (arr_0 images, arr_1 labels), then drop the shards.

        Streaming keeps host memory at one shard: 50,000 images of 256 px are 9.8 GB.
        """
        missing = [batch for batch in range(self.num_batches) if not self.shard_path(batch).exists()]
        if missing:
            raise UserError(
                f"{len(missing)} of {self.num_batches} batches are missing in {self.shard_dir} "
                f"(first: {missing[0]}): rerun the same command to make them"
            )
        with np.load(self.shard_path(0)) as first:
            image_shape = first["images"].shape[1:]
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
            "fortran_order": False,
            "shape": (self.num_samples, *image_shape),
        }

        def write(file) -> None:
            with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
                written = 0
                with archive.open("arr_0.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array_header_1_0(member, header)
                    for batch in range(self.num_batches):
                        with np.load(self.shard_path(batch)) as shard:
                            images = shard["images"]
                        if images.shape[1:] != image_shape or images.dtype != np.uint8:
                            raise UserError(
                                f"{self.shard_path(batch)} holds {images.dtype} images of shape "
                                f"{images.shape[1:]}, expected uint8 {image_shape}: delete it and rerun"
                            )
                        member.write(np.ascontiguousarray(images).tobytes())
                        written += len(images)
                if written != self.num_samples:
                    raise UserError(
                        f"the shards in {self.shard_dir} hold {written} images, expected "
                        f"{self.num_samples}: delete {self.shard_dir} and rerun"
                    )
                with archive.open("arr_1.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, self.labels)

        write_atomically(self.npz_path, write)
        shutil.rmtree(self.shard_dir, ignore_errors=True)
        return self.npz_path
