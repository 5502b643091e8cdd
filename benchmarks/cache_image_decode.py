"""What REPA from a latent cache costs the DataLoader: decoding each latent's source image beside it.

Writes ImageNet-sized JPEGs (500 x 375, quality 90: the average ImageNet training image is about 400 x 350 and
110 KB) as an image folder, extracts nothing, and times `CacheImages.pixels` (decode, ADM centre crop to
--resolution, mirror, to float) over them on one core, against reading the same entries' latents alone.
Prints milliseconds per image and the CPU cores one GPU needs at a given rate of images per second.

    python benchmarks/cache_image_decode.py [--images 256] [--resolution 256] [--rate 160]

Nothing is written into the repository; the images go to a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument(
        "--rate", type=float, default=160.0, help="images/s one GPU trains (REPA XL/2 on H100)"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from dit_accel.data.cache_images import CacheImages
    from dit_accel.data.source_kind import DatasetOptions

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images" / "n00000000"
        root.mkdir(parents=True)
        rng = np.random.default_rng(0)
        names = []
        for k in range(args.images):  # smooth noise compresses like a photograph, not like white noise
            small = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
            image = Image.fromarray(small).resize((500, 375), Image.BICUBIC)
            name = f"n00000000/img_{k:05d}.JPEG"
            image.save(Path(tmp) / "images" / name, quality=90)
            names.append(name)
        sizes = [(Path(tmp) / "images" / n).stat().st_size for n in names]
        images = CacheImages.__new__(CacheImages)  # the reader alone: no cache needed to time the decode
        images.root, images.resolution, images.kind = str(Path(tmp) / "images"), args.resolution, None
        images.options, images._rows = DatasetOptions(), None
        images.sources = np.array(names, dtype=np.bytes_)
        images.pixels(0, False)  # warm the decoder
        start = time.perf_counter()
        for k in range(args.images):
            images.pixels(k, bool(k % 2))
        per_image_s = (time.perf_counter() - start) / args.images
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}"
    )
    print(f"{args.images} JPEGs of 500 x 375, mean {np.mean(sizes) / 1e3:.0f} kB, to {args.resolution} px:")
    print(f"  decode + crop + mirror + float: {per_image_s * 1e3:.2f} ms per image on one core")
    print(f"  at {args.rate:.0f} img/s per GPU: {per_image_s * args.rate:.2f} cores per GPU")


if __name__ == "__main__":
    main()
