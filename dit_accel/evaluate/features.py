"""Inception features of many images, on every rank of an Accelerate run: each rank takes its own share,
the shares are gathered and put back in the images' global order (the Inception Score's splits follow it).

Images come as the ADM evaluator reads them: `arr_0` of an .npz, uint8, (N, H, W, 3), read a slice at a
time from the archive member (a 50,000-image batch at 256 px is 9.8 GB, never loaded whole).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dit_accel.errors import UserError
from dit_accel.evaluate.inception import InceptionV3, full_fp32
from dit_accel.progress import progress_bar

ADM_BATCH = 64  # images per forward pass in the evaluator


@dataclass(frozen=True)
class Features:
    """Per image: pool_3 (2048), mixed_6/conv's first 7 channels flattened (2023), unbiased logits (1008)."""

    pool: np.ndarray
    spatial: np.ndarray
    logits: np.ndarray

    def __len__(self) -> int:
        return len(self.pool)


class NpzImages:
    """`arr_0` of an .npz in the ADM layout, read in slices [start, stop) by seeking in its member."""

    def __init__(self, path: str | Path, what: str = "the .npz"):
        self.path = Path(path)
        fix = f"pass {what} as an .npz whose arr_0 holds uint8 images (N, H, W, 3), as `dit-accel sample --npz` writes"
        if not self.path.is_file():
            raise UserError(f"{what} {self.path} does not exist", fix)
        try:
            with zipfile.ZipFile(self.path) as archive, archive.open("arr_0.npy") as member:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read_header(member)
                self.data_offset = member.tell()
        except (zipfile.BadZipFile, KeyError, ValueError, OSError) as error:
            raise UserError(
                f"{what} {self.path} has no readable arr_0 ({type(error).__name__}: {error})", fix
            ) from None
        if dtype != np.uint8 or len(shape) != 4 or shape[3] != 3 or fortran:
            layout = f"{dtype} {'Fortran-ordered ' if fortran else ''}array of shape {tuple(shape)}"
            raise UserError(f"arr_0 of {what} {self.path} is a {layout}", fix)
        self.shape = tuple(shape)
        self.image_bytes = int(np.prod(shape[1:]))

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        with zipfile.ZipFile(self.path) as archive, archive.open("arr_0.npy") as member:
            member.seek(self.data_offset + start * self.image_bytes)
            data = bytearray(member.read((stop - start) * self.image_bytes))  # writable, as torch wants
        return np.frombuffer(data, dtype=np.uint8).reshape(stop - start, *self.shape[1:])


def shard(count: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s contiguous share of `count` items, the first `count % world_size` ranks one more."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class FeatureCollector:
    """Features of the images this rank is given, with their global indices; `gathered` joins every rank's.
    Features wait on the CPU, so a 50,000-image evaluation holds 1 GB of host memory, not of the GPU's."""

    def __init__(self, network: InceptionV3, device: torch.device | str):
        self.network, self.device = network, torch.device(device)
        self.indices: list[torch.Tensor] = []
        self.outputs: list[tuple[torch.Tensor, ...]] = []

    def add(self, images, indices) -> None:
        """`images`: uint8 (n, H, W, 3), numpy or torch; `indices`: their n global positions."""
        batch = torch.as_tensor(np.asarray(images) if not torch.is_tensor(images) else images)
        with torch.no_grad(), full_fp32():
            outputs = self.network(batch.to(self.device))
        self.outputs.append(tuple(output.float().cpu() for output in outputs))
        self.indices.append(torch.as_tensor(list(indices), dtype=torch.long))

    def gathered(self, accelerator=None) -> Features:
        """Every rank's features in global index order, on every rank (one collective per output)."""
        widths = self.network.feature_widths
        local = [
            torch.cat([output[i] for output in self.outputs]) if self.outputs else torch.zeros(0, width)
            for i, width in enumerate(widths)
        ]
        indices = torch.cat(self.indices) if self.indices else torch.zeros(0, dtype=torch.long)
        if accelerator is not None and accelerator.num_processes > 1:
            device = accelerator.device
            indices = accelerator.gather(accelerator.pad_across_processes(indices.to(device), pad_index=-1))
            local = [accelerator.gather(accelerator.pad_across_processes(part.to(device))) for part in local]
            kept = indices >= 0
            indices, local = indices[kept], [part[kept] for part in local]
        order = torch.argsort(indices.cpu())
        pool, spatial, logits = (part.cpu()[order].numpy() for part in local)
        return Features(pool, spatial, logits)


def npz_features(
    images: NpzImages,
    network: InceptionV3,
    accelerator=None,
    batch_size: int = ADM_BATCH,
    desc: str = "features",
) -> Features:
    """Features of every image in `images`, each rank extracting its share (`shard`)."""
    rank, world_size = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    device = accelerator.device if accelerator else "cpu"
    mine = shard(len(images), rank, world_size)
    collector = FeatureCollector(network, device)
    bar = progress_bar(total=len(mine), desc=desc, unit="img", disable=rank != 0)
    for start in range(mine.start, mine.stop, batch_size):
        stop = min(start + batch_size, mine.stop)
        collector.add(images.read(start, stop), range(start, stop))
        bar.update(stop - start)
    bar.close()
    return collector.gathered(accelerator)
