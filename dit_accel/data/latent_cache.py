"""Reading the latent cache that `extract-latents` (dit_accel.data.latents) writes: the manifest checked,
shards verified against their checksums, the cache compared with a run's resolution and VAE, and
`LatentCache`, the dataset that memory-maps the shards and draws a fresh latent from each stored posterior.

hustvl/LightningDiT's published ImageNet latents are read as they are published, without re-extraction:
safetensors shards holding `latents`, `latents_flip` (each image's posterior sample and its mirror image's)
and `labels`, beside `latents_stats.pt` (the per-channel mean and std, read weights-only). `read_manifest`
describes such a folder as a manifest (`published_manifest`: shapes, counts, labels in range, the statistics),
and `LatentCache` reads it like our own, each latent fixed (a sample, not a posterior).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from dit_accel.errors import UserError
from dit_accel.models.vae import LatentNorm, load_vae
from dit_accel.run.records import is_count

FORMAT = "dit-accel-latents/1"
MANIFEST_NAME = "manifest.json"
PUBLISHED_FORMAT = "hustvl/LightningDiT latents"  # what a published folder's manifest (made here) says
PUBLISHED_STATS = "latents_stats.pt"
PUBLISHED_TENSORS = ("latents", "latents_flip", "labels")


def read_manifest(cache_dir: str | os.PathLike) -> dict:
    """The manifest of a complete cache, after cheap checks (format, every shard present with its size).

    A missing manifest means the extraction did not finish: the message says to re-run it."""
    cache = Path(cache_dir).expanduser()
    if not cache.is_dir():
        raise UserError(
            f"latent cache {cache} does not exist",
            f"create it with `dit-accel extract-latents --data-path DIR --vae PATH --out {cache}`",
        )
    manifest_path = cache / MANIFEST_NAME
    if not manifest_path.is_file() and (cache / PUBLISHED_STATS).is_file():
        return published_manifest(cache)
    if not manifest_path.is_file() and _holds_images(cache):
        raise UserError(
            f"{cache} is an image folder (or dataset), not a latent cache",
            f"extract a cache from it (`dit-accel extract-latents --data-path {cache} --vae VAE --out NEW`), or plan "
            f"online or pixel latents (`dit-plan --latents online`) and pass it as --data-path",
        )
    if not manifest_path.is_file():
        raise UserError(
            f"latent cache {cache} is incomplete (no {MANIFEST_NAME}: the extraction was interrupted "
            "or is still running)",
            f"re-run the same `dit-accel extract-latents ... --out {cache}` command to finish it",
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(
            f"cannot read {manifest_path} ({error})", "re-run extract-latents to rewrite it"
        ) from None
    if not isinstance(manifest, dict):
        raise UserError(
            f"{manifest_path} holds a JSON {type(manifest).__name__}, not a manifest",
            "re-run extract-latents to rewrite it",
        )
    if manifest.get("format") not in (FORMAT, PUBLISHED_FORMAT):
        raise UserError(
            f"latent cache {cache} has format {manifest.get('format')!r}, this dit-accel reads {FORMAT!r}",
            "re-run extract-latents into a new folder",
        )
    check_manifest_types(manifest_path, manifest)
    for record in manifest["shards"]:  # each confined to the folder (`shard_path`) before anything else
        path = shard_path(cache, record["file"])
        size = path.stat().st_size if path.is_file() else None
        if size != record["bytes"]:
            found = "is missing" if size is None else f"has {size} bytes, the manifest says {record['bytes']}"
            raise UserError(
                f"latent cache {cache} is damaged: {record['file']} {found}",
                "re-run the same extract-latents command to rewrite it",
            )
    check_manifest_layout(cache, manifest)
    return manifest


def shard_path(cache: Path, name) -> Path:
    """A shard the manifest names, confined to the cache folder: a plain file name, which is no link out of
    it. A manifest comes with the cache, from whoever made it; it must not make a run read other files."""
    path = cache / str(name)
    inside = isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")
    if not inside or not path.resolve().is_relative_to(cache.resolve()):
        raise UserError(
            f"latent cache {cache}'s manifest names the shard {name!r}, which is not a file in the cache folder",
            "re-run extract-latents into a new folder (shards are read from the cache folder only; to keep a "
            "cache elsewhere, link or mount the whole folder)",
        )
    return path


def check_manifest_types(path: Path, manifest: dict) -> None:
    """The manifest's fields of the kinds the reader uses: a count, and shards as a list of records each
    with a file name, an entry count and a byte size (a string "256" once read as a count of 256)."""
    fix = "re-run the same extract-latents command (with --overwrite if it refuses) to rewrite the cache"
    if not is_count(manifest.get("count")):
        raise UserError(f"{path}: count is {manifest.get('count')!r}, not a whole number", fix)
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise UserError(f"{path}: shards is a {type(shards).__name__}, not a list of shard records", fix)
    for index, record in enumerate(shards):
        if not isinstance(record, dict) or not isinstance(record.get("file"), str):
            raise UserError(f"{path}: shard record {index} is not an object with a file name", fix)
        for field in ("count", "bytes"):
            if not is_count(record.get(field)):
                raise UserError(
                    f"{path}: shard {record['file']}'s {field} is {record.get(field)!r}, not a whole number",
                    fix,
                )


def check_manifest_layout(cache: Path, manifest: dict) -> None:
    """What a cheap look can tell of an edited or mixed cache (the shards' checksums are `verify_cache`'s, a
    read of the whole cache: `dit-accel doctor --full`): shards numbered 0..n-1 in order, their counts
    adding up to the manifest's, and no shard file on disk that the manifest does not list (a dropped
    shard would shrink the data set without a word)."""
    records = manifest["shards"]
    fix = "re-run the same extract-latents command (with --overwrite if it refuses) to rewrite the cache"
    numbers = [record.get("shard", index) for index, record in enumerate(records)]
    if numbers != list(range(len(records))):
        raise UserError(f"latent cache {cache} is damaged: its manifest lists shards {numbers[:8]}...", fix)
    counts = [record["count"] for record in records]
    if not all(isinstance(count, int) and count >= 0 for count in counts) or sum(counts) != manifest["count"]:
        raise UserError(
            f"latent cache {cache} is damaged: its shards count {sum(map(int, counts))} entries, its manifest "
            f"{manifest['count']}",
            fix,
        )
    names = [record["file"] for record in records]
    sums = [record["sha256"] for record in records if record.get("sha256")]
    twice = sorted({name for name in names if names.count(name) > 1}) or sorted(
        {record["file"] for record in records if record.get("sha256") and sums.count(record["sha256"]) > 1}
    )
    if twice:
        raise UserError(
            f"latent cache {cache} is damaged: its manifest lists the same shard twice ({', '.join(twice[:3])}): "
            "its entries would be trained on twice",
            fix,
        )
    listed = set(names)
    unlisted = sorted(path.name for path in cache.glob("shard-*.safetensors") if path.name not in listed)
    if unlisted:
        raise UserError(
            f"latent cache {cache} holds shard files its manifest does not list ({', '.join(unlisted[:3])}"
            f"{', ...' if len(unlisted) > 3 else ''}): the manifest was edited, or two caches were mixed",
            fix,
        )


def _holds_images(folder: Path) -> bool:
    """Class folders of images, or a Hugging Face dataset: what --data-path takes, passed as --latents."""
    from dit_accel.data.folder import IMAGE_EXTENSIONS
    from dit_accel.data.source_kind import dataset_kind

    if dataset_kind(folder) is not None:
        return True
    for child in sorted(folder.iterdir())[:16] if folder.is_dir() else []:
        if child.is_dir() and any(p.suffix.lower() in IMAGE_EXTENSIONS for p in list(child.iterdir())[:16]):
            return True
    return False


def content_key(path: Path, edge_bytes: int = 1 << 20) -> tuple:
    """What tells two shard files apart without reading them whole: the size, and a hash of the first and
    last MiB (the header and the first and last latents). Two shards of one count share a header, not data."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(edge_bytes))
        handle.seek(max(0, size - edge_bytes))
        digest.update(handle.read(edge_bytes))
    return size, digest.hexdigest()


