"""Hugging Face datasets as image sources for `--data-path`: a `Dataset.save_to_disk` folder, parquet files
(a file, a folder of them, or a glob: the Hub's ImageNet-1k layout), webdataset `.tar` shards, or a Hub name
already in the local cache. Many users hold their images this way and should not have to write a million
files back to disk to train.

Everything is read with `datasets` from local files only: nothing is downloaded at run time (a Hub name is
resolved from the local cache, offline). Rows are listed in the dataset's own order, and images decode with
the image folders' own code (`folder.load_rgb`, then the same ADM crop), so the same images give the same
pixels, latents and training run in either form.

Random access: a `save_to_disk` folder is memory-mapped as it is; parquet files are converted once into
datasets' Arrow cache (HF_DATASETS_CACHE, default ~/.cache/huggingface/datasets, keyed by the files) and
memory-mapped from there, so the keyed sample order, exact resume and seeded flips hold as for folders.
Webdataset shards are read as a stream only: extraction makes one ordered pass; training refuses them.

A split is chosen with `--split NAME`; without it, `train` when the dataset has one, else its only split.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from dit_accel.data.folder import FolderSummary, ImageFolderData, load_rgb, validate_image_folder
from dit_accel.data.source_kind import PARQUET, TAR, DatasetOptions, dataset_kind
from dit_accel.errors import UserError
from planner.units import count

STREAMED = ("webdataset",)  # kinds read as a stream: no random access
STREAM_SAMPLE_ROWS = 16  # rows a stream's check decodes: its classes are not known before a whole pass
_DATASET_HINT = "a save_to_disk folder, parquet files (FILE, DIR or glob) or webdataset .tar shards"


def _data_files(text: str, suffix: str) -> dict[str, list[str]]:
    """Split name -> files: a file or a glob is one split (named by --split, else train); a folder's files
    are split as the Hub names them (data/train-00000-of-00010.parquet, ...)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    if glob.has_magic(text) or Path(text).is_file():
        files = sorted(name for name in glob.glob(text, recursive=True) if name.endswith(suffix))
        return {"": files}  # "" : the split the user names
    patterns = get_data_patterns(text)
    found = DataFilesDict.from_patterns(patterns, base_path=text)
    return {
        str(split): sorted(name for name in files if name.endswith(suffix)) for split, files in found.items()
    }


def _choose_split(splits: list[str], wanted: str | None, where: str) -> str:
    if wanted is not None:
        if wanted not in splits:
            raise UserError(
                f"{where} has no split {wanted!r} (it has {', '.join(splits)})",
                f"pass --split {splits[0]}"
                if len(splits) == 1
                else f"pass --split with one of {', '.join(splits)}",
            )
        return wanted
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise UserError(
        f"{where} holds the splits {', '.join(splits)} and none is called train",
        "pass --split NAME to choose one",
    )


def open_dataset(path: str | os.PathLike, options: DatasetOptions):
    """(the split as a `datasets.Dataset`, or an `IterableDataset` for a stream; its kind; its split name)."""
    import datasets

    datasets.config.HF_HUB_OFFLINE = True  # never the network: local files, or the local cache only
    datasets.utils.logging.disable_progress_bar()  # its bars on stderr are noise among a run's own lines
    text = os.path.expanduser(str(path))
    kind = dataset_kind(text)
    if kind == "saved":
        try:
            loaded = datasets.load_from_disk(text)
        except IndexError:  # what datasets raises for a saved split of no rows
            raise _empty(text, options.split) from None
        if isinstance(loaded, datasets.DatasetDict):
            split = _choose_split(list(loaded), options.split, text)
            return loaded[split], kind, split
        return loaded, kind, options.split or str(loaded.split or "train")
    if kind == "hub":
        try:
            loaded = datasets.load_dataset(text)
        except Exception as error:  # datasets raises many kinds for "not there, and offline"
            raise UserError(
                f"--data-path {text} is neither a folder nor a dataset in the local Hugging Face cache "
                f"({type(error).__name__})",
                f"pass a local folder, or fetch it once where there is a network: `huggingface-cli download "
                f"--repo-type dataset {text}`",
            ) from None
        split = _choose_split(list(loaded), options.split, text)
        return loaded[split], kind, split
    suffix = PARQUET if kind == "parquet" else TAR
    files = _data_files(text, suffix)
    if "" in files:
        files = {options.split or "train": files[""]}
    split = _choose_split(sorted(files), options.split, text)
    if not files[split]:
        raise UserError(f"no {suffix} files in {text} for the split {split}", "pass the files themselves")
    builder = "parquet" if kind == "parquet" else "webdataset"
    try:
        loaded = datasets.load_dataset(
            builder, data_files={split: files[split]}, split=split, streaming=kind in STREAMED
        )
    except ValueError as error:
        if "corresponds to no data" in str(error):  # what datasets raises for files of no rows
            raise _empty(text, split) from None
        raise
    return loaded, kind, split


