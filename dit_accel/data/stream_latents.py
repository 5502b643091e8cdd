"""extract-latents from a dataset read only as a stream (webdataset .tar shards): one ordered pass.

A stream's length, classes and labels are known only once it is read, so its listing (`StreamListing`)
grows as the pass goes, and the cache's shards are cut from it at the same fixed positions as from a
folder: shard k holds entries [k * shard_size, (k + 1) * shard_size). Each process reads the whole stream
in order and encodes the shards it owns (k % world_size == rank); a shard a killed run left complete is
checked (its images, VAE and settings) and kept, as for a folder. The images of one shard are held as
bytes until that shard is done, so a process holds at most one shard of encoded images in flight.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dit_accel.data.folder import center_crop_adm, image_to_uint8, load_rgb
from dit_accel.data.hf_source import DatasetSummary, image_stream, open_dataset
from dit_accel.errors import UserError

DECODE_THREADS = 4  # PIL releases the GIL while decoding


class StreamListing:
    """The rows of a stream as far as they are read: labels of all, source keys of the shard in progress."""

    streamed = True

    def __init__(self, summary: DatasetSummary, options, classes: list[str] | None):
        self.root, self.kind, self.split, self.options = summary.root, summary.kind, summary.split, options
        self.given_classes = classes  # a ClassLabel's names; None: class indices 0..max, named by number
        self.labels: list[int] = []
        self._keys: dict[int, str] = {}

    @property
    def location(self) -> str:
        return str(Path(self.root).absolute())

    @property
    def classes(self) -> list[str]:
        if self.given_classes is not None:
            return self.given_classes
        return [str(k) for k in range(max(self.labels, default=-1) + 1)]

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, index: int) -> str:
        return f"row {index}"

    def source_key(self, index: int) -> str:
        return self._keys[index]

    def class_of(self, name: str) -> str:
        return self.classes[self.labels[int(name.removeprefix("row "))]]

    def append(self, key: str, label) -> int:
        if not isinstance(label, (int, np.integer)) or label < 0:
            raise UserError(
                f"{self.root}: row {len(self.labels)} has the label {label!r}, not a class index",
                "pass --label-column with the column of class indices (webdataset: cls)",
            )
        if self.given_classes is not None and label >= len(self.given_classes):
            raise UserError(
                f"{self.root}: row {len(self.labels)} has the label {label}, outside its "
                f"{len(self.given_classes)} classes",
                "correct the labels",
            )
        self._keys[len(self.labels)] = key
        self.labels.append(int(label))
        return len(self.labels) - 1

    def forget_before(self, index: int) -> None:
        """Drop the source keys of finished shards: only the shard in progress needs them."""
        for old in [k for k in self._keys if k < index]:
            del self._keys[old]

    def summary(self) -> DatasetSummary:
        """What the pass found, for the manifest: every row counted, skipped ones taken off there."""
        counts = np.bincount(np.asarray(self.labels, dtype=np.int64), minlength=len(self.classes))
        return DatasetSummary(
            root=self.root,
            classes=self.classes,
            images_per_class={name: int(n) for name, n in zip(self.classes, counts)},
            num_images=len(self),
            images_decoded=len(self),
            bad_images=[],
            ignored_files=0,
            listing=None,
            kind=self.kind,
            split=self.split,
        )


def stream_listing(summary: DatasetSummary, options) -> StreamListing:
    from datasets import ClassLabel

    features = open_dataset(summary.root, options)[0].features or {}
    label = features.get(options.label_column)
    return StreamListing(summary, options, list(label.names) if isinstance(label, ClassLabel) else None)


def stream_batches(layout, present: list[int], config, result, records: list, reuse, collate):
    """The batches of the shards this process owns and must encode, in stream order, each batch within one
    shard, as `latents._encode_shards` takes them. Owned shards found complete and valid (`reuse`) are put in
    `records` and `result.shards_reused` as the pass reaches them, and not encoded again."""
    from datasets import Image as ImageFeature

    listing: StreamListing = layout.listing
    options = listing.options
    rows, _, _ = open_dataset(listing.root, options)
    if isinstance((rows.features or {}).get(options.image_column), ImageFeature):
        rows = rows.cast_column(options.image_column, ImageFeature(decode=False))

    def decode(item):
        index, cell, label = item
        try:
            image = load_rgb(image_stream(cell), f"{listing.root} row {index}")
        except UserError as error:
            return torch.empty(0, dtype=torch.uint8), label, index, str(error)
        return image_to_uint8(center_crop_adm(image, config.resolution)), label, index, ""

    def shard_of(row_and_index) -> int:
        return row_and_index[1] // layout.shard_size

    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        for shard, group in itertools.groupby(zip(rows, itertools.count()), key=shard_of):
            held = []
            for row, index in group:
                key = f"{Path(row.get('__url__') or '').name}/{row.get('__key__', index)}"
                listing.append(key, row[options.label_column])
                if shard % layout.world_size == layout.rank:
                    held.append((index, row[options.image_column], int(row[options.label_column])))
            if not held:
                continue
            listing.forget_before(held[0][0])
            if shard in present:  # the listing holds the whole shard now: the last one once the stream ended
                record = reuse(layout, shard)
                if record is not None:
                    records.append(record)
                    result.shards_reused.append(shard)
                    continue
            for start in range(0, len(held), config.batch_size):
                items = list(pool.map(decode, held[start : start + config.batch_size]))
                yield collate(items)