def refuse_copies(cache: Path, files: list[Path]) -> None:
    """A folder read by listing holds each shard once: a re-downloaded shard under a second name would be
    trained on twice."""
    seen: dict[tuple, Path] = {}
    for path in files:
        key = content_key(path)
        if key in seen:
            raise UserError(
                f"{cache} holds the same shard twice ({seen[key].name} and {path.name}): its entries would be "
                "trained on twice",
                "delete the copy",
            )
        seen[key] = path


def published_manifest(cache: Path) -> dict:
    """A published LightningDiT latent folder described as a manifest, after the checks our own caches get:
    every shard holds the three tensors with one entry count and one latent shape, labels are whole numbers
    in range, and the statistics are present, plain data (weights-only) and one per channel."""
    from dit_accel.models.vae import read_latent_statistics
    from planner.spec import NUM_CLASSES, TOKENIZERS

    fix = "download the folder again (every latents_rank*_shard*.safetensors and latents_stats.pt)"
    files = sorted(cache.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"{cache} has {PUBLISHED_STATS} but no .safetensors shards: not a published latent folder", fix
        )
    shards, shape, dtype, labels = [], None, None, []
    for path in files:
        try:
            arrays = map_shard(path)
        except (OSError, ValueError, KeyError) as error:
            raise UserError(f"{path} is not a readable safetensors file ({error})", fix) from None
        missing = [name for name in PUBLISHED_TENSORS if name not in arrays]
        if missing:
            raise UserError(
                f"{path} lacks {', '.join(missing)}: not one of LightningDiT's latent shards", fix
            )
        latents, flipped, shard_labels = (arrays[name] for name in PUBLISHED_TENSORS)
        if latents.ndim != 4 or flipped.ndim != 4 or shard_labels.ndim != 1:
            raise UserError(
                f"{path} holds latents of {latents.ndim} dimensions, mirror images of {flipped.ndim} and labels "
                f"of {shard_labels.ndim}: LightningDiT's shards hold (N, C, h, w) latents and (N,) labels",
                fix,
            )
        if latents.shape != flipped.shape or shard_labels.shape != latents.shape[:1]:
            raise UserError(
                f"{path} holds latents {latents.shape}, mirror images {flipped.shape} and labels {shard_labels.shape}: "
                "the three must count the same entries",
                fix,
            )
        if shape not in (None, latents.shape[1:]) or dtype not in (None, latents.dtype):
            raise UserError(
                f"{path} holds {latents.dtype} latents of shape {latents.shape[1:]}, the other shards {dtype} {shape}",
                fix,
            )
        if shard_labels.dtype != np.int64:
            raise UserError(f"{path} holds {shard_labels.dtype} labels, not whole numbers", fix)
        shape, dtype = latents.shape[1:], latents.dtype
        shards.append({"file": path.name, "count": len(shard_labels), "bytes": path.stat().st_size})
        labels.append(np.asarray(shard_labels))
    refuse_copies(cache, files)
    labels = np.concatenate(labels)
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise UserError(
            f"{cache}'s labels run {labels.min()}..{labels.max()}, outside ImageNet's 0..{NUM_CLASSES - 1}",
            fix,
        )
    norm = read_latent_statistics(cache / PUBLISHED_STATS)
    tokenizer = next((t for t in TOKENIZERS.values() if t.channels == shape[0]), None)
    if norm.channels != shape[0] or tokenizer is None:
        raise UserError(f"{PUBLISHED_STATS} has {norm.channels} channels, the latents {shape[0]}", fix)
    return {
        "format": PUBLISHED_FORMAT,
        "data_path": str(cache),
        "vae": None,  # the folder does not say; sampling takes --vae
        "resolution": int(shape[1]) * tokenizer.downsample,
        "latent_shape": [int(s) for s in shape],
        "latent_norm": norm.to_json(),
        "dtype": "float16" if dtype == np.float16 else "float32",
        "views": 2,
        "count": int(len(labels)),
        "classes": [str(index) for index in range(NUM_CLASSES)],
        "shards": shards,
    }


