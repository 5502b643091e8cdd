"""The DiT family: architecture hyper-parameters, token counts, exact parameter counts and forward FLOPs.

This module is the single source of truth for the architecture: `dit_accel.models.dit` builds the network
from a `DiTSpec`, and a test holds `params_trainable` equal to the built model's count.

The counted network is diffusers' `DiTTransformer2DModel` with one conditioning embedder (timestep MLP +
class table with the null class) shared by all blocks. The positional table is a fixed buffer, not counted.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from planner.errors import PlanError

# Peebles & Xie 2023, Table 1: (depth, hidden width, attention heads).
FAMILY = {
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}
PATCH_SIZES = (2, 4, 8)
LATENT_MODES = ("precomputed", "online", "pixel")

VAE_DOWNSAMPLE = 8  # the Stable Diffusion VAE maps 256x256x3 pixels to 32x32x4 latents
LATENT_CHANNELS = 4
PIXEL_CHANNELS = 3
TIMESTEP_FREQ_DIM = 256  # sinusoidal timestep features fed to the timestep MLP
MLP_RATIO = 4  # diffusers' FeedForward default, as in DiT
NUM_CLASSES = 1000  # ImageNet-1k; the class table holds one more row, the null class for guidance


@dataclass(frozen=True)
class DiTSpec:
    """One DiT configuration at one resolution. Sizes are counts, not bytes."""

    name: str
    depth: int
    hidden: int
    heads: int
    patch: int
    resolution: int  # image side in pixels
    latents: str = "precomputed"  # "precomputed" | "online" | "pixel"
    num_classes: int = NUM_CLASSES
    learn_sigma: bool = True

    def __post_init__(self):
        for field in ("depth", "hidden", "heads", "patch", "resolution", "num_classes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"{field} must be a positive integer, got {value!r}")
        if self.latents not in LATENT_MODES:
            raise PlanError(f"--latents must be one of {', '.join(LATENT_MODES)}, got {self.latents!r}")
        if self.hidden % self.heads:
            raise PlanError(
                f"hidden width {self.hidden} does not divide into {self.heads} heads: "
                "pick a width that is a multiple of the heads"
            )
        step = self.patch if self.latents == "pixel" else VAE_DOWNSAMPLE * self.patch
        if self.resolution % step:
            below, above = (self.resolution // step) * step, (self.resolution // step + 1) * step
            nearest = f"{below} or {above}" if below else f"{above}"
            raise PlanError(
                f"--resolution {self.resolution} is not a multiple of {step} "
                f"({'patch' if self.latents == 'pixel' else '8 x patch'} for {self.name}): use {nearest}"
            )

    # --- shapes -------------------------------------------------------------------------------------
    @property
    def in_channels(self) -> int:
        return PIXEL_CHANNELS if self.latents == "pixel" else LATENT_CHANNELS

    @property
    def out_channels(self) -> int:
        """Learned sigma doubles the output: epsilon and the variance interpolation."""
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def latent_size(self) -> int:
        """Side of what the network sees: latents (resolution / 8) or pixels."""
        return self.resolution if self.latents == "pixel" else self.resolution // VAE_DOWNSAMPLE

    @property
    def tokens(self) -> int:
        return (self.latent_size // self.patch) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        return MLP_RATIO * self.hidden

    # --- parameters ---------------------------------------------------------------------------------
    def param_breakdown(self) -> dict[str, int]:
        """Trainable parameters by part, for the tied-embedder network."""
        d, p = self.hidden, self.patch
        attention = 4 * (d * d + d)  # q, k, v, out projections with bias
        ada_ln = d * 6 * d + 6 * d  # shift/scale/gate for attention and MLP
        mlp = d * self.mlp_hidden + self.mlp_hidden + self.mlp_hidden * d + d
        return {
            "patch_embed": self.in_channels * p * p * d + d,
            "embedder": self.embedder_params,
            "blocks": self.depth * (attention + ada_ln + mlp),
            "final_layer": (d * 2 * d + 2 * d) + (d * p * p * self.out_channels + p * p * self.out_channels),
        }

    @property
    def embedder_params(self) -> int:
        """Timestep MLP (256 -> d -> d) plus the class table with the null class."""
        d = self.hidden
        return (TIMESTEP_FREQ_DIM * d + d) + (d * d + d) + (self.num_classes + 1) * d

    @property
    def block_params(self) -> int:
        return self.param_breakdown()["blocks"] // self.depth

    @property
    def params_trainable(self) -> int:
        return sum(self.param_breakdown().values())

    @property
    def params_untied(self) -> int:
        """Stock diffusers layout: every block carries its own embedder copy."""
        return self.params_trainable + (self.depth - 1) * self.embedder_params

    # --- compute ------------------------------------------------------------------------------------
    def block_fwd_macs_per_image(self) -> int:
        """Multiply-adds of one transformer block's forward for one image."""
        s, d = self.tokens, self.hidden
        linear = s * (4 * d * d + 2 * d * self.mlp_hidden)  # qkv + out, and the MLP
        attention = 2 * s * s * d  # q k^T and attention x v
        ada_ln = 6 * d * d
        return linear + attention + ada_ln

    @property
    def fwd_macs_per_image(self) -> int:
        """Forward multiply-adds per image; the DiT paper's "Gflops" are these."""
        s, d, p = self.tokens, self.hidden, self.patch
        patch_embed = s * self.in_channels * p * p * d
        embedder = TIMESTEP_FREQ_DIM * d + d * d
        final = 2 * d * d + s * d * p * p * self.out_channels
        return patch_embed + embedder + self.depth * self.block_fwd_macs_per_image() + final

    @property
    def fwd_flops_per_image(self) -> int:
        """Forward FLOPs per image (2 per multiply-add)."""
        return 2 * self.fwd_macs_per_image