def _empty(where: str, split: str | None) -> UserError:
    return UserError(
        f"{where} (split {split or 'train'}) is empty", "pass a split that holds images (--split NAME)"
    )


def _label_names(feature, labels: np.ndarray, where: str) -> tuple[list[str], np.ndarray]:
    """(class names, labels as class indices): a ClassLabel's names; class indices 0..max for integers;
    sorted names for strings, as image folders sort theirs."""
    from datasets import ClassLabel

    if isinstance(feature, ClassLabel):
        return list(feature.names), labels.astype(np.int64)
    if labels.dtype.kind in "iu":
        return [str(k) for k in range(int(labels.max(initial=-1)) + 1)], labels.astype(np.int64)
    if labels.dtype.kind in "OUS":
        names, indices = np.unique(labels.astype(str), return_inverse=True)
        return [str(name) for name in names], indices.astype(np.int64)
    raise UserError(
        f"{where}: the label column holds {feature}, not class labels",
        "pass --label-column with a ClassLabel, integer or string column",
    )


def _check_columns(features, options: DatasetOptions, where: str) -> None:
    from datasets import Image as ImageFeature
    from datasets import Value

    columns = list(features or {})
    for flag, name in (("--image-column", options.image_column), ("--label-column", options.label_column)):
        if name not in columns:
            raise UserError(
                f"{where} has no column {name!r} (its columns: {', '.join(columns)})",
                f"pass {flag} with the column that holds the {flag.split('-')[2]}s",
            )
    image = features[options.image_column]
    if not (isinstance(image, ImageFeature) or (isinstance(image, Value) and image.dtype == "binary")):
        raise UserError(
            f"{where}: column {options.image_column!r} holds {image}, not images",
            "pass --image-column with an Image (or binary) column",
        )