def verify_cache(cache_dir: str | os.PathLike) -> int:
    """Check every shard against the manifest's sha256 (reads the whole cache). Returns bytes checked.
    A published folder carries no checksums: its shards are read whole, each to its header's length."""
    cache = Path(cache_dir).expanduser()
    manifest = read_manifest(cache)
    if manifest["format"] == PUBLISHED_FORMAT:
        checked = 0
        for record in manifest["shards"]:
            with open(shard_path(cache, record["file"]), "rb") as stream:
                for block in iter(lambda: stream.read(1 << 24), b""):
                    checked += len(block)
        return checked
    checked = 0
    for record in manifest["shards"]:
        digest = hashlib.sha256()
        with open(shard_path(cache, record["file"]), "rb") as stream:
            for block in iter(lambda: stream.read(1 << 24), b""):
                digest.update(block)
                checked += len(block)
        if digest.hexdigest() != record["sha256"]:
            raise UserError(
                f"latent cache {cache} is damaged: {record['file']} does not match its checksum",
                "delete that file and re-run the same extract-latents command",
            )
    return checked


def check_cache_matches(manifest, resolution: int, vae_identity: dict | str | None = None) -> None:
    """Refuse a cache made at another resolution or with another VAE than the run asks for.

    `manifest`: the dict, a `LatentCache`, or the cache folder. `vae_identity`: an identity dict (from
    `load_vae`), a VAE folder to load and hash, or None to check the resolution only."""
    if isinstance(manifest, LatentCache):
        manifest = manifest.manifest
    elif not isinstance(manifest, dict):
        manifest = read_manifest(manifest)
    where = manifest.get("data_path", "?")
    if manifest["resolution"] != resolution:
        raise UserError(
            f"the latent cache (of {where}) was made at {manifest['resolution']} px but the run asks "
            f"for {resolution} px",
            f"extract latents again with --resolution {resolution} into a new "
            f"--out folder, or train at {manifest['resolution']} px",
        )
    if vae_identity is None:
        return
    if isinstance(vae_identity, (str, os.PathLike)):
        vae_identity = load_vae(str(vae_identity))[1]
    cached = manifest["vae"]
    if cached is None:  # a published folder names no VAE: nothing to hold the run's to
        return
    for key in ("weights_sha256", "config_sha256"):
        if cached[key] != vae_identity[key]:
            what = "weights" if key.startswith("weights") else "config"
            raise UserError(
                f"the latent cache was encoded with another VAE ({cached['source']}, {what} sha256 "
                f"{cached[key][:12]}) than the run uses ({vae_identity['source']}, "
                f"{vae_identity[key][:12]})",
                "extract latents again with this VAE, or pass the VAE the cache was made with",
            )


