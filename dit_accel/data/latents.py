"""The latent cache: encode an image folder once with a VAE, then train on latents instead of pixels.

Writing: `dit-accel extract-latents --data-path DIR --vae PATH --resolution 256 --out CACHE` (or under
`accelerate launch -m dit_accel.data.latents ...`, one process per GPU). Every image and its mirror
image are encoded; the posterior mean and std are stored, not a sample, so each epoch can draw a fresh
latent as DiT's own training does. The images are cut into fixed shards (`--shard-size` images in list
order); each rank writes whole shards of its own, each atomically (temporary file, then rename), and a
rerun verifies and keeps the complete ones. Rank 0 writes manifest.json last, after every rank is done:
a cache without a manifest is incomplete and the reader refuses it. A complete cache is never written
into: its replacement is made in the sibling `.CACHE.extracting` and swapped in whole, and one made with
another configuration (resolution, VAE, data, layout) is replaced only with --overwrite.

A stop signal (SIGTERM or SIGUSR1, as a preempting scheduler sends) ends every rank at its next batch: the
shard in progress is dropped, the complete ones are kept, no manifest is written, and the command exits 4
(`errors.EXIT_PREEMPTED`): rerun it to resume. The image-decoding workers ignore the signal
(`preemption.WorkerShield`), so they do not fail the rank first.

Reading (dit_accel.data.latent_cache): `LatentCache(CACHE)` memory-maps the safetensors shards with numpy and yields
`(latent, label)` with latent = (mean + std * noise - shift) * scale per channel (`models.vae.LatentNorm`:
the VAE's factors, or a VA-VAE's per-channel statistics over this cache, recorded in the manifest).

On disk (CACHE/):
    manifest.json                 everything below, plus the VAE identity and per-shard sha256
    classes.json                  the class-to-index map
    shard-00000.safetensors ...   mean, std: [n, views, C, h, w] (views = 2: image, mirror);
                                  label: [n] int64; source_index: [n] int64 (position in the listing);
                                  metadata `sources`: each entry's image (a folder's relative path,
                                  a dataset's `row N`), JSON; `source_bytes`: each image file's size
                                  as encoded (-1 for a dataset's row)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from dit_accel.atomic import replace_folder, write_bytes_atomically, write_json_atomically
from dit_accel.data.folder import (
    FolderListing,
    center_crop_adm,
    image_to_uint8,
    uint8_to_unit_range,
    write_classes_json,
)
from dit_accel.data.hf_source import DatasetOptions, validate_image_source
from dit_accel.data.latent_cache import FORMAT, MANIFEST_NAME
from dit_accel.data.latents_args import STORAGE_DTYPE_NAMES, build_parser
from dit_accel.errors import EXIT_PREEMPTED, UserError, exit_command, exits_cleanly
from dit_accel.models.vae import LatentNorm, encode_posterior, load_vae, sha256_json
from dit_accel.run.preemption import StopRequest, WorkerShield, signal_name

STORAGE_DTYPES = {name: getattr(torch, name) for name in STORAGE_DTYPE_NAMES}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExtractionStopped(Exception):
    """A stop signal ended the extraction at a batch boundary, or during its start-up; the message says what
    is kept."""


class _StartUpStop:
    """Until the encoding starts (and installs its own `StopRequest`), a stop signal ends the command at once:
    nothing is written before the encoding but the empty cache folder, which the failure path removes. Without
    it the interpreter's default action killed the process (exit 143, not 4)."""

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._stop) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *_exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def _stop(signum, _frame):
        raise ExtractionStopped(
            f"preempted by {signal_name(signum)} during start-up, before any shard was encoded; exit "
            f"{EXIT_PREEMPTED} (rerun the same command)"
        )


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def _sha256_tensors(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Extraction


@dataclass
class ExtractConfig:
    data_path: str
    vae: str
    out: str
    resolution: int = 256
    batch_size: int = 32  # images per VAE call (the VAE sees twice as many with mirror images)
    shard_size: int = 2048  # images per shard file
    flip: bool = True
    skip_bad_images: bool = False
    dtype: str = "float16"
    num_workers: int | None = None  # DataLoader workers decoding images; None: up to 4 per process
    overwrite: bool = False  # replace a complete cache made differently
    split: str | None = None  # a dataset's split (dit_accel.data.hf_source); None: train, or its only one
    image_column: str = "image"
    label_column: str = "label"


@dataclass
class ExtractResult:
    out: Path
    count: int  # images stored (rank 0 only; 0 elsewhere)
    is_main_process: bool = True
    shards_written: list[int] = field(default_factory=list)  # by this process
    shards_reused: list[int] = field(default_factory=list)  # by this process
    skipped: list[str] = field(default_factory=list)  # all processes (rank 0 only)


class _ImagesToEncode(torch.utils.data.Dataset):
    """(uint8 pixels [3, R, R], label, source index, problem) for one listing entry; an image that does not
    decode yields empty pixels and the problem, so the main process decides to skip or stop."""

    def __init__(self, listing: FolderListing, resolution: int):
        self.listing, self.resolution = listing, resolution

    def __len__(self) -> int:
        return len(self.listing)

    def __getitem__(self, index: int):
        label = self.listing.labels[index]
        try:
            image = self.listing.load(index)
        except UserError as error:
            return torch.empty(0, dtype=torch.uint8), label, index, str(error)
        return image_to_uint8(center_crop_adm(image, self.resolution)), label, index, ""


def _collate(items):
    good = [item for item in items if not item[3]]
    pixels = torch.stack([item[0] for item in good]) if good else None
    return {
        "pixels": pixels,
        "labels": torch.tensor([item[1] for item in good], dtype=torch.int64),
        "indices": torch.tensor([item[2] for item in good], dtype=torch.int64),
        "bad": [(item[2], item[3]) for item in items if item[3]],
    }


def _write_shard(out: Path, shard: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Serialise in memory, hash, write to a temporary file, fsync, rename: a shard file is complete or absent."""
    metadata = dict(metadata, content_sha256=_sha256_tensors(tensors))
    payload = safetensors.torch.save(tensors, metadata=metadata)
    write_bytes_atomically(out / shard_name(shard), payload)
    return _shard_record(shard, payload, metadata)


def _shard_record(shard: int, payload: bytes, metadata: dict[str, str]) -> dict:
    return {
        "file": shard_name(shard),
        "shard": shard,
        "count": int(metadata["count"]),
        "planned": int(metadata["planned"]),
        "first_index": int(metadata["first_index"]),
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "rank": int(metadata["rank"]),
        "world_size": int(metadata["world_size"]),
        "skipped": json.loads(metadata["skipped"]),
        "channel_sums": json.loads(metadata["channel_sums"]) if "channel_sums" in metadata else None,
    }


def extract_latents(config: ExtractConfig) -> ExtractResult:
    """Encode `config.data_path` into a latent cache at `config.out`; see the module docstring.

    Every process of an `accelerate launch` calls this; each encodes a share of the missing shards."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if config.dtype not in STORAGE_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(STORAGE_DTYPES)}, not {config.dtype!r}")
    if config.batch_size < 1 or config.shard_size < 1:
        raise UserError("--batch-size and --shard-size must be at least 1")

    # The cheap checks first, on every rank: a wrong path fails before a VAE or a process group exists.
    out = Path(config.out).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file", "pass a folder for the latent cache")
    options = DatasetOptions(config.split, config.image_column, config.label_column)
    summary = validate_image_source(
        config.data_path, options, sample=True, skip_bad_images=config.skip_bad_images
    )
    listing = summary.listing
    if listing is None:  # a stream (webdataset shards): its listing grows as the one pass reads it
        from dit_accel.data.stream_latents import stream_listing

        listing = stream_listing(summary, options)
    streamed = getattr(listing, "streamed", False)
    vae, identity = load_vae(config.vae)
    downsample = 2 ** (len(vae.config.block_out_channels) - 1)
    if config.resolution < downsample or config.resolution % downsample:
        raise UserError(
            f"--resolution {config.resolution} is not a multiple of the VAE's downsampling "
            f"factor {downsample}",
            f"pick e.g. {config.resolution // downsample * downsample or downsample}",
        )
    run_key = sha256_json(
        {
            "format": FORMAT,
            "vae": [identity["config_sha256"], identity["weights_sha256"]],
            "resolution": config.resolution,
            "flip": config.flip,
            "dtype": config.dtype,
            "shard_size": config.shard_size,
        }
    )
    previous = _complete_manifest(out)
    if previous is not None and not config.overwrite:
        _refuse_another_configuration(previous, out, config, identity, listing)
    # A complete cache is never written into: its replacement is made beside it and swapped in whole.
    work = out.parent / f".{out.name}.extracting" if previous is not None else out

    state = PartialState(cpu=not torch.cuda.is_available())
    vae.to(state.device)
    layout = _Layout(
        out=work,
        listing=listing,
        shard_size=config.shard_size,
        views=2 if config.flip else 1,
        latent_shape=[int(vae.config.latent_channels)] + [config.resolution // downsample] * 2,
        dtype=STORAGE_DTYPES[config.dtype],
        rank=state.process_index,
        world_size=state.num_processes,
        run_key=run_key,
    )

    # Rank 0 marks the cache incomplete and clears temporary files of a killed run before anyone writes,
    # and tells everyone which shard files exist (one view of a shared filesystem for all nodes).
    present: list[list[int]] = [[]]
    made = []  # the cache folder, when this command made it: removed again if it fails before any shard
    if state.is_main_process:
        if not work.exists():
            made.append(work)
        work.mkdir(parents=True, exist_ok=True)
        (work / MANIFEST_NAME).unlink(missing_ok=True)  # only ever an incomplete cache's (or none)
        for leftover in work.glob(".*.tmp"):  # shards, manifest or class map never renamed into place
            leftover.unlink(missing_ok=True)
        if work != out:
            _link_shards(out, work)
        shards = range(layout.num_shards) if not streamed else _shard_numbers(work)
        present = [[k for k in shards if (work / shard_name(k)).is_file()]]
    broadcast_object_list(present)
    state.wait_for_everyone()
    try:
        return _extract(
            config, state, layout, listing, streamed, present[0], vae, identity, work, out, summary
        )
    except BaseException:
        for folder in made:  # nothing of it is kept when nothing was written
            _remove_if_empty(folder)
        raise


def _remove_if_empty(folder: Path) -> None:
    """Remove a cache folder this command made if it holds no shard (only temporary files, or nothing)."""
    if any(folder.glob("shard-*.safetensors")):
        return
    for leftover in folder.glob(".*.tmp"):
        leftover.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # something else is in it: not ours to remove
        pass


def _extract(config, state, layout, listing, streamed, present, vae, identity, work, out, summary):
    """Every process: its share of the shards, encoded (or reused), then the manifest (`_encode_and_finish`)."""
    result = ExtractResult(out=out, count=0, is_main_process=state.is_main_process)
    records: list[dict] = []
    if streamed:  # one ordered pass; each process encodes the shards it owns as the pass reaches them
        from dit_accel.data.stream_latents import stream_batches

        loader = stream_batches(layout, present, config, result, records, _reuse_shard, _collate)
        return _encode_and_finish(
            layout, loader, None, vae, config, state, result, records, identity, work, out
        )
    # Ranks share out what remains to do, so a resumed run stays balanced.
    missing = sorted(set(range(layout.num_shards)) - set(present))
    to_encode = missing[layout.rank :: layout.world_size]
    for shard in present[layout.rank :: layout.world_size]:
        record = _reuse_shard(layout, shard)
        if record is None:
            to_encode.append(shard)
        else:
            records.append(record)
            result.shards_reused.append(shard)
    to_encode.sort()

    batches = [
        list(bounds[i : i + config.batch_size])
        for bounds in map(layout.bounds, to_encode)
        for i in range(0, len(bounds), config.batch_size)
    ]
    num_workers = config.num_workers
    if num_workers is None:
        num_workers = min(4, max(0, (os.cpu_count() or 1) // state.num_processes - 1))
    loader = torch.utils.data.DataLoader(
        _ImagesToEncode(listing, config.resolution),
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=state.device.type == "cuda",
        worker_init_fn=WorkerShield(STOP_SIGNALS),
    )
    total = sum(map(len, batches))
    return _encode_and_finish(
        layout, loader, total, vae, config, state, result, records, identity, work, out, summary
    )


def _encode_and_finish(
    layout, loader, total, vae, config, state, result, records, identity, work, out, summary=None
):
    """Every process: encode its batches into shards; then, all of them done (or stopped), rank 0 writes
    the manifest. `summary`: the folder's or dataset's check; None for a stream, whose pass makes it."""
    from accelerate.utils import gather_object

    from dit_accel.progress import progress_bar

    progress = progress_bar(
        total=total,
        unit="img",
        disable=not state.is_main_process,
        desc=f"encoding (rank 0 of {layout.world_size})",
    )
    # A signal from here on ends the encoding at a batch; once every shard is written, the manifest is
    # finished whatever comes.
    stop = StopRequest().install(STOP_SIGNALS)
    try:
        try:
            for record in _encode_shards(layout, loader, vae, config.skip_bad_images, progress, stop):
                records.append(record)
                result.shards_written.append(record["shard"])
        except BaseException:
            progress.leave = False  # clear the bar so that the error is the last line a user sees
            raise
        finally:
            progress.close()

        # Every rank comes here, done or stopped: the records and stops of all, one collective.
        gathered = gather_object([(records, stop.signum)])
        stopped_by = next((signum for _, signum in gathered if signum), 0)
        if stopped_by:
            kept = sum(len(shard_records) for shard_records, _ in gathered)
            state.wait_for_everyone()
            raise ExtractionStopped(
                f"preempted by {signal_name(stopped_by)}: {kept} of {layout.num_shards} shards of {work} "
                f"are complete and kept, no manifest written; exit {EXIT_PREEMPTED} (rerun the same command to "
                f"resume)"
            )
        all_records = [record for shard_records, _ in gathered for record in shard_records]
        if state.is_main_process:
            summary = summary or layout.listing.summary()
            manifest = _write_manifest(
                layout, sorted(all_records, key=lambda r: r["shard"]), summary, identity, config, vae.config
            )
            result.count, result.skipped = manifest["count"], manifest["skipped"]
            if work != out:
                replace_folder(work, out)  # the old cache stays whole until the new one is
        state.wait_for_everyone()  # no rank exits before the manifest exists
        return result
    finally:
        stop.close()


def _shard_numbers(folder: Path) -> list[int]:
    """The shard files in `folder`, by number (a stream's count of shards is known only after its pass)."""
    return sorted(
        int(path.name[len("shard-") : -len(".safetensors")]) for path in folder.glob("shard-*.safetensors")
    )


def _complete_manifest(out: Path) -> dict | None:
    """The manifest of a complete cache at `out`, or None (no cache, or one a killed run left incomplete)."""
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _refuse_another_configuration(previous: dict, out: Path, config, identity: dict, listing) -> None:
    """A complete cache is replaced by one made differently only with --overwrite."""
    wanted = {
        "--resolution": (previous.get("resolution"), config.resolution),
        "--vae": ((previous.get("vae") or {}).get("weights_sha256"), identity["weights_sha256"]),
        "--data-path": (previous.get("data_path"), listing.location),
        "--split": (previous.get("split"), getattr(listing, "split", None)),
        "--shard-size": (previous.get("shard_size"), config.shard_size),
        "--dtype": (previous.get("dtype"), config.dtype),
        "--hflip": (previous.get("flip"), config.flip),
    }
    changed = [f"{flag} {old} -> {new}" for flag, (old, new) in wanted.items() if old != new]
    changed = [text if not text.startswith("--vae") else "--vae (other weights)" for text in changed]
    if changed:
        raise UserError(
            f"--out {out} holds a complete latent cache made differently ({'; '.join(changed)})",
            "pass --overwrite to replace it (it is kept until the new one is complete) "
            "or choose another --out",
        )


def _link_shards(old: Path, work: Path) -> None:
    """Hard-link the complete cache's shards into the staging folder, so that those still valid are reused
    (checked as on any resume) without a copy; where links are impossible they are encoded again."""
    for shard in old.glob("shard-*.safetensors"):
        try:
            if not (work / shard.name).exists():
                os.link(shard, work / shard.name)
        except OSError:
            return


@dataclass
class _Layout:
    """Where each image goes: shard k holds listing entries [k * shard_size, (k + 1) * shard_size)."""

    out: Path
    listing: FolderListing
    shard_size: int
    views: int
    latent_shape: list[int]
    dtype: torch.dtype
    rank: int
    world_size: int
    run_key: str  # what must match for a shard to be reused: VAE, resolution, flip, dtype, shard size

    @property
    def num_shards(self) -> int:
        return -(-len(self.listing) // self.shard_size)

    def bounds(self, shard: int) -> range:
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, len(self.listing)))

    def sources_sha256(self, shard: int) -> str:
        """The images a shard is made of, so a shard of a changed folder is not reused."""
        return sha256_json(
            [[self.listing.source_key(i), int(self.listing.labels[i])] for i in self.bounds(shard)]
        )


def _reuse_shard(layout: _Layout, shard: int) -> dict | None:
    """The record of a complete shard written by an earlier run with the same VAE, resolution, layout
    and images; None when it is damaged or was made differently (it is then encoded again)."""
    path = layout.out / shard_name(shard)
    try:
        payload = path.read_bytes()
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = safetensors.torch.load(payload)
    except (OSError, ValueError, RuntimeError, safetensors.SafetensorError):
        return None
    if (
        metadata.get("format") != FORMAT
        or metadata.get("run_key") != layout.run_key
        or metadata.get("sources_sha256") != layout.sources_sha256(shard)
        or metadata.get("content_sha256") != _sha256_tensors(tensors)
    ):
        return None
    return _shard_record(shard, payload, metadata)


def _encode_shards(layout: _Layout, loader, vae, skip_bad_images: bool, progress, stop: StopRequest):
    """Encode the loader's batches (which never straddle shards) and write each shard as it completes;
    yields the shard records. Ends early, dropping the shard in progress, once `stop` was signalled."""
    pending: dict[int, dict[str, list]] = {}
    for batch in loader:
        if stop.signum:
            return
        first = batch["indices"][0].item() if len(batch["indices"]) else batch["bad"][0][0]
        shard = first // layout.shard_size
        parts = pending.setdefault(
            shard,
            {
                "mean": [],
                "std": [],
                "label": [],
                "source_index": [],
                "skipped": [],
                "sources": [],
                "bytes": [],
            },
        )
        for index, problem in batch["bad"]:
            if not skip_bad_images:
                raise UserError(problem)
            parts["skipped"].append(layout.listing.name(index))
        if batch["pixels"] is not None:
            pixels = uint8_to_unit_range(batch["pixels"].to(vae.device, non_blocking=True))
            if layout.views == 2:
                pixels = torch.cat([pixels, pixels.flip(-1)])
            mean, std = encode_posterior(vae, pixels)
            # [views * b, C, h, w] -> [b, views, C, h, w]: row i holds image i, then its mirror image
            for name, value in (("mean", mean), ("std", std)):
                parts[name].append(
                    value.unflatten(0, (layout.views, -1)).transpose(0, 1).to("cpu", layout.dtype)
                )
            parts["label"].append(batch["labels"])
            parts["source_index"].append(batch["indices"])
            parts["sources"] += [layout.listing.name(i) for i in batch["indices"].tolist()]
            parts["bytes"] += [source_bytes(layout.listing, i) for i in batch["indices"].tolist()]
        progress.update(len(batch["indices"]) + len(batch["bad"]))

        bounds = layout.bounds(shard)
        if sum(map(len, parts["label"])) + len(parts["skipped"]) == len(bounds):
            del pending[shard]
            no_rows = {
                "mean": (layout.views, *layout.latent_shape),
                "std": (layout.views, *layout.latent_shape),
                "label": (),
                "source_index": (),
            }  # a shard whose images were all skipped
            tensors = {
                name: torch.cat(parts[name])
                if parts[name]
                else torch.empty(0, *shape, dtype=layout.dtype if shape else torch.int64)
                for name, shape in no_rows.items()
            }
            metadata = {
                "format": FORMAT,
                "run_key": layout.run_key,
                "sources_sha256": layout.sources_sha256(shard),
                "shard": str(shard),
                "first_index": str(bounds.start),
                "planned": str(len(bounds)),
                "count": str(len(tensors["label"])),
                "rank": str(layout.rank),
                "world_size": str(layout.world_size),
                "skipped": json.dumps(parts["skipped"]),
                "sources": json.dumps(parts["sources"]),
                "source_bytes": json.dumps(parts["bytes"]),
                "channel_sums": json.dumps(channel_sums(tensors["mean"], tensors["std"])),
            }
            yield _write_shard(layout.out, shard, tensors, metadata)


def source_bytes(listing, index: int) -> int:
    """The size of entry `index`'s image file as it was encoded (-1 for a dataset's row): REPA's reader holds
    each source it reads to it (`cache_images`), so an image replaced since is not read as the latent's."""
    root = getattr(listing, "root", None)
    if root is None or not hasattr(listing, "paths"):
        return -1
    return os.stat(Path(root) / listing.paths[index]).st_size


def channel_sums(mean: torch.Tensor, std: torch.Tensor) -> dict:
    """Per channel, over every entry's first view and position: the count, and the sums of the posterior's
    mean, its square and its variance (float64): what `channel_statistics` combines over the shards."""
    m, s = mean[:, 0].double(), std[:, 0].double()
    dims = (0, 2, 3)
    return {
        "count": int(m.shape[0] * m.shape[2] * m.shape[3]) if m.ndim == 4 else 0,
        "mean": m.sum(dims).tolist() if m.numel() else [],
        "mean_sq": (m * m).sum(dims).tolist() if m.numel() else [],
        "var": (s * s).sum(dims).tolist() if s.numel() else [],
    }


def channel_statistics(records: list[dict], channels: int) -> tuple[list[float], list[float]]:
    """Each channel's mean and std of a posterior sample over the whole cache: E[z] = E[mean], and
    Var[z] = E[mean^2] + E[std^2] - E[mean]^2 (exact, no sample drawn)."""
    count, total, squares, variances = 0, [0.0] * channels, [0.0] * channels, [0.0] * channels
    for record in records:
        sums = record.get("channel_sums")
        if sums is None:  # kept from a version before per-channel statistics
            raise UserError(
                f"shard {record['file']} records no channel sums", "extract again with --overwrite"
            )
        if not sums["count"]:
            continue
        count += sums["count"]
        for c in range(channels):
            total[c] += sums["mean"][c]
            squares[c] += sums["mean_sq"][c]
            variances[c] += sums["var"][c]
    if not count:
        raise UserError("no image was encoded: per-channel statistics need at least one latent")
    mean = [value / count for value in total]
    std = [max((squares[c] + variances[c]) / count - mean[c] ** 2, 0.0) ** 0.5 for c in range(channels)]
    return mean, std


def _write_manifest(
    layout: _Layout, records: list[dict], summary, identity: dict, config: ExtractConfig, vae_config
) -> dict:
    """Rank 0, after every rank is done: the manifest is what makes the cache complete."""
    if [record["shard"] for record in records] != list(range(layout.num_shards)):
        lost = sorted(set(range(layout.num_shards)) - {record["shard"] for record in records})
        raise RuntimeError(f"shards {lost} were not written; the manifest is not written")
    skipped = summary.bad_images + [rel for record in records for rel in record.pop("skipped")]
    images_per_class = dict(summary.images_per_class)
    for rel in skipped[len(summary.bad_images) :]:  # validation already left its own out of the counts
        images_per_class[layout.listing.class_of(rel)] -= 1
    for stale in layout.out.glob("shard-*.safetensors"):  # from an earlier run over more images
        if stale.name not in {record["file"] for record in records}:
            stale.unlink()
    write_classes_json(layout.out, layout.listing.classes)
    manifest = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "data_path": layout.listing.location,
        "split": getattr(layout.listing, "split", None),
        "vae": identity,
        "resolution": config.resolution,
        "latent_shape": layout.latent_shape,
        "latent_norm": _latent_norm(identity, records, vae_config, layout.latent_shape[0]).to_json(),
        "dtype": config.dtype,
        "flip": config.flip,
        "views": layout.views,
        "count": sum(record["count"] for record in records),
        "skipped": skipped,
        "classes": layout.listing.classes,
        "images_per_class": images_per_class,
        "shard_size": layout.shard_size,
        "world_size": layout.world_size,
        "run_key": layout.run_key,
        "shards": records,
    }
    write_json_atomically(layout.out / MANIFEST_NAME, manifest)
    return manifest


def _latent_norm(identity: dict, records: list[dict], vae_config, channels: int) -> LatentNorm:
    """The Stable Diffusion VAE's factors, or for a VA-VAE the cache's own per-channel statistics."""
    if identity.get("latent_norm") == "channel":
        return LatentNorm.of_statistics(*channel_statistics(records, channels))
    return LatentNorm.of_vae_config(vae_config, channels)


@exits_cleanly("dit-accel extract-latents")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    config = ExtractConfig(**vars(args))
    try:
        with _StartUpStop():
            result = extract_latents(config)
    except ExtractionStopped as stopped:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(f"dit-accel extract-latents: {stopped}", file=sys.stderr)
        return EXIT_PREEMPTED
    if result.is_main_process:
        skipped = f", {len(result.skipped)} undecodable images skipped" if result.skipped else ""
        print(
            f"latent cache {result.out}: {result.count} images x {2 if config.flip else 1} views{skipped}; "
            f"manifest {result.out / MANIFEST_NAME}"
        )
    return 0


if __name__ == "__main__":
    exit_command(main)