_NAME = re.compile(r"^(?:dit[-_]?)?(s|b|l|xl)[/-]?(\d+)$", re.IGNORECASE)


def parse_model_name(name: str) -> tuple[str, int]:
    """'DiT-XL/2', 'XL/2', 'dit-xl-2' -> ('XL', 2). Unknown names suggest the closest known one."""
    match = _NAME.match(name.strip())
    known = [f"DiT-{size}/{patch}" for size in FAMILY for patch in PATCH_SIZES]
    if not match or int(match.group(2)) not in PATCH_SIZES:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.3)
        hint = f"did you mean {close[0]}? " if close else ""
        raise PlanError(f"unknown --model {name!r}: {hint}known models are {', '.join(known)}")
    return match.group(1).upper(), int(match.group(2))


def model_spec(
    name: str = "DiT-XL/2", resolution: int = 256, latents: str = "precomputed", **overrides
) -> DiTSpec:
    """A family member by name; `overrides` (depth, hidden, heads, patch, num_classes) make research variants."""
    size, patch = parse_model_name(name)
    depth, hidden, heads = FAMILY[size]
    fields = {"depth": depth, "hidden": hidden, "heads": heads, "patch": patch}
    unknown = set(overrides) - set(fields) - {"num_classes", "learn_sigma"}
    if unknown:
        raise PlanError(
            f"unknown model override(s) {sorted(unknown)}: use depth, hidden, heads, patch, num_classes"
        )
    fields.update({k: v for k, v in overrides.items() if v is not None})
    standard = {"depth": depth, "hidden": hidden, "heads": heads, "patch": fields["patch"]}
    custom = any(fields[k] != standard[k] for k in standard)
    label = f"DiT-{size}/{fields['patch']}" + ("-custom" if custom else "")
    return DiTSpec(name=label, resolution=resolution, latents=latents, **fields)


def custom_spec(
    depth: int,
    hidden: int,
    heads: int,
    patch: int,
    resolution: int,
    latents: str = "precomputed",
    num_classes: int = NUM_CLASSES,
    name: str = "DiT-custom",
) -> DiTSpec:
    """A research variant or a tiny test network (e.g. depth 2, hidden 32, 8x8 latents)."""
    return DiTSpec(
        name=name,
        depth=depth,
        hidden=hidden,
        heads=heads,
        patch=patch,
        resolution=resolution,
        latents=latents,
        num_classes=num_classes,
    )