def manifest_latent_norm(manifest: dict) -> LatentNorm:
    """How the cache's latents are normalised: its `latent_norm`, or (caches made before it was recorded) the
    VAE's scale and shift factors."""
    fix = "re-run extract-latents into a new folder (its manifest records the normalisation it measured)"
    channels = manifest["latent_shape"][0]
    try:
        if "latent_norm" in manifest:
            norm = LatentNorm.from_json(manifest["latent_norm"])
        else:
            norm = LatentNorm.of_factors(
                manifest["scale_factor"], manifest.get("shift_factor") or 0.0, channels
            )
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"the latent cache's latent_norm cannot be read ({error})", fix) from None
    values = [*norm.shift, *norm.scale]
    if norm.channels != channels or len(norm.scale) != channels or not all(map(math.isfinite, values)):
        raise UserError(
            f"the latent cache's latent_norm is {norm.to_json()}: not one finite shift and scale per channel "
            f"of its {channels}",
            fix,
        )
    if not all(scale > 0 for scale in norm.scale):
        raise UserError(f"the latent cache's latent_norm scales {list(norm.scale)} must be above 0", fix)
    return norm


class LatentCache(torch.utils.data.Dataset):
    """Latents for the trainer: `cache[i] -> (latent, label)`, and `image` third when `images` is set.

    latent: float32 [C, h, w] = (mean + std * noise - shift) * scale per channel (`latent_norm`), i.e. a
            fresh draw from the VAE posterior, already normalised for diffusion (the trainer does not again).
            With `flip` (default) the stored mirror image is chosen with probability 1/2; without, or for a
            cache made with --no-flip, always the image itself. One entry per image: the mirror image is
            an augmentation, not a second sample, so an epoch has as many steps as with pixels.
    label:  int64 scalar tensor (index into `classes`).
    `seed`: None uses torch's RNG (DataLoader seeds it per worker); an int makes noise and flip a pure
    function of (seed, epoch, index): call `set_epoch` every epoch.

    Shards are memory-mapped lazily in each process (and each DataLoader worker), so eight ranks share
    the page cache instead of each holding the cache in RAM; a batch is gathered with one numpy fancy
    index per shard it touches. The labels of all entries are read at construction (8 bytes each).
    """

    def __init__(self, cache_dir: str | os.PathLike, *, flip: bool = True, seed: int | None = None):
        self.dir = Path(cache_dir).expanduser()
        self.manifest = read_manifest(self.dir)
        self.classes: list[str] = self.manifest["classes"]
        self.latent_shape = tuple(self.manifest["latent_shape"])
        self.latent_norm = manifest_latent_norm(self.manifest)
        self.views = int(self.manifest["views"])
        self.published = self.manifest["format"] == PUBLISHED_FORMAT
        self.flip = flip and self.views == 2
        self.seed = seed
        self.epoch = 0
        self.images = None  # a `cache_images.CacheImages` (REPA): each entry's source image beside its latent
        self._files = [record["file"] for record in self.manifest["shards"]]
        counts = [record["count"] for record in self.manifest["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        _allow_open_files(len(self._files) + 64)  # each memory map holds a file descriptor
        self._maps: dict[int, dict[str, np.ndarray]] = {}
        for shard, count in enumerate(counts):
            self._check_shard(shard, count)
        self.labels = torch.cat(
            [
                torch.from_numpy(np.array(self._shard(k)["labels" if self.published else "label"]))
                if count
                else torch.empty(0, dtype=torch.int64)
                for k, count in enumerate(counts)
            ]
        )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = {}  # memory maps do not travel to DataLoader workers; each maps its own
        return state

    def _shard(self, shard: int) -> dict[str, np.ndarray]:
        arrays = self._maps.get(shard)
        if arrays is None:
            try:
                arrays = self._maps[shard] = map_shard(shard_path(self.dir, self._files[shard]))
            except (OSError, ValueError) as error:  # JSONDecodeError too
                raise UserError(
                    f"latent cache {self.dir} is damaged: {self._files[shard]} is not a readable shard "
                    f"({str(error)[:160]})",
                    "re-run the same extract-latents command (with --overwrite if it refuses) to rewrite it",
                ) from None
        return arrays

    def _check_shard(self, shard: int, count: int) -> None:
        """The shard holds the entries the manifest counts, of the manifest's shape (its header, read at
        start): an edited count once ended a run with an IndexError in a DataLoader worker."""
        arrays = self._shard(shard)
        if self.published:
            expected = {name: (count, *self.latent_shape) for name in ("latents", "latents_flip")}
            expected["labels"] = (count,)
        else:
            expected = {name: (count, self.views, *self.latent_shape) for name in ("mean", "std")}
            expected["label"] = (count,)
        for name, shape in expected.items():
            found = arrays[name].shape if name in arrays else None
            if found != shape:
                raise UserError(
                    f"latent cache {self.dir} is damaged: {self._files[shard]} holds {name} of shape {found}, "
                    f"its manifest says {shape}",
                    "re-run the same extract-latents command (with --overwrite if it refuses) to rewrite it",
                )

    def _locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Entry indices (negative allowed) -> (shard, row within the shard) arrays."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and not ((-len(self) <= indices) & (indices < len(self))).all():
            raise IndexError(f"index out of range for a latent cache of {len(self)}: {indices.tolist()}")
        indices = indices % max(len(self), 1)
        shards = np.searchsorted(self._starts, indices, side="right") - 1
        return shards, indices - self._starts[shards]

    def posterior(self, index: int, view: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored (mean, std) of entry `index`, view 0 (the image) or 1 (its mirror), as float32."""
        (shard,), (row,) = self._locate([index])
        arrays = self._shard(int(shard))
        if self.published:  # a fixed sample: the mean, with no spread
            mean = torch.from_numpy(
                np.array(arrays["latents_flip" if view else "latents"][row], dtype=np.float32)
            )
            return mean, torch.zeros_like(mean)
        return (
            torch.from_numpy(np.array(arrays["mean"][row, view], dtype=np.float32)),
            torch.from_numpy(np.array(arrays["std"][row, view], dtype=np.float32)),
        )

    def _generator(self, index: int) -> torch.Generator:
        """A generator that is a pure function of (seed, epoch, index): workers need not agree on anything."""
        key = hashlib.blake2b(f"{self.seed}:{self.epoch}:{index}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A whole batch at once (the DataLoader calls this when it exists): one gather per shard, one
        noise draw and one multiply-add for the batch."""
        shards, rows = self._locate(indices)
        count = len(rows)
        if self.seed is None:
            views = (torch.rand(count) < 0.5).numpy() if self.flip else np.zeros(count, dtype=bool)
            noise = torch.randn(count, *self.latent_shape)
        else:
            noise = torch.empty(count, *self.latent_shape)
            views = np.zeros(count, dtype=bool)
            for j, index in enumerate(indices):
                generator = self._generator(int(index) % len(self))
                views[j] = self.flip and bool(torch.rand((), generator=generator) < 0.5)
                torch.randn(self.latent_shape, generator=generator, out=noise[j])
        views = views.astype(np.int64)
        means = np.empty((count, *self.latent_shape), dtype=STORAGE_DTYPES_NUMPY[self.manifest["dtype"]])
        stds = np.zeros_like(means)  # a published folder's latents are fixed samples: no spread
        for shard in np.unique(shards):
            picked = shards == shard
            arrays = self._shard(int(shard))
            if self.published:
                for view, name in ((0, "latents"), (1, "latents_flip")):
                    chosen = picked & (views == view)
                    means[chosen] = arrays[name][rows[chosen]]
            else:
                means[picked] = arrays["mean"][rows[picked], views[picked]]
                stds[picked] = arrays["std"][rows[picked], views[picked]]
        latents = self.latent_norm.normalize(
            torch.from_numpy(means).float() + torch.from_numpy(stds).float() * noise
        )
        entries = self._starts[shards] + rows
        if not torch.isfinite(latents).all():  # the data's fault, not the lr's: named before the step
            bad = int(np.flatnonzero(~torch.isfinite(latents).flatten(1).all(1).numpy())[0])
            raise UserError(
                f"latent cache {self.dir}: {self._files[shards[bad]]} row {int(rows[bad])} holds non-finite "
                "latents (NaN or inf): the cache is damaged, not the training",
                "re-run the same extract-latents command (with --overwrite if it refuses) to rewrite it",
            )
        labels = self.labels[torch.from_numpy(entries)]
        if self.images is not None:  # the image each latent was encoded from, mirrored with its view
            pixels = [self.images.pixels(int(entry), bool(view)) for entry, view in zip(entries, views)]
            return list(zip(latents.unbind(0), labels.unbind(0), pixels))
        return list(zip(latents.unbind(0), labels.unbind(0)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([index])[0]


STORAGE_DTYPES_NUMPY = {"float16": np.float16, "float32": np.float32}
_SAFETENSORS_DTYPES = {"F16": np.float16, "F32": np.float32, "I64": np.int64}


_SAFETENSORS_NAMES = {
    "BF16": "bf16",
    "F64": "float64",
    "I32": "int32",
    "I16": "int16",
    "U8": "uint8",
    "I8": "int8",
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def _shard_header(path: Path) -> tuple[int, dict]:
    """A shard's header length and entries, each checked against the file: a name to a dtype this reader
    maps, a shape of whole numbers, data offsets inside the file that hold exactly that shape's bytes.
    ValueError names what is wrong; an unsupported dtype is a UserError naming it (the file is readable)."""
    size = path.stat().st_size
    with open(path, "rb") as stream:
        header_bytes = int.from_bytes(stream.read(8), "little")
        if not 0 < header_bytes <= min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"its header claims {header_bytes:,} bytes of a {size:,}-byte file")
        header = json.loads(stream.read(header_bytes))
    if not isinstance(header, dict):
        raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_bytes
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise ValueError(f"its header entry {name!r} is not a tensor's")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _SAFETENSORS_DTYPES:
            raise UserError(
                f"{path} holds {name} as {_SAFETENSORS_NAMES.get(dtype, dtype)}, which this reader does not "
                "take (latents float16 or float32, labels int64)",
                "convert the shard once (e.g. safetensors.torch: load_file, .to(torch.float16) / "
                ".to(torch.int64), save_file), or re-extract with dit-accel extract-latents",
            )
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError(f"its header gives {name} the shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
            raise ValueError(f"its header gives {name} the offsets {offsets!r}")
        start, end = offsets
        needed = int(np.prod(shape, dtype=object)) * np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize
        if not 0 <= start <= end <= data_bytes or end - start != needed:
            raise ValueError(
                f"its header puts {name} ({shape}) at bytes {start}-{end} of {data_bytes:,}, which hold "
                f"{end - start:,} bytes, not {needed:,}"
            )
    return header_bytes, header


def map_shard(path: Path) -> dict[str, np.ndarray]:
    """A shard's tensors as read-only numpy views of one memory map. The safetensors layout is an
    8-byte little-endian header length, a JSON header (dtype, shape, data offsets), then the bytes;
    numpy fancy indexing on the map gathers a batch ten times faster than safetensors' own slices."""
    header_bytes, header = _shard_header(Path(path))
    if all(entry["data_offsets"][1] == 0 for entry in header.values()):  # an empty shard: nothing to map
        return {
            name: np.empty(entry["shape"], _SAFETENSORS_DTYPES[entry["dtype"]])
            for name, entry in header.items()
        }
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_bytes)
    return {
        name: data[entry["data_offsets"][0] : entry["data_offsets"][1]]
        .view(_SAFETENSORS_DTYPES[entry["dtype"]])
        .reshape(entry["shape"])
        for name, entry in header.items()
    }


def _allow_open_files(needed: int) -> None:
    """Raise the soft limit on open files towards `needed` (within the hard limit) where it is lower."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
