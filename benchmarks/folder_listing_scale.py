"""What listing and validating an ImageNet-sized image folder costs a rank: time and host memory.

Builds (once) an ImageNet-layout folder of 1,000 classes x 1,281 files, 1,281,000 in all, as hard links to
one real small JPEG per class (ImageNet's own file names, `nCLASS/nCLASS_K.JPEG`), so that it takes 1,000
files of disk and 1.28M directory entries. Then, each in a fresh process (its peak resident memory is its
own):

- `per rank`: what every rank did before: `validate_image_folder(sample=True)` (list every file, decode
  the first image of each class) and `ImageFolderData` (the listing as an in-memory Arrow table);
- `index, written`: what the main process does now, once per job: the same listing and check, written to
  the run folder as a memory-mapped index (`dit_accel.data.folder.write_folder_index`);
- `index, read`: what every other rank does now: `ImageFolderData` from that index.

    python benchmarks/folder_listing_scale.py [--root /tmp/imagenet-links] [--classes 1000] [--per-class 1281]

The folder stays in --root for the next run (delete it when done); nothing is written into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate


def build_folder(root: Path, classes: int, per_class: int) -> float:
    """The hard-linked folder; returns the seconds it took (0 when it was already there)."""
    import numpy as np
    from PIL import Image

    marker = root / ".complete"
    if marker.exists() and marker.read_text() == f"{classes}x{per_class}":
        return 0.0
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    for c in range(classes):
        name = f"n{c:08d}"
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        first = folder / f"{name}_0.JPEG"
        if not first.exists():
            pixels = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(first, quality=85)
        for k in range(1, per_class):
            link = folder / f"{name}_{k}.JPEG"
            if not link.exists():
                os.link(first, link)
    marker.write_text(f"{classes}x{per_class}")
    return time.perf_counter() - started


MEASURE = r"""
import json, resource, sys, time
from pathlib import Path
mode, root, index = sys.argv[1], sys.argv[2], Path(sys.argv[3])

def rss_mb():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

import datasets, PIL.Image  # the imports every rank pays anyway, not counted
from dit_accel.data.folder import ImageFolderData, read_folder_index, validate_image_folder, write_folder_index
base_mb = rss_mb()
times = {}
started = time.perf_counter()
if mode == "index-read":
    summary, records = read_folder_index(index)
    times["list_s"] = time.perf_counter() - started
    started = time.perf_counter()
    data = ImageFolderData(root, 256, summary=summary, records=records)
else:
    summary = validate_image_folder(root, sample=True)
    times["list_s"] = time.perf_counter() - started
    started = time.perf_counter()
    if mode == "per-rank":
        data = ImageFolderData(root, 256, summary=summary)
    else:
        write_folder_index(summary, index)
times["dataset_s"] = time.perf_counter() - started
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(dict(times, images=summary.num_images, rss_mb=rss_mb(), peak_mb=peak_mb, base_mb=base_mb)))
"""


def measure(mode: str, root: Path, index: Path, ranks: int = 1, cold: bool = False) -> dict:
    """`ranks` processes at once, as the ranks of a node start together; the slowest one's figures.
    `cold`: the kernel's page and dentry caches dropped first (root only), as on a node's first start."""
    if cold:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1")
    command = [sys.executable, "-c", MEASURE, mode, str(root), str(index)]
    started = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(ranks)
    ]
    results = []
    for process in started:
        out, err = process.communicate()
        assert process.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return max(results, key=lambda result: result["list_s"] + result["dataset_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/imagenet-links"))
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=1281)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each measurement; the faster is kept")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of a node starting together (default 2)")
    parser.add_argument("--cold", action="store_true", help="drop the kernel's caches before each (root)")
    args = parser.parse_args()

    built_s = build_folder(args.root / "train", args.classes, args.per_class)
    index = args.root / "run" / "data_index"
    rows = []
    for mode, ranks, what in (
        ("per-rank", 1, "one rank, before: list + check + in-memory table"),
        ("per-rank", args.ranks, f"each of {args.ranks} ranks at once, before"),
        ("index-write", 1, "main process, once per job: list + check + write the index"),
        ("index-read", args.ranks, f"each of {args.ranks} ranks at once, after: read the index (mapped)"),
    ):
        runs = [measure(mode, args.root / "train", index, ranks, args.cold) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["list_s"] + r["dataset_s"])
        rows.append(
            [
                what,
                f"{best['images']:,}",
                f"{best['list_s']:.1f}",
                f"{best['dataset_s']:.1f}",
                f"{best['peak_mb'] - best['base_mb']:.0f}",
                f"{best['peak_mb']:.0f}",
            ]
        )
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    caches = "cold caches (dropped before each)" if args.cold else "warm caches"
    caches += f"; load average {os.getloadavg()[0]:.1f} at the end"
    print(
        f"machine: {cpu}, {os.cpu_count()} CPUs, {memory_gb:.0f} GB; Python {platform.python_version()}; {caches}"
    )
    if built_s:
        print(f"folder built in {built_s:.0f} s ({args.classes} x {args.per_class} hard links)")
    print(
        tabulate(
            rows,
            headers=[
                "who",
                "images",
                "list + check s",
                "dataset s",
                "peak RSS above imports MB",
                "peak RSS MB",
            ],
            tablefmt="github",
        )
    )


if __name__ == "__main__":
    main()
