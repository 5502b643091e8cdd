"""`dit-accel demo-data DIR`: a small class-conditional image folder a newcomer can train on with a CPU.

Each class is one coloured shape (red_circle, green_square, blue_triangle, yellow_diamond, ...): shape and
colour both carry the class, so a tiny DiT learns to tell them apart within minutes. Position, size,
rotation, hue and background vary per image. The output is the ImageNet layout (DIR/<class>/<image>.png),
a pure function of the arguments, and appears all at once (written to a temporary folder, then renamed).
Labels follow the sorted folder names, as for any image folder.

`--vae VAE_DIR` also writes a tiny AutoencoderKL (random weights, 8x downsampling, 4 latent channels,
its scaling factor measured on these images), so the latent-space flow (extract-latents, training on the
cache, export to a DiTPipeline) runs offline on a laptop. It decodes nothing recognisable: it stands in for
the Stable Diffusion VAE to exercise the plumbing, not to make pictures.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from dit_accel.atomic import staged_folder, write_json_atomically
from dit_accel.cli_args import OneLineParser, positive_int, seed_int
from dit_accel.errors import UserError, exits_cleanly
from planner.spec import TOKENIZERS

SHAPES = ("circle", "square", "triangle", "diamond", "cross", "ring")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "magenta": (200, 40, 200),
    "cyan": (30, 200, 210),
}
MAX_CLASSES = len(SHAPES) * len(COLOURS)
SUPERSAMPLE = 4  # draw at 4x and shrink with a box filter: anti-aliased edges without extra deps


def class_name(index: int) -> str:
    """The `index`-th demo class as its folder name, e.g. 'red_circle': the name a user types
    (`get_label_ids(["red_circle"])`). Shape and colour follow a Latin square, so the first six classes
    differ in both."""
    shape = SHAPES[index % len(SHAPES)]
    colour = list(COLOURS)[(index % len(SHAPES) + index // len(SHAPES)) % len(COLOURS)]
    return f"{colour}_{shape}"


def _polygon(
    shape: str, center: tuple[float, float], radius: float, angle: float
) -> list[tuple[float, float]]:
    corners = {"square": 4, "triangle": 3, "diamond": 4}[shape]
    start = angle + (math.pi / 4 if shape == "square" else 0.0)
    stretch = (0.65, 1.0) if shape == "diamond" else (1.0, 1.0)
    points = []
    for k in range(corners):
        theta = start + 2 * math.pi * k / corners
        points.append(
            (
                center[0] + stretch[0] * radius * math.cos(theta),
                center[1] + stretch[1] * radius * math.sin(theta),
            )
        )
    return points


def draw_example(class_index: int, resolution: int, rng: np.random.Generator) -> Image.Image:
    """One image of class `class_index`: the class's shape in the class's colour, jittered."""
    colour_name, shape = class_name(class_index).split("_")
    size = resolution * SUPERSAMPLE
    background = rng.integers(70, 190) + rng.integers(-25, 26, size=3)
    image = Image.new("RGB", (size, size), tuple(int(v) for v in np.clip(background, 0, 255)))
    draw = ImageDraw.Draw(image)

    radius = size * rng.uniform(0.18, 0.32)
    margin = radius * 1.05
    center = (rng.uniform(margin, size - margin), rng.uniform(margin, size - margin))
    angle = rng.uniform(0, 2 * math.pi)
    fill = tuple(
        int(v) for v in np.clip(np.array(COLOURS[colour_name]) + rng.integers(-25, 26, size=3), 0, 255)
    )
    x, y = center
    if shape == "circle":
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)
    elif shape == "ring":
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), outline=fill, width=int(radius * 0.4))
    elif shape == "cross":
        arm = radius * 0.35
        for dx, dy in ((radius, arm), (arm, radius)):
            draw.rectangle((x - dx, y - dy, x + dx, y + dy), fill=fill)
    else:
        draw.polygon(_polygon(shape, center, radius, angle), fill=fill)
    return image.resize((resolution, resolution), resample=Image.BOX)


def write_demo_data(
    out: str | os.PathLike,
    *,
    classes: int = 4,
    per_class: int = 64,
    resolution: int = 64,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write the demo folder and return its path. Refuses a non-empty `out` unless `force`."""
    if not 1 <= classes <= MAX_CLASSES:
        raise UserError(f"--classes must be between 1 and {MAX_CLASSES}, not {classes}")
    if per_class < 1:
        raise UserError(f"--per-class must be at least 1, not {per_class}")
    if resolution < 8:
        raise UserError(f"--resolution must be at least 8 pixels, not {resolution}")
    target = Path(out).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise UserError(f"{target} exists and is a file", "pick another folder for the demo data")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise UserError(
            f"{target} already exists and is not empty", "pick a new folder or pass --force to replace it"
        )
    with staged_folder(target, overwrite=True) as staging:  # refused above unless empty or --force
        for class_index in range(classes):
            folder = staging / class_name(class_index)
            folder.mkdir()
            for image_index in range(per_class):
                rng = np.random.default_rng((seed, class_index, image_index))
                draw_example(class_index, resolution, rng).save(folder / f"{image_index:05d}.png")
    return target


