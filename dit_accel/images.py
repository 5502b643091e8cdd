"""Model outputs to files: [-1, 1] tensors -> uint8 arrays -> PNG grids and singles, written atomically.

Kept apart from sampling so that the sampler, the exporter and the README figure all quantise the same
way: x in [-1, 1] maps to round((x + 1) * 127.5) clamped to [0, 255], the usual 8-bit convention for
images a diffusion model was trained on after scaling pixels to [-1, 1].
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dit_accel.atomic import staged_folder, write_atomically


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
    grid = np.full(
        (rows * (height + padding) + padding, columns * (width + padding) + padding, channels),
        fill,
        dtype=np.uint8,
    )
    for index, image in enumerate(images):
        top = padding + (index // columns) * (height + padding)
        left = padding + (index % columns) * (width + padding)
        grid[top : top + height, left : left + width] = image
    return grid


def grid_columns(count: int, per_class: int) -> int:
    """One row per class when there are several samples per class, else a near-square grid."""
    return per_class if per_class > 1 else math.ceil(math.sqrt(count))


def save_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """One (H, W, 3) uint8 array as a PNG, written atomically."""
    return write_atomically(path, lambda file: Image.fromarray(image).save(file, format="PNG"))


def singles_dir_for(grid_path: str | os.PathLike) -> Path:
    """grid.png -> grid_images/: where the single images of a grid go."""
    grid_path = Path(grid_path)
    return grid_path.with_name(f"{grid_path.stem}_images")


def single_image_name(index: int, label: int) -> str:
    return f"{index:06d}_class{label}.png"


def save_grid_and_singles(
    images: np.ndarray, labels: list[int], grid_path: str | os.PathLike, columns: int
) -> tuple[Path, Path]:
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
