"""The flags of `dit-accel sample`, apart from `dit_accel.sample` (which imports torch at its top), so that
`--help` and a bad flag are answered before torch is imported."""

from __future__ import annotations

import argparse
import math

from dit_accel.cli_args import OneLineParser, finite_float, positive_float, positive_int, seed_int
from dit_accel.diffusion.names import DIFFUSION_FORMS, ODE_SOLVERS
from dit_accel.errors import UserError
from dit_accel.evaluate import PAPER_SAMPLES
from dit_accel.sample.protocols import PROTOCOLS

DDPM_SAMPLERS = ("ddpm", "ddim")  # for models trained with --objective ddpm (DiT's)
FLOW_SAMPLERS = ("ode", "sde")  # for models trained with --objective flow (SiT's, REPA's)
SAMPLERS = DDPM_SAMPLERS + FLOW_SAMPLERS
GUIDANCE_MODES = ("all", "first3")
LABEL_MODES = ("balanced", "random")


def cfg_interval(text: str) -> tuple[float, float]:
    """--cfg-interval LOW,HIGH: guidance where LOW <= t <= HIGH (t = 0 data, t = 1 noise, REPA's time)."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH such as 0,0.7, got {text!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high <= 1.0):
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH with 0 <= LOW <= HIGH <= 1, got {text!r}")
    return low, high


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dit-accel sample",
        description="Class-conditional samples: a PNG grid plus single images (--out), or the FID evaluation "
        "batch written (--npz FILE) and/or scored as it is made (--evaluate REF.npz), 50,000 images unless "
        "--num-samples says otherwise; run it under `accelerate launch` to use every GPU.",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="run folder (its newest complete checkpoint), checkpoint folder, or diffusers DiT folder",
    )
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sample from the EMA weights (default) or, with --no-ema, the raw weights",
    )
    parser.add_argument(
        "--classes",
        default=None,
        help="comma-separated class indices, e.g. 207,360,387 (default: the paper's 8 showcase classes "
        "for ImageNet-1k, else the first 8; with --npz or --evaluate: every class)",
    )
    parser.add_argument(
        "--per-class", type=positive_int, default=1, help="samples per class in the grid (one row per class)"
    )
    parser.add_argument(
        "--cfg-scale",
        type=finite_float,
        default=None,
        help="classifier-free guidance scale; 1 turns it off (default 4.0 for a grid, 1.5 for --npz/--evaluate)",
    )
    parser.add_argument(
        "--protocol",
        choices=sorted(PROTOCOLS),
        default=None,
        help="sample as a paper measured its FID-50K: sets the sampler, steps, guidance scale, channels and "
        "interval, time shift, TF32 and how labels are drawn (docs/evaluation.md); a flag given beside it is "
        "refused unless --override",
    )
    parser.add_argument(
        "--override",
        action="store_true",
        help="with --protocol: the flags given beside it replace the protocol's values (recorded as overrides)",
    )
    parser.add_argument(
        "--guidance",
        choices=GUIDANCE_MODES,
        default=None,
        help="guide all latent channels (diffusers, default all) or the first 3 only (the DiT, SiT and "
        "LightningDiT repositories)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="sampling steps (default 250): respaced from 1000 for ddpm/ddim; steps of t for ode/sde (model "
        "calls: 2 a step for heun, 1 for euler and sde)",
    )
    parser.add_argument(
        "--time-shift",
        type=positive_float,
        default=None,
        help="--sampler ode: LightningDiT's timestep shift s of the grid, t' = t / (s + (1 - s) t) in this "
        "package's time (their 0.3; default 1: an even grid)",
    )
    parser.add_argument(
        "--labels",
        choices=LABEL_MODES,
        default=None,
        help="the evaluation batch's labels: balanced (every class equally often, default) or random (drawn "
        "per sample from the seed, as the papers' repositories draw them)",
    )
    parser.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TF32 matmuls on CUDA while sampling (default off: full fp32; the papers' repositories sample with "
        "it on)",
    )
    parser.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default=None,
        help="for a ddpm model: ddpm, ancestral with the learned variance (its default), or ddim, "
        "deterministic (eta 0); for a flow model: ode, the probability-flow ODE (its default), or sde, "
        "Euler-Maruyama (the checkpoint records which objective it was trained with)",
    )
    parser.add_argument(
        "--ode-solver",
        choices=ODE_SOLVERS,
        default=None,
        help="--sampler ode: heun (2 model calls a step, default) or euler (1)",
    )
    parser.add_argument(
        "--diffusion-form",
        choices=DIFFUSION_FORMS,
        default=None,
        help="--sampler sde: SiT's diffusion coefficient w(t) (default sigma, SiT's and REPA's sampling choice)",
    )
    parser.add_argument(
        "--diffusion-norm",
        type=positive_float,
        default=None,
        help="--sampler sde: w(t) is scaled by this (default 1)",
    )
    parser.add_argument(
        "--cfg-interval",
        type=cfg_interval,
        default=None,
        metavar="LOW,HIGH",
        help="flow models: guide only where LOW <= t <= HIGH, t = 1 noise and t = 0 data (REPA's guidance "
        "interval; its best FID used 0,0.7); default 0,1: every step",
    )
    parser.add_argument(
        "--spacing",
        choices=("even", "leading"),
        default=None,
        help="which training steps the chain keeps (default: even for ddpm, leading for ddim)",
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="sample i is seeded from (seed, i)")
    parser.add_argument(
        "--vae",
        default=None,
        help="AutoencoderKL folder or a released VA-VAE .pt (default: the one the run was trained with)",
    )
    parser.add_argument(
        "--latent-stats",
        default=None,
        help="a VA-VAE's per-channel latent mean and std (LightningDiT's latents_stats.pt), for a run that "
        "recorded none (default: the run's record)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="images per forward pass on each process"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="grid PNG to write; singles go to <name>_images/ next to it (default: none; one of --out or "
        "--npz/--evaluate is needed)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out grid (default: an existing one is refused, as --npz refuses one)",
    )
    parser.add_argument(
        "--row-labels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="name each grid row with its class when the run recorded class names (default); rows are one "
        "per class then, even with --per-class 1",
    )
    parser.add_argument(
        "--npz",
        default=None,
        help="evaluation batch to write (arr_0: uint8 NHWC, arr_1: labels) (default: none: not kept; an "
        "existing file is refused)",
    )
    parser.add_argument(
        "--num-samples",
        type=positive_int,
        default=None,
        help=f"images in the evaluation batch (--npz, --evaluate): {PAPER_SAMPLES:,} unless given, the papers' FID-50K",
    )
    parser.add_argument(
        "--evaluate",
        default=None,
        metavar="REF.npz",
        help="score the batch as it is sampled against this ADM reference batch (e.g. "
        "VIRTUAL_imagenet256_labeled.npz): FID, sFID, IS, precision, recall as `dit-accel evaluate` "
        "computes them, without writing images (add --npz to keep them too) (default: none: not scored)",
    )
    parser.add_argument(
        "--results",
        default="results.json",
        help="--evaluate: the results JSON to write (whole or not at all)",
    )
    parser.add_argument(
        "--inception-weights",
        default=None,
        help="--evaluate: TF-ported Inception-v3 weights (default: torch-fidelity's file in the torch hub cache)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="--evaluate: where reference statistics are cached (default: ~/.cache/dit-accel/reference-stats)",
    )
    parser.add_argument(
        "--input-px",
        type=positive_int,
        default=299,
        help="--evaluate: side the Inception resizes images to: the TF graph's 299; only tests lower it",
    )
    parser.add_argument(
        "--plumbing-check",
        action="store_true",
        help="--evaluate on a random Inception network (no weights needed): the whole path and its table, "
        "loudly labelled, with numbers that are NOT an FID (default: off)",
    )
    return parser


# flags that only one kind of sampler reads, with their defaults (the parser leaves them None, so that a flag
# given at its default value is seen as given): another sampler would silently ignore them
SAMPLER_FLAGS = {
    "ode_solver": ("heun", ("ode",)),
    "time_shift": (1.0, ("ode",)),
    "diffusion_form": ("sigma", ("sde",)),
    "diffusion_norm": (1.0, ("sde",)),
    "cfg_interval": ((0.0, 1.0), FLOW_SAMPLERS),
    "spacing": (None, DDPM_SAMPLERS),
}


PLAIN_DEFAULTS = {"steps": 250, "guidance": "all", "labels": "balanced", "tf32": False}


def apply_protocol(args) -> list[str]:
    """--protocol's values into `args` (a flag also given is refused, or with --override kept and named);
    then every default the protocol did not set. Returns the overridden flags."""
    overrides = []
    if args.protocol is None:
        if args.override:
            raise UserError("--override is for a flag given beside --protocol: drop it, or name a --protocol")
    else:
        protocol = PROTOCOLS[args.protocol]
        for name, value in protocol.flags().items():
            if name in SAMPLER_FLAGS and protocol.sampler not in SAMPLER_FLAGS[name][1]:
                continue  # its sampler does not read it (an SDE has no time shift): neither set nor refused
            given = getattr(args, name, None)
            if given is None:
                setattr(args, name, value)
            elif not args.override:
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"{flag} is set by --protocol {args.protocol} (to {value}), and given too",
                    f"drop {flag}, or add --override to replace the protocol's value (the results record it)",
                )
            elif given != value:
                overrides.append("--" + name.replace("_", "-"))
    for name, value in PLAIN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return overrides


def check_sampler_flags(args, sampler: str) -> None:
    """Refuse a flag the chosen sampler does not read (given at all, its default value too), then fill in
    the defaults of those not given."""
    for name, (default, readers) in SAMPLER_FLAGS.items():
        given = getattr(args, name, None) is not None
        if not given:
            setattr(args, name, default)
        elif sampler not in readers:
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} is read by --sampler {' or '.join(readers)} only, but this one samples with {sampler}",
                f"drop {flag}, or pass --sampler {readers[0]} (if this checkpoint's objective has it)",
            )