def demo_vae(resolution: int = 64, seed: int = 0):
    """A tiny randomly initialised AutoencoderKL with the Stable Diffusion VAE's geometry (8x downsampling,
    4 latent channels) and 25K parameters: the smallest VAE the latent-space code paths accept."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=resolution,
    )


def demo_vavae(resolution: int = 64, seed: int = 0):
    """A tiny randomly initialised AutoencoderKL of VA-VAE's family (models.vavae: 16x downsampling, 32 latent
    channels, attention at the last encoder level and the first decoder level), 8 base channels."""
    import torch

    from dit_accel.models.vavae import build_vavae

    torch.manual_seed(seed)
    return build_vavae(base_channels=8, blocks=1, groups=8, resolution=resolution)


def write_demo_vae(
    out: str | os.PathLike,
    images: str | os.PathLike,
    *,
    seed: int = 0,
    force: bool = False,
    family: str = "sd-vae",
) -> Path:
    """Save a tiny random VAE to `out`. `family` "sd-vae" (`demo_vae`): its scaling factor chosen as Stable
    Diffusion's was, the inverse standard deviation of the training images' latents (every PNG under
    `images`). "va-vae" (`demo_vavae`): per-channel latent statistics of those images stored beside it
    (`dit_accel_vae.json`), for online latents; a latent cache computes its own."""
    import torch

    paths = sorted(Path(images).rglob("*.png"))
    pixels = torch.stack(
        [torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)) for path in paths]
    ).permute(0, 3, 1, 2)
    vae = (demo_vavae if family == "va-vae" else demo_vae)(pixels.shape[-1], seed).eval()
    with torch.inference_mode():
        latents = vae.encode(pixels / 127.5 - 1).latent_dist.mean
    record = None
    if family == "va-vae":
        from dit_accel.models.vavae import TOKENIZER_FORMAT

        statistics = {"mean": latents.mean((0, 2, 3)).tolist(), "std": latents.std((0, 2, 3)).tolist()}
        record = {
            "format": TOKENIZER_FORMAT,
            "tokenizer": "va-vae",
            "latent_norm": "channel",
            "statistics": statistics,
        }
    else:
        vae.register_to_config(scaling_factor=float(1 / latents.std()))
    target = Path(out).expanduser().absolute()
    with staged_folder(target, overwrite=force) as staging:
        vae.save_pretrained(staging)
        if record is not None:
            from dit_accel.models.vavae import TOKENIZER_FILE

            write_json_atomically(staging / TOKENIZER_FILE, record)
    return target


def _check_vae_target(out: str | os.PathLike, resolution: int, force: bool, family: str = "sd-vae") -> None:
    """Refused before any image is drawn, so a bad --vae leaves nothing half-made."""
    downsample = TOKENIZERS[family].downsample
    if resolution % downsample:
        raise UserError(
            f"--vae ({family}) needs a --resolution divisible by {downsample}, not {resolution}",
            f"pass e.g. --resolution 64 ({64 // downsample}x{64 // downsample} latents)",
        )
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not force)):
        raise UserError(
            f"--vae {target} exists and is not an empty folder", "pick a new folder or pass --force"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dit-accel demo-data", description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="DIR", help="folder to create (DIR/<class>/<image>.png)")
    parser.add_argument(
        "--classes", type=positive_int, default=4, help=f"number of classes, 1..{MAX_CLASSES} (default 4)"
    )
    parser.add_argument(
        "--per-class",
        "--per_class",
        dest="per_class",
        type=positive_int,
        default=64,
        help="images per class (default 64)",
    )
    parser.add_argument(
        "--resolution", type=positive_int, default=64, help="image side in pixels (default 64)"
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="same seed, same images (default 0)")
    parser.add_argument(
        "--vae",
        metavar="VAE_DIR",
        help="also write a tiny random AutoencoderKL here (--vae-family's geometry: 8x and 4 latent channels, or "
        "16x and 32) for the offline latent-space flow: extract-latents, training on the cache, export "
        "(default: none)",
    )
    parser.add_argument(
        "--vae-family",
        choices=tuple(TOKENIZERS),
        default="sd-vae",
        help="--vae's family: sd-vae (the Stable Diffusion VAE's geometry, for DiT) or va-vae (VA-VAE's: 16x "
        "downsampling, 32 channels normalised per channel, for LightningDiT) (default sd-vae)",
    )
    parser.add_argument(
        "--repa-encoder",
        metavar="FILE.pth",
        help="also write a tiny random encoder in DINOv2's layout here, for REPA on a CPU (`dit-accel train "
        "--repa-encoder FILE.pth` under a `dit-plan --repa dinov2-s` plan; docs/recipes.md) (default: none)",
    )
    parser.add_argument(
        "--reference",
        metavar="REF.npz",
        help="also write the images as an evaluation reference batch in the ADM layout (arr_0: uint8 N x H x "
        "W x 3), for `sample --evaluate REF.npz --plumbing-check` (default: none)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace DIR (and VAE_DIR) if not empty (default: refuse)"
    )
    return parser


def write_reference_batch(folder: Path, path: Path) -> Path:
    """Every image of the demo folder, in listing order, as an ADM-layout .npz, written whole or not at all."""
    from dit_accel.atomic import write_atomically
    from dit_accel.data.folder import validate_image_folder

    listing = validate_image_folder(folder).listing
    images = np.stack(
        [np.asarray(listing.load(i).convert("RGB"), dtype=np.uint8) for i in range(len(listing))]
    )
    write_atomically(path, lambda file: np.savez(file, images, np.asarray(listing.labels, dtype=np.int64)))
    return path


@exits_cleanly("dit-accel demo-data")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vae:
        _check_vae_target(args.vae, args.resolution, args.force, args.vae_family)
    for given in (args.reference, args.repa_encoder):
        if given and Path(given).exists() and not args.force:
            raise UserError(f"{given} already exists", "delete it, or pass --force to replace it")
    target = write_demo_data(
        args.out,
        classes=args.classes,
        per_class=args.per_class,
        resolution=args.resolution,
        seed=args.seed,
        force=args.force,
    )
    print(
        f"wrote {args.classes * args.per_class} images ({args.classes} classes x {args.per_class}, "
        f"{args.resolution}x{args.resolution} px) to {target}"
    )
    if args.vae:
        vae = write_demo_vae(args.vae, target, seed=args.seed, force=args.force, family=args.vae_family)
        tokenizer = TOKENIZERS[args.vae_family]
        side = args.resolution // tokenizer.downsample
        print(
            f"wrote a tiny random AutoencoderKL of the {args.vae_family} family ({side}x{side}x{tokenizer.channels} "
            f"latents) to {vae}"
        )
    if args.repa_encoder:
        from dit_accel.repa.encoder import DEMO_ENCODER, write_demo_encoder

        write_demo_encoder(args.repa_encoder, seed=args.seed)
        print(
            f"wrote a tiny random DINOv2-layout encoder (width {DEMO_ENCODER['dim']}, depth "
            f"{DEMO_ENCODER['depth']}) to {args.repa_encoder}"
        )
    if args.reference:
        reference = write_reference_batch(target, Path(args.reference))
        print(f"wrote the images as a reference batch to {reference} (for --plumbing-check: not an FID)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
