"""Read throughput of the latent cache (samples/s) through `LatentCache` and a torch DataLoader.

Builds a real cache with the real writer: demo images encoded by a tiny AutoencoderKL whose latents
have the shape DiT-XL/2 trains on at 256 px (4 x 32 x 32), then reads it in shuffled batches of 256,
with 0 and 2 DataLoader workers, for float16 and float32 storage; whole batches (`__getitems__`, what
a plain DataLoader uses) and item by item (what a per-sample wrapper such as the trainer's uses). The
VAE's size does not matter here: the reader's cost is the memory-mapped read plus one posterior draw.

    OMP_NUM_THREADS=1 python benchmarks/latent_cache_read.py [--count 4096] [--epochs 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

from dit_accel.data.demo import write_demo_data
from dit_accel.data.latent_cache import LatentCache
from dit_accel.data.latents import ExtractConfig, extract_latents


def build_cache(work: Path, count: int, dtype: str) -> Path:
    from diffusers import AutoencoderKL

    vae_dir, images = work / "vae", work / "images"
    if not vae_dir.exists():
        torch.manual_seed(0)
        AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            latent_channels=4,
            norm_num_groups=4,
            layers_per_block=1,
            sample_size=64,
        ).save_pretrained(vae_dir)
    if not images.exists():
        write_demo_data(images, classes=8, per_class=count // 8, resolution=64)
    out = work / f"cache_{dtype}"
    extract_latents(
        ExtractConfig(
            data_path=str(images),
            vae=str(vae_dir),
            out=str(out),
            resolution=64,
            batch_size=128,
            shard_size=1024,
            dtype=dtype,
            num_workers=0,
        )
    )
    return out


class OneAtATime(torch.utils.data.Dataset):
    """The cache read item by item, as a wrapper that seeds each sample itself (the trainer's) reads it."""

    def __init__(self, cache: LatentCache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int):
        return self.cache[index]


def samples_per_second(cache, workers: int, epochs: int, batch_size: int = 256) -> float:
    loader = torch.utils.data.DataLoader(
        cache,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        drop_last=False,
    )
    for _ in loader:  # warm-up epoch: worker start-up, page cache, first opens of the shards
        pass
    start = time.perf_counter()
    seen = 0
    for _ in range(epochs):
        for _latents, labels in loader:
            seen += len(labels)
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4096, help="images in the cache (default 4096)")
    parser.add_argument("--epochs", type=int, default=2, help="timed passes per setting (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        for dtype in ("float16", "float32"):
            cache_dir = build_cache(work, args.count, dtype)
            cache_bytes = sum(p.stat().st_size for p in cache_dir.glob("shard-*"))
            for seed in (None, 0):
                cache = LatentCache(cache_dir, seed=seed)
                noise = "per (seed, epoch, index)" if seed is not None else "torch RNG"
                for workers in (0, 2):
                    rate = samples_per_second(cache, workers, args.epochs)
                    rows.append(
                        [
                            dtype,
                            noise,
                            "batch",
                            workers,
                            f"{rate:,.0f}",
                            f"{cache_bytes / len(cache) / 1024:.1f}",
                        ]
                    )
            rate = samples_per_second(OneAtATime(LatentCache(cache_dir)), 0, args.epochs)
            rows.append(
                [dtype, "torch RNG", "item", 0, f"{rate:,.0f}", f"{cache_bytes / len(cache) / 1024:.1f}"]
            )
            from accelerate.state import PartialState

            PartialState._reset_state()

    print(
        f"latent cache read, {args.count} samples of 4x32x32 (x2 views), batch 256, shuffled; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(
        tabulate(
            rows,
            headers=["storage", "noise", "access", "workers", "samples/s", "KiB/sample on disk"],
            tablefmt="github",
        )
    )


if __name__ == "__main__":
    main()
