"""Image folders in the ImageNet layout (DIR/<class>/<image>.jpg): validation, the class map, the
ADM-style center crop, and `ImageFolderData`, the torch Dataset the trainer reads pixels from.

Validation runs before anything heavy (a VAE, a process group, eight ranks) so that a wrong data path
fails in a second with one line that says what to fix. The cheap checks (listing, extensions) always
run; decoding the first image of every class is cheap and on by request; decoding every image is
opt-in (`full=True`) because on ImageNet it reads 140 GB.

Listing ImageNet (1.28M files) costs seconds and most of a gigabyte of host memory, so a multi-process
run lists it once: the main process writes the checked listing as a memory-mapped index
(`write_folder_index`) and every rank reads that (`read_folder_index`), sharing its pages.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dit_accel.atomic import write_json_atomically
from dit_accel.errors import UserError
from planner.units import count

# Lower-case suffixes taken as images (ImageNet's own files end in ".JPEG").
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")
LAYOUT_HINT = "DIR/<class>/<image>.jpg"
_log = logging.getLogger("dit_accel.train")  # a skipped image goes to the rank's own log
_MAX_NAMES_SHOWN = 5


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _short_list(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    return shown + (f" (+{len(names) - _MAX_NAMES_SHOWN} more)" if len(names) > _MAX_NAMES_SHOWN else "")


@dataclass
class FolderListing:
    """Every image of the folder in a fixed order: classes sorted by name, files sorted within a class.

    `paths` are relative to `root` (POSIX separators), so a listing means the same on every rank."""

    root: Path
    classes: list[str]
    paths: list[str]
    labels: list[int]

    @property
    def class_to_index(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.paths)

    # What the latent cache writer asks of a listing (a dataset's listing answers the same, hf_source.py).
    @property
    def location(self) -> str:
        """Where the images are, as a cache's manifest records it (`data_path`)."""
        return str(self.root.absolute())

    def name(self, index: int) -> str:
        """How entry `index` is named in messages and in a cache's list of skipped images."""
        return self.paths[index]

    def source_key(self, index: int) -> str:
        """What identifies entry `index`'s image, so a cache shard of other images is not reused."""
        return self.paths[index]

    def class_of(self, name: str) -> str:
        return name.split("/", 1)[0]

    def image_file(self, index: int) -> Path:
        """What PIL opens for entry `index`."""
        return self.root / self.paths[index]

    def load(self, index: int) -> Image.Image:
        return load_rgb(self.image_file(index))

    def without(self, bad_paths: set[str]) -> FolderListing:
        keep = [i for i, rel in enumerate(self.paths) if rel not in bad_paths]
        return FolderListing(
            self.root, self.classes, [self.paths[i] for i in keep], [self.labels[i] for i in keep]
        )


@dataclass
class FolderSummary:
    """What validation found; the doctor prints it and the trainer logs it.

    `listing` holds the usable images (bad ones removed when `skip_bad_images` was set)."""

    root: str
    classes: list[str]
    images_per_class: dict[str, int]
    num_images: int
    images_decoded: int  # how many the check decoded: 0, one per class, or all
    bad_images: list[str]  # relative paths that failed to decode and were skipped
    ignored_files: int  # files with a non-image extension, and images lying in the root itself
    listing: FolderListing | None = field(default=None, repr=False)  # None: read from an index

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def title(self) -> str:
        return self.root

    def describe(self) -> str:
        counts = list(self.images_per_class.values())
        line = (
            f"{self.title()}: {self.num_images} images in {self.num_classes} classes "
            f"({min(counts)}-{max(counts)} per class), {self.images_decoded} decoded"
        )
        if self.bad_images:
            line += f", {len(self.bad_images)} undecodable skipped"
        if self.ignored_files:
            line += f", {self.ignored_files} non-image files ignored"
        return line


