"""Model outputs to files: [-1, 1] tensors -> uint8 arrays -> PNG grids and singles; atomic file and folder writes.

Kept apart from sampling so that the sampler, the exporter and the README figure all quantise the same
way: x in [-1, 1] maps to round((x + 1) * 127.5) clamped to [0, 255], the usual 8-bit convention for
images a diffusion model was trained on after scaling pixels to [-1, 1].
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import torch
from PIL import Image

from dit_accel.data.folder import permissions


def to_uint8_nhwc(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) floats in [-1, 1] -> (N, H, W, 3) uint8, the layout FID evaluators and PIL read."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected (N, 3, H, W) images, got shape {tuple(images.shape)}")
    pixels = ((images.detach().float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def make_grid(images: np.ndarray, columns: int, padding: int = 2, fill: int = 255) -> np.ndarray:
    """Tile (N, H, W, 3) uint8 images row by row into one (rows*(H+p)+p, cols*(W+p)+p, 3) picture."""
    count, height, width, channels = images.shape
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    grid = np.full((rows * (height + padding) + padding, columns * (width + padding) + padding, channels),
                   fill, dtype=np.uint8)
    for index, image in enumerate(images):
        top = padding + (index // columns) * (height + padding)
        left = padding + (index % columns) * (width + padding)
        grid[top:top + height, left:left + width] = image
    return grid


def grid_columns(count: int, per_class: int) -> int:
    """One row per class when there are several samples per class, else a near-square grid."""
    return per_class if per_class > 1 else math.ceil(math.sqrt(count))


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(file)` on a temporary file beside `path`, fsync, then rename it to `path`: a reader (or a
    rerun after a kill) sees the whole file or none of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, permissions(0o666))  # mkstemp makes 0600; a plain open() would honour the umask
        with os.fdopen(handle, "wb") as tmp_file:
            write(tmp_file)
            tmp_file.flush()
            os.fsync(tmp_file.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def save_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """One (H, W, 3) uint8 array as a PNG, written atomically."""
    return write_atomically(path, lambda file: Image.fromarray(image).save(file, format="PNG"))


@contextlib.contextmanager
def staged_folder(out_dir: str | os.PathLike, overwrite: bool = False):
    """Yield an empty folder beside `out_dir` to fill; when the block succeeds it replaces `out_dir` whole
    (an old one is removed only after), when it fails it is deleted. A reader never sees half a folder."""
    from dit_accel.errors import UserError
    from dit_accel.model import _replace_dir as replace_dir

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise UserError(f"{out_dir} exists and is not an empty folder: choose a new --out or pass --overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield staging
        _umask_permissions(staging)
        replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _umask_permissions(folder: Path) -> None:
    """Give a finished folder the modes a plain mkdir/open would have: mkdtemp/mkstemp (here and in the
    libraries that wrote into it) make 0700/0600, which hides a shared output from a cluster's other users."""
    os.chmod(folder, permissions(0o777))
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), permissions(0o777))
        for name in files:
            os.chmod(os.path.join(root, name), permissions(0o666))


def singles_dir_for(grid_path: str | os.PathLike) -> Path:
    """grid.png -> grid_images/: where the single images of a grid go."""
    grid_path = Path(grid_path)
    return grid_path.with_name(f"{grid_path.stem}_images")


def single_image_name(index: int, label: int) -> str:
    return f"{index:06d}_class{label}.png"


def save_grid_and_singles(images: np.ndarray, labels: list[int], grid_path: str | os.PathLike,
                          columns: int) -> tuple[Path, Path]:
    """Save the grid PNG and every image alone (grid_images/000000_class207.png ...).

    The singles folder is built under a temporary name and swapped in whole, so a reader never sees a
    mix of an old and a new run.
    """
    grid_path = Path(grid_path)
    singles_dir = singles_dir_for(grid_path)
    with staged_folder(singles_dir, overwrite=True) as staging:
        for index, (image, label) in enumerate(zip(images, labels)):
            Image.fromarray(image).save(staging / single_image_name(index, int(label)), format="PNG")
    save_png(make_grid(images, columns), grid_path)
    return grid_path, singles_dir