def image_stream(value) -> io.BytesIO | str:
    """A row's image cell (an Image feature read with decode=False, or raw bytes) as what PIL opens."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return io.BytesIO(value["bytes"])
        return value.get("path") or ""
    return io.BytesIO(value)


@dataclass
class DatasetListing:
    """The usable rows of one split, in the dataset's order; answers what a `FolderListing` answers.

    `records` is the split itself, memory-mapped, with its image column left undecoded (bytes)."""

    root: str
    records: object = field(repr=False)
    image_column: str
    classes: list[str]
    rows: np.ndarray  # int64 row index in the split of each entry
    labels: np.ndarray  # int64 class index of each entry
    fingerprint: str = ""
    kind: str = ""
    split: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def location(self) -> str:
        return self.root if dataset_kind(self.root) == "hub" else str(Path(self.root).absolute())

    def name(self, index: int) -> str:
        return f"row {int(self.rows[index])}"

    def source_key(self, index: int) -> str:
        return f"{self.fingerprint}:{int(self.rows[index])}"

    def class_of(self, name: str) -> str:
        row = int(name.removeprefix("row "))
        return self.classes[int(self.labels[np.searchsorted(self.rows, row)])]

    def image_file(self, index: int) -> io.BytesIO | str:
        return image_stream(self.records[int(self.rows[index])][self.image_column])

    def load(self, index: int) -> Image.Image:
        return load_rgb(self.image_file(index), f"{self.root} {self.name(index)}")

    def without(self, bad_names: set[str]) -> DatasetListing:
        bad_rows = np.array([int(name.removeprefix("row ")) for name in bad_names], dtype=np.int64)
        keep = ~np.isin(self.rows, bad_rows)
        return dataclasses.replace(self, rows=self.rows[keep], labels=self.labels[keep])


@dataclass
class DatasetSummary(FolderSummary):
    """A FolderSummary of a dataset: which kind and split it is. `listing` is None for a stream."""

    kind: str = ""
    split: str = ""

    def title(self) -> str:
        return f"{self.root} ({self.kind}, split {self.split})"

    def describe(self) -> str:
        if self.listing is None:
            return (
                f"{self.title()}: a stream, its first {self.images_decoded} rows decoded (rows are counted as "
                "extraction reads them)"
            )
        return super().describe()


def check_dataset_columns(path: str | os.PathLike, options: DatasetOptions) -> None:
    """The split and its image and label columns, from what costs a glance (a saved dataset's memory map, a
    parquet file's schema): the launcher asks it before any process starts. A stream's or a Hub name's
    columns are checked by the ranks, which open them anyway."""
    text = os.path.expanduser(str(path))
    kind = dataset_kind(text)
    if kind == "saved":
        records, _, split = open_dataset(text, options)
        _check_columns(records.features, options, f"{text} (split {split})")
    elif kind == "parquet":
        import pyarrow.parquet as pq
        from datasets import Features

        files = _data_files(text, PARQUET)
        files = {options.split or "train": files[""]} if "" in files else files
        split = _choose_split(sorted(files), options.split, text)
        if not files[split]:
            raise UserError(
                f"no {PARQUET} files in {text} for the split {split}", "pass the files themselves"
            )
        # datasets reads its own features (an Image column among them) from the schema's metadata
        features = Features.from_arrow_schema(pq.read_schema(files[split][0]))
        _check_columns(features, options, f"{text} (split {split})")


def validate_dataset(
    path: str | os.PathLike,
    options: DatasetOptions,
    *,
    sample: bool = False,
    full: bool = False,
    skip_bad_images: bool = False,
    decode_threads: int = 8,
) -> DatasetSummary:
    """The checks an image folder gets, for a dataset: its columns, an empty split, labels within the class
    count, and decoding (the first image of every class with `sample`, every image with `full`)."""
    from datasets import Image as ImageFeature

    from dit_accel.data.folder import decode_all

    records, kind, split = open_dataset(path, options)
    where = f"{os.path.expanduser(str(path))} (split {split})"
    _check_columns(records.features, options, where)
    if kind not in STREAMED and len(records) == 0:
        raise _empty(os.path.expanduser(str(path)), split)
    if isinstance(records.features[options.image_column], ImageFeature):
        records = records.cast_column(options.image_column, ImageFeature(decode=False))
    if kind in STREAMED:
        return _validate_stream(path, records, kind, split, options, where, skip_bad_images)
    labels = np.asarray(records.data.column(options.label_column).to_numpy(zero_copy_only=False))
    classes, labels = _label_names(records.features[options.label_column], labels, where)
    outside = np.flatnonzero((labels < 0) | (labels >= len(classes)))
    if len(outside):
        first = int(outside[0])
        raise UserError(
            f"{where}: {count(len(outside), 'row')} ha{'s' if len(outside) == 1 else 've'} a label outside "
            f"its {len(classes)} classes (row {first}: {int(labels[first])})",
            "pass a labelled split (--split NAME: a test split often has label -1) or correct the labels",
        )
    listing = DatasetListing(
        str(os.path.expanduser(str(path))), records, options.image_column, classes,
        np.arange(len(records), dtype=np.int64), labels, getattr(records, "_fingerprint", ""), kind, split,
    )  # fmt: skip
    if full:
        to_decode = list(range(len(listing)))
    elif sample:
        to_decode = sorted(np.unique(labels, return_index=True)[1].tolist())
    else:
        to_decode = []
    bad = decode_all(listing, to_decode, skip_bad_images, decode_threads)
    if bad:
        listing = listing.without(set(bad))
        if not len(listing):
            raise UserError(f"none of the images of {where} decode ({len(bad)} tried)", "check the column")
    per_class = np.bincount(listing.labels, minlength=len(classes))
    return DatasetSummary(
        root=listing.root,
        classes=classes,
        images_per_class={name: int(n) for name, n in zip(classes, per_class)},
        num_images=len(listing),
        images_decoded=len(to_decode),
        bad_images=bad,
        ignored_files=0,
        listing=listing,
        kind=kind,
        split=split,
    )


def _validate_stream(path, records, kind, split, options, where, skip_bad_images) -> DatasetSummary:
    """A stream's cheap check: it has rows, and its first rows decode with labels that are class indices."""
    first = list(records.take(STREAM_SAMPLE_ROWS))
    if not first:
        raise UserError(f"{where} is empty", "pass shards that hold images")
    bad = []
    for row, values in enumerate(first):
        label = values[options.label_column]
        if not isinstance(label, (int, np.integer)) or label < 0:
            raise UserError(
                f"{where}: row {row} has the label {label!r}, not a class index",
                "pass --label-column with the column of class indices (webdataset: cls)",
            )
        try:
            load_rgb(image_stream(values[options.image_column]), f"{where} row {row}")
        except UserError:
            if not skip_bad_images:
                raise
            bad.append(f"row {row}")
    return DatasetSummary(
        root=os.path.expanduser(str(path)),
        classes=[],
        images_per_class={},
        num_images=0,
        images_decoded=len(first),
        bad_images=bad,
        ignored_files=0,
        listing=None,
        kind=kind,
        split=split,
    )


def resident_bytes(listing: DatasetListing) -> tuple[int, int]:
    """(bytes a rank holds for the listing: its row and label arrays; bytes of the Arrow files it maps)."""
    mapped = sum(Path(entry["filename"]).stat().st_size for entry in listing.records.cache_files)
    return int(listing.rows.nbytes + listing.labels.nbytes), mapped


def validate_image_source(
    path: str | os.PathLike, options: DatasetOptions | None = None, **checks
) -> FolderSummary:
    """`validate_image_folder` for a folder of image files, `validate_dataset` for a dataset: what every
    command that takes --data-path calls."""
    if dataset_kind(path) is None:
        return validate_image_folder(path, **checks)
    return validate_dataset(path, options or DatasetOptions(), **checks)


def training_refusal(summary: FolderSummary, data_path: str) -> None:
    """Training reads samples in a keyed random order, which a stream cannot serve."""
    if isinstance(summary, DatasetSummary) and summary.listing is None:
        raise UserError(
            f"--data-path {data_path} is {summary.kind} shards, read only as a stream, and training reads "
            "samples at random",
            f"extract latents first (`dit-accel extract-latents --data-path {data_path} ...`) and train on "
            "them with --latents",
        )


class DatasetImageData(ImageFolderData):
    """`ImageFolderData` over a dataset's rows: the same crop, flips and bad-image handling."""

    def __init__(self, summary: DatasetSummary, resolution: int, **options):
        super().__init__(summary.root, resolution, summary=summary, records=summary.listing, **options)

    def _entry_name(self, relative: str) -> str:
        return f"{self.root} {relative}"

    def _decode(self, position: int) -> tuple[Image.Image, int]:
        return self.records.load(position), int(self.records.labels[position])