def list_image_folder(path: str | os.PathLike) -> tuple[FolderListing, int]:
    """The cheap checks: the folder exists, is readable, has class sub-folders, and each holds images.

    Returns the listing and the number of ignored files. Raises a one-line UserError otherwise."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(
            f"--data-path {root} does not exist",
            f"pass the folder that holds one sub-folder per class ({LAYOUT_HINT})",
        )
    if not root.is_dir():
        raise UserError(
            f"--data-path {root} is a file, not a directory",
            f"pass the folder that holds one sub-folder per class ({LAYOUT_HINT})",
        )
    try:
        entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    except PermissionError as error:
        raise UserError(
            f"data path {root} is not readable ({error.strerror})",
            f"fix its permissions (e.g. chmod -R u+rX {root}) or run as a user who can read it",
        ) from None

    class_dirs = [e for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=True)]
    root_images = [e.name for e in entries if e.is_file() and _is_image(e.name)]
    if not class_dirs:
        if root_images:
            raise UserError(
                f"{root} holds {len(root_images)} images directly but no class sub-folders",
                f"move them into one sub-folder per class: {root}/<class>/<image>.jpg",
            )
        raise UserError(
            f"{root} has no class sub-folders",
            f"expected one sub-folder per class: {root}/<class>/<image>.jpg",
        )

    classes = [e.name for e in class_dirs]
    paths: list[str] = []
    labels: list[int] = []
    empty: list[str] = []
    ignored = len(root_images)
    for label, name in enumerate(classes):
        found, skipped = _images_under(root, name)
        ignored += skipped
        if not found:
            empty.append(name)
        paths += found
        labels += [label] * len(found)

    if not paths:
        raise UserError(
            f"no images in {root}: all {len(classes)} class folders are empty (looked for "
            f"{', '.join(IMAGE_EXTENSIONS)})",
            f"expected {root}/<class>/<image>.jpg",
        )
    if empty:
        raise UserError(
            f"{count(len(empty), 'class folder')} in {root} hold{'s' if len(empty) == 1 else ''} no images: "
            f"{_short_list(empty)}",
            f"add images to them or remove them (looked for {', '.join(IMAGE_EXTENSIONS)})",
        )
    return FolderListing(root, classes, paths, labels), ignored


def _images_under(root: Path, class_name: str) -> tuple[list[str], int]:
    """Relative paths of the images in one class folder (nested folders included), sorted; and the
    count of other files."""
    found: list[str] = []
    ignored = 0

    def unreadable(error: OSError):
        raise UserError(
            f"class folder {error.filename} is not readable ({error.strerror})",
            f"fix its permissions (e.g. chmod -R u+rX {root})",
        )

    for folder, subfolders, files in os.walk(root / class_name, onerror=unreadable, followlinks=True):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        relative = Path(folder).relative_to(root).as_posix()
        for name in sorted(files):
            if _is_image(name):
                found.append(f"{relative}/{name}")
            elif not name.startswith("."):
                ignored += 1
    return found, ignored


def _to_8_bit(image: Image.Image) -> Image.Image:
    """16- and 32-bit single-channel images scaled to 8 bits (value / 257 for 16-bit, rounded): PIL's own
    convert("RGB") clips them at 255 instead, so a mid-grey 16-bit PNG would come through white."""
    if image.mode not in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        return image
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F" or (image.mode == "I" and values.max(initial=0) > 65535):
        top = max(float(values.max(initial=0)), 1.0)  # 32-bit: no fixed range, so the image's own maximum
        values = values / top * 255.0
    else:  # 16-bit data (PNG decodes 16-bit grey as "I" in newer PIL, "I;16" in older)
        values = values / 257.0
    return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), mode="L")


def load_rgb(path, name: str | None = None) -> Image.Image:
    """Decode an image fully into RGB; a file that does not decode raises UserError naming it.

    `path`: a file, or a binary stream (a dataset's image bytes) with `name` saying which row it is."""
    try:
        with Image.open(path) as image:
            image.load()  # decodes every pixel, so truncation surfaces here
            return _to_8_bit(image).convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as error:
        raise UserError(
            f"cannot decode image {name or path}: {error}",
            "replace or delete it, or pass --skip-bad-images to skip such files",
        ) from None


def validate_image_folder(
    path: str | os.PathLike,
    *,
    sample: bool = False,
    full: bool = False,
    skip_bad_images: bool = False,
    decode_threads: int = 8,
) -> FolderSummary:
    """Check an image folder before training or extraction starts.

    Always: the listing checks of `list_image_folder`. `sample=True` also decodes the first image of
    every class; `full=True` decodes every image (threads: PIL releases the GIL while decoding). An
    image that does not decode raises UserError naming it, or with `skip_bad_images` is dropped from
    the listing and counted in `bad_images`."""
    listing, ignored = list_image_folder(path)
    if full:
        to_decode = list(range(len(listing)))
    elif sample:
        first_of_class: dict[int, int] = {}
        for index, label in enumerate(listing.labels):
            first_of_class.setdefault(label, index)
        to_decode = list(first_of_class.values())
    else:
        to_decode = []
    bad = decode_all(listing, to_decode, skip_bad_images, decode_threads)
    if bad:
        listing = listing.without(set(bad))
        if not listing.paths:
            raise UserError(
                f"none of the images in {listing.root} decode ({len(bad)} tried, e.g. {bad[0]})",
                "check that the files are images",
            )

    counts = np.bincount(np.asarray(listing.labels, dtype=np.int64), minlength=len(listing.classes))
    return FolderSummary(
        root=str(listing.root),
        classes=listing.classes,
        images_per_class={name: int(n) for name, n in zip(listing.classes, counts)},
        num_images=len(listing.paths),
        images_decoded=len(to_decode),
        bad_images=bad,
        ignored_files=ignored,
        listing=listing,
    )


def decode_all(listing, indices: list[int], skip_bad_images: bool, decode_threads: int = 8) -> list[str]:
    """Decode the listing's entries `indices` (threads: PIL releases the GIL while decoding); the names of
    those that do not decode, or the first one's UserError in listing order unless `skip_bad_images`."""

    def decodes(index: int) -> str | None:
        try:
            listing.load(index)
            return None
        except UserError as error:
            if not skip_bad_images:
                raise
            return str(error)

    bad: list[str] = []
    chunk = 4096  # bounded: a million pending futures would cost a gigabyte
    with ThreadPoolExecutor(max_workers=max(1, decode_threads)) as pool:
        for start in range(0, len(indices), chunk):
            part = indices[start : start + chunk]
            # map() re-raises the first bad image in listing order when skipping is off
            bad += [
                listing.name(i) for i, problem in zip(part, pool.map(decodes, part)) if problem is not None
            ]
    return bad


_INDEX_FORMAT = "dit-accel-folder-index/1"
_INDEX_SUMMARY, _INDEX_RECORDS = "summary.json", "records"


def write_folder_index(summary: FolderSummary, folder: str | os.PathLike) -> Path:
    """The checked listing of `summary` as a folder: its summary (JSON) and the paths and labels as an Arrow
    table on disk, which `read_folder_index` memory-maps. Written whole or not at all (a staging folder)."""
    import datasets

    from dit_accel.atomic import replace_folder

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.writing")
    shutil.rmtree(staging, ignore_errors=True)
    records = datasets.Dataset.from_dict({"path": summary.listing.paths, "label": summary.listing.labels})
    shown = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()  # a bar of its own on stderr is noise among the run's lines
    try:
        records.save_to_disk(str(staging / _INDEX_RECORDS))
    finally:
        if shown:
            datasets.utils.logging.enable_progress_bar()
    fields = {
        name: getattr(summary, name) for name in FolderSummary.__dataclass_fields__ if name != "listing"
    }
    write_json_atomically(staging / _INDEX_SUMMARY, dict(fields, format=_INDEX_FORMAT))
    return replace_folder(staging, folder)


def read_folder_index(folder: str | os.PathLike) -> tuple[FolderSummary, object]:
    """(summary without its listing, the records as a memory-mapped `datasets.Dataset`) of an index."""
    import datasets

    folder = Path(folder)
    fields = json.loads((folder / _INDEX_SUMMARY).read_text())
    if fields.pop("format", None) != _INDEX_FORMAT:
        raise UserError(f"{folder} is not a folder index of this dit-accel version", f"delete {folder}")
    return FolderSummary(**fields), datasets.load_from_disk(str(folder / _INDEX_RECORDS))


def write_classes_json(folder: str | os.PathLike, classes: list[str]) -> Path:
    """Save the class-to-index map (index = position in the sorted class folder names) with a run,
    atomically, so samples can be named and a different folder noticed."""
    target = Path(folder) / "classes.json"  # write_json_atomically creates the folder
    payload = {"classes": list(classes), "class_to_index": {name: i for i, name in enumerate(classes)}}
    write_json_atomically(target, payload)
    return target


def read_classes_json(folder: str | os.PathLike) -> list[str]:
    path = Path(folder) / "classes.json"
    if not path.is_file():
        raise UserError(f"no classes.json in {folder}", "it is written by training and by extract-latents")
    return list(json.loads(path.read_text())["classes"])


# --------------------------------------------------------------------------------------------------
# Transforms


def center_crop_adm(image: Image.Image, resolution: int) -> Image.Image:
    """ADM's crop: halve with a box filter while the short side is at least twice the target (cheap
    and alias-free), resize with bicubic so the short side equals `resolution`, then crop the center."""
    while min(image.size) >= 2 * resolution:
        image = image.resize((image.width // 2, image.height // 2), resample=Image.BOX)
    scale = resolution / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), resample=Image.BICUBIC)
    left = (image.width - resolution) // 2
    top = (image.height - resolution) // 2
    return image.crop((left, top, left + resolution, top + resolution))


def image_to_uint8(image: Image.Image, flip: bool = False) -> torch.Tensor:
    """An RGB PIL image as a uint8 CHW tensor, mirrored left-right when `flip`."""
    pixels = np.asarray(image, dtype=np.uint8)
    if flip:
        pixels = pixels[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def uint8_to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float32 [-1, 1], the range the VAE was trained on."""
    return pixels.to(torch.float32) / 127.5 - 1.0


def training_pixels(image: Image.Image, resolution: int, mirrored: bool) -> torch.Tensor:
    """What a DataLoader worker hands over for one decoded image: the ADM crop, mirrored or not, as float32
    CHW in [-1, 1]. The trainer's datasets and the doctor's decode-rate check run this same work."""
    return uint8_to_unit_range(image_to_uint8(center_crop_adm(image, resolution), flip=mirrored))


def flip_coin(seed: int | None, epoch: int, index: int) -> bool:
    """A fair coin. Seeded: a pure function of (seed, epoch, index), so it does not depend on which
    DataLoader worker serves the index. Unseeded: torch's RNG (DataLoader seeds it per worker)."""
    if seed is None:
        return bool(torch.rand(()) < 0.5)
    return bool(np.random.default_rng((seed, epoch, index)).random() < 0.5)


class ImageFolderData(torch.utils.data.Dataset):
    """Pixels for the trainer: `data[i] -> (image, label)`.

    image: float32 tensor [3, resolution, resolution] in [-1, 1], ADM center crop, mirrored with
           probability 1/2 when `flip` (seeded per (seed, epoch, index): call `set_epoch` each epoch).
    label: int64 scalar tensor, the index of the class folder in sorted order (`classes`).
    A default DataLoader collates these into ([B, 3, R, R] float32, [B] int64).

    The file list lives in a `datasets.Dataset` built with `from_dict`: an in-memory Arrow table (no
    cache files, no network, no scanning builder), which DataLoader workers share without the
    copy-on-read that a Python list of a million strings suffers from reference counting. The trainer
    passes `summary` and `records` from the run's folder index instead (`read_folder_index`): the table
    memory-mapped, its pages shared by every rank of the node.
    Decoding happens lazily per item. An image that does not decode raises UserError naming it; with
    `skip_bad_images` the next image in the list is served instead. The bad ones are marked in an array
    shared by this rank's DataLoader workers, so each is logged once per rank with the rank's running
    total (`bad_images_seen`), and never decoded again; more than `max_bad_images` stop the run.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        resolution: int,
        *,
        flip: bool = True,
        seed: int | None = None,
        skip_bad_images: bool = False,
        max_bad_images: int = 100,
        check: str = "sample",
        summary: FolderSummary | None = None,
        records=None,
    ):
        import datasets  # imported here: the validation functions above should not pay for it

        if check not in ("none", "sample", "full"):
            raise ValueError(f"check must be 'none', 'sample' or 'full', not {check!r}")
        if summary is None:
            summary = validate_image_folder(
                path, sample=check == "sample", full=check == "full", skip_bad_images=skip_bad_images
            )
        self.summary = summary
        self.root = summary.listing.root if summary.listing is not None else Path(path).expanduser()
        self.classes = summary.classes
        self.resolution = resolution
        self.flip = flip
        self.seed = seed
        self.skip_bad_images = skip_bad_images
        self.max_bad_images = max_bad_images
        self.epoch = 0
        if records is None:  # else an index's memory-mapped table (`read_folder_index`)
            records = datasets.Dataset.from_dict(
                {"path": summary.listing.paths, "label": summary.listing.labels}
            )
        self.records = records
        # Shared with the DataLoader workers (inherited, or passed as they start): a flag per image, a count.
        self._bad = multiprocessing.Array("b", len(self.records)) if skip_bad_images else None
        self._bad_count = multiprocessing.Value("i", 0)
        for relative in summary.bad_images:  # found by the sample check; already left out of the listing
            self._count_bad(f"{self._entry_name(relative)} (found by the sample check)")

    def _entry_name(self, relative: str) -> str:
        return str(self.root / relative)

    def _decode(self, position: int) -> tuple[Image.Image, int]:
        """Entry `position`'s image, decoded, and its label; UserError when it does not decode."""
        row = self.records[position]
        return load_rgb(self.root / row["path"]), row["label"]

    @property
    def bad_images_seen(self) -> int:
        """Undecodable images this rank found (its workers included), the sample check's among them."""
        return self._bad_count.value

    def _count_bad(self, what: str) -> None:
        """`what`: the file and why it does not decode."""
        with self._bad_count.get_lock():
            self._bad_count.value += 1
            seen = self._bad_count.value
        rank = os.environ.get("RANK", "0")
        _log.warning(
            f"skipped undecodable image {what}: {seen} on rank {rank} so far, at most {self.max_bad_images} "
            f"(--max-bad-images)"
        )
        if seen > self.max_bad_images:
            raise UserError(
                f"{seen} images on rank {rank} could not be decoded, more than --max-bad-images "
                f"{self.max_bad_images} (the last: {what})",
                f"replace or delete them (`dit-accel doctor --data-path {self.root} --full` lists them), or "
                f"raise --max-bad-images",
            )

    def _mark_bad(self, position: int, error: UserError) -> None:
        """Count an image once per rank, whichever worker meets it first."""
        with self._bad.get_lock():
            if self._bad[position]:
                return
            self._bad[position] = 1
        self._count_bad(error.problem.removeprefix("cannot decode image "))

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        """Make the seeded flips of the next epoch differ from this one's."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        for attempt in range(len(self)):
            position = (index + attempt) % len(self)
            if self._bad is not None and self._bad[position]:
                continue  # known bad on this rank: not decoded again
            try:
                image, label = self._decode(position)
                break
            except UserError as error:
                if not self.skip_bad_images:
                    raise
                self._mark_bad(position, error)
        else:
            raise UserError(f"no image in {self.root} decodes", "check the files")
        mirrored = self.flip and flip_coin(self.seed, self.epoch, index)
        pixels = training_pixels(image, self.resolution, mirrored)
        return pixels, torch.tensor(label, dtype=torch.int64)
