"""The flags of `dit-accel extract-latents`, apart from `dit_accel.data.latents` (which imports torch and
safetensors at its top), so that `--help` and a bad flag are answered before either is imported."""

from __future__ import annotations

import argparse

from dit_accel.cli_args import OneLineParser, nonnegative_int, positive_int

STORAGE_DTYPE_NAMES = ("float16", "float32")  # how mean and std are stored in the shards


def add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    """--split, --image-column, --label-column: which part of a dataset --data-path holds the images."""
    parser.add_argument(
        "--split", default=None, help="a dataset's split (default: train, or the dataset's only split)"
    )
    for name, default in (("image", "image"), ("label", "label")):
        parser.add_argument(
            f"--{name}-column",
            f"--{name}_column",
            dest=f"{name}_column",
            default=default,
            help=f"a dataset's column of {name}s (default {default}; webdataset shards: e.g. "
            f"{'jpg' if name == 'image' else 'cls'})",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dit-accel extract-latents",
        description="Encode every image (and its mirror image) of an ImageNet-layout folder with a diffusers "
        "AutoencoderKL into a sharded, memory-mapped latent cache. Run it under `accelerate launch "
        "-m dit_accel.data.latents` to use every GPU; rerun the same command to resume.",
    )
    parser.add_argument(
        "--data-path",
        "--data_path",
        dest="data_path",
        required=True,
        help="image folder (DIR/<class>/<image>.jpg), or a Hugging Face dataset: a save_to_disk folder, "
        "parquet files (FILE, DIR or glob), webdataset .tar shards, or a dataset name in the local cache",
    )
    add_dataset_flags(parser)
    parser.add_argument(
        "--vae",
        required=True,
        help="AutoencoderKL folder, a released VA-VAE .pt, or a hub id already in the local Hugging Face cache "
        "(never downloaded)",
    )
    parser.add_argument(
        "--resolution", type=positive_int, default=256, help="image side in pixels (default 256)"
    )
    parser.add_argument("--out", required=True, help="cache folder to write (created)")
    parser.add_argument(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=positive_int,
        default=32,
        help="images per VAE call per process (default 32)",
    )
    parser.add_argument(
        "--shard-size",
        "--shard_size",
        dest="shard_size",
        type=positive_int,
        default=2048,
        help="images per shard file (default 2048: 64 MiB at 256 px in float16)",
    )
    parser.add_argument(
        "--dtype",
        choices=STORAGE_DTYPE_NAMES,
        default="float16",
        help="storage type of mean and std (default float16: half the disk and read bandwidth)",
    )
    parser.add_argument(
        "--num-workers",
        "--num_workers",
        dest="num_workers",
        type=nonnegative_int,
        default=None,
        help="image-decoding DataLoader workers per process (default: up to 4)",
    )
    parser.add_argument(
        "--skip-bad-images",
        "--skip_bad_images",
        dest="skip_bad_images",
        action="store_true",
        help="skip and count images that do not decode instead of stopping",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a complete cache made differently (resolution, VAE, data...); kept until the new "
        "one is complete",
    )
    parser.add_argument(
        "--hflip",
        dest="flip",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="store each image's mirror image too, for the trainer's random flips (default); --no-hflip: "
        "the images only (the trainer then cannot flip)",
    )
    parser.add_argument(
        "--no-flip", "--no_flip", dest="flip", action="store_false", help="the older spelling of --no-hflip"
    )
    return parser
