"""The images a latent cache was made from, read beside its latents: REPA's encoder sees the clean image.

Every shard of a cache names its entries' sources (an image folder's relative path, a dataset's `row N`).
With the folder or dataset the cache was made from (the manifest's `data_path`, or the trainer's
--data-path where it has moved), entry i's image is decoded and centre-cropped as extraction did, and
mirrored when the cache hands out its mirror view, so that the encoder sees exactly the image whose latent
the network learns from. The decode is the DataLoader workers' work, as it is for an image folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dit_accel.data.folder import load_rgb, training_pixels
from dit_accel.data.latent_cache import shard_path
from dit_accel.data.source_kind import DatasetOptions, dataset_kind
from dit_accel.errors import UserError

ROW_PREFIX = "row "  # how a dataset's entries are named (hf_source.DatasetListing.name)


def shard_sources(path: Path) -> tuple[list[str], list[int]]:
    """The `sources` a shard's metadata lists, one per entry in its order, and each source file's size as it
    was encoded (-1 where not recorded: a dataset's row, or a cache made before sizes were)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        metadata = handle.metadata() or {}
    if "sources" not in metadata:
        raise UserError(
            f"latent cache shard {path} names no source images (made before caches recorded them)",
            "extract the latents again (`dit-accel extract-latents ... --overwrite`) to train REPA from them",
        )
    names = json.loads(metadata["sources"])
    sizes = json.loads(metadata["source_bytes"]) if "source_bytes" in metadata else [-1] * len(names)
    return names, sizes


def check_source_names(names: list[str], kind: str | None, cache_dir: Path) -> None:
    """A folder's entries are relative paths inside it, a dataset's `row N`: a shard's metadata comes with
    the cache, from whoever made it, and must not make a run read files outside the images' folder. (Links
    inside the folder are followed: the folder is the run's own data, as --data-path is.)"""
    for name in names:
        if kind is None:
            bad = (
                name.startswith("/")
                or name == ".."
                or name.startswith("../")
                or "/../" in name
                or name.endswith("/..")
            )
        else:
            bad = not (name.startswith(ROW_PREFIX) and name.removeprefix(ROW_PREFIX).isdigit())
        if bad:
            raise UserError(
                f"latent cache {cache_dir} names the source image {name!r}, which is not "
                + ("a path inside the images' folder" if kind is None else "a row of the dataset"),
                "extract the latents again from the images (`dit-accel extract-latents ... --overwrite`)",
            )


class CacheImages:
    """`pixels(index, mirrored)`: entry `index`'s image in [-1, 1], CHW float32, at the cache's resolution."""

    def __init__(self, cache_dir: Path, manifest: dict, data_path: str | None, options: DatasetOptions):
        self.root = str(Path(data_path or manifest["data_path"]).expanduser())
        self.resolution = int(manifest["resolution"])
        self.kind = dataset_kind(self.root)
        if self.kind == "webdataset":
            raise UserError(
                f"latent cache {cache_dir} was made from {self.root}, a stream of tar shards, whose images cannot "
                "be read by entry",
                "extract the latents from an image folder or a save_to_disk/parquet dataset to train REPA from them",
            )
        if self.kind is None and not Path(self.root).is_dir():
            raise UserError(
                f"latent cache {cache_dir} was made from {self.root}, which is not here",
                "pass --data-path with the image folder or dataset it was made from",
            )
        self.options = DatasetOptions(
            manifest.get("split") or options.split, options.image_column, options.label_column
        )
        names, sizes = [], []
        for record in manifest["shards"]:
            shard_names, shard_sizes = shard_sources(shard_path(cache_dir, record["file"]))
            names += shard_names
            sizes += shard_sizes
        check_source_names(names, self.kind, cache_dir)
        self.sources = np.array(names, dtype=np.bytes_)  # fixed width: no per-entry objects in the workers
        self.source_bytes = np.array(sizes, dtype=np.int64)
        self._rows = None  # a dataset's split, opened in the process (or worker) that reads it

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_rows"] = None
        return state

    def __len__(self) -> int:
        return len(self.sources)

    def _open(self, name: str, recorded_bytes: int = -1):
        if self.kind is None:
            path = Path(self.root) / name
            if recorded_bytes >= 0:
                check_unchanged(path, recorded_bytes)
            return load_rgb(path, name)
        from dit_accel.data.hf_source import image_stream, open_dataset

        if self._rows is None:
            from datasets import Image as ImageFeature

            rows = open_dataset(self.root, self.options)[0]
            if isinstance((rows.features or {}).get(self.options.image_column), ImageFeature):
                rows = rows.cast_column(self.options.image_column, ImageFeature(decode=False))
            self._rows = rows
        cell = self._rows[int(name.removeprefix(ROW_PREFIX))][self.options.image_column]
        return load_rgb(image_stream(cell), f"{self.root} {name}")

    def pixels(self, index: int, mirrored: bool) -> torch.Tensor:
        image = self._open(self.sources[index].decode(), int(self.source_bytes[index]))
        return training_pixels(image, self.resolution, mirrored)


def check_unchanged(path: Path, recorded_bytes: int) -> None:
    """The image file is the size it was when its latent was encoded: REPA would otherwise align the latent
    of one image with the encoder's view of another, without a word."""
    try:
        size = path.stat().st_size
    except OSError:
        return  # load_rgb says what is wrong with a missing file
    if size != recorded_bytes:
        raise UserError(
            f"REPA's source image {path} has changed since its latent was extracted ({size:,} bytes, then "
            f"{recorded_bytes:,})",
            "restore the image, or extract the latents again (`dit-accel extract-latents ... --overwrite`)",
        )
