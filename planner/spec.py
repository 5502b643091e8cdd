"""The networks dit-accel trains: architecture hyper-parameters, token counts, exact parameter counts and
forward FLOPs, for two families of the same backbone.

- DiT (Peebles & Xie 2023): diffusers' `DiTTransformer2DModel` with one conditioning embedder (timestep MLP +
  class table with the null class) shared by all blocks, LayerNorm and a GELU MLP, learned sigma, on the
  Stable Diffusion VAE's latents (f8, 4 channels).
- LightningDiT (Yao et al., "Reconstruction vs. Generation", CVPR 2025): the same block with RMSNorm, a SwiGLU
  MLP (hidden int(2/3 x 4 x width)), 2-D rotary embeddings on q and k beside the fixed sin-cos table,
  optional QK-norm and shift-free modulation, a velocity output without learned sigma, on VA-VAE latents
  (f16, 32 channels), usually at patch size 1.

This module is the single source of truth for the architecture: `dit_accel.models` builds the network from a
`DiTSpec`, and a test holds `params_trainable` equal to the built model's count. Positional tables (and the
rotary frequencies) are fixed buffers, not counted.
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
# LightningDiT's released sizes (models/lightningdit.py of hustvl/LightningDiT), at patch 1 or 2.
LIGHTNINGDIT_SIZES = {"B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
LIGHTNINGDIT_PATCHES = (1, 2)
FAMILIES = ("dit", "lightningdit")
LATENT_MODES = ("precomputed", "online", "pixel")


@dataclass(frozen=True)
class Tokenizer:
    """An autoencoder a network's latents come from: its spatial downsampling and latent channels."""

    name: str
    downsample: int
    channels: int


TOKENIZERS = {
    "sd-vae": Tokenizer("sd-vae", 8, 4),  # Stable Diffusion's VAE: 256x256x3 pixels -> 32x32x4 latents
    "va-vae": Tokenizer("va-vae", 16, 32),  # VA-VAE f16d32: 256x256x3 -> 16x16x32 (LightningDiT's)
}
FAMILY_TOKENIZER = {"dit": "sd-vae", "lightningdit": "va-vae"}
VAE_DOWNSAMPLE = TOKENIZERS["sd-vae"].downsample
LATENT_CHANNELS = TOKENIZERS["sd-vae"].channels
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
    # None: the family's own (DiT: learned sigma; LightningDiT: the released block, RMSNorm + SwiGLU + RoPE)
    learn_sigma: bool | None = None
    family: str = "dit"  # "dit" | "lightningdit"
    tokenizer: str = ""  # "" = the family's (TOKENIZERS)
    rope: bool | None = None  # LightningDiT: 2-D rotary embedding on q and k
    rmsnorm: bool | None = None  # LightningDiT: RMSNorm (with a weight) in place of non-affine LayerNorm
    swiglu: bool | None = None  # LightningDiT: SwiGLU MLP of hidden int(2/3 x 4 x width)
    qk_norm: bool = False  # LightningDiT: RMSNorm of q and k per head (their fix for late NaNs)
    modulation_shift: bool = True  # False: LightningDiT's shift-free adaLN (scale and gate only)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise PlanError(f"model family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        lightning = self.family == "lightningdit"
        defaults = {
            "learn_sigma": not lightning,
            "rope": lightning,
            "rmsnorm": lightning,
            "swiglu": lightning,
        }
        for field, default in defaults.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        if not self.tokenizer:
            object.__setattr__(self, "tokenizer", FAMILY_TOKENIZER[self.family])
        for field in ("depth", "hidden", "heads", "patch", "resolution", "num_classes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"{field} must be a positive integer, got {value!r}")
        if self.latents not in LATENT_MODES:
            raise PlanError(f"--latents must be one of {', '.join(LATENT_MODES)}, got {self.latents!r}")
        if self.tokenizer not in TOKENIZERS:
            raise PlanError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}")
        if not lightning and (
            self.rope or self.rmsnorm or self.swiglu or self.qk_norm or not self.modulation_shift
        ):
            raise PlanError(
                f"{self.name} is a DiT: RoPE, RMSNorm, SwiGLU, QK-norm and shift-free modulation are LightningDiT's",
                "drop --qk-norm, or plan a LightningDiT (--model LightningDiT-XL/1)",
            )
        if lightning and self.learn_sigma:
            raise PlanError(f"{self.name} predicts the velocity alone: LightningDiT has no learned sigma")
        if self.rope and self.head_dim % 4:
            raise PlanError(
                f"2-D rotary embedding needs a head width divisible by 4 (two axes of pairs), got {self.head_dim}"
            )
        if self.hidden % self.heads:
            raise PlanError(
                f"hidden width {self.hidden} does not divide into {self.heads} heads: "
                "pick a width that is a multiple of the heads"
            )
        step = self.patch if self.latents == "pixel" else self.downsample * self.patch
        if self.resolution % step:
            below, above = (self.resolution // step) * step, (self.resolution // step + 1) * step
            nearest = f"{below} or {above}" if below else f"{above}"
            where = "patch" if self.latents == "pixel" else f"{self.downsample} x patch"
            raise PlanError(
                f"--resolution {self.resolution} is not a multiple of {step} ({where} for {self.name}): use {nearest}"
            )

    # --- shapes -------------------------------------------------------------------------------------
    @property
    def downsample(self) -> int:
        """Pixels per latent position along a side: the tokenizer's (1 in pixel space)."""
        return 1 if self.latents == "pixel" else TOKENIZERS[self.tokenizer].downsample

    @property
    def in_channels(self) -> int:
        return PIXEL_CHANNELS if self.latents == "pixel" else TOKENIZERS[self.tokenizer].channels

    @property
    def out_channels(self) -> int:
        """Learned sigma doubles the output: epsilon and the variance interpolation."""
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def latent_size(self) -> int:
        """Side of what the network sees: latents (resolution / the tokenizer's downsampling) or pixels."""
        return self.resolution // self.downsample

    @property
    def tokens(self) -> int:
        return (self.latent_size // self.patch) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: 4 x width (GELU), or SwiGLU's int(2/3 x 4 x width) per gate half."""
        return int(2 / 3 * MLP_RATIO * self.hidden) if self.swiglu else MLP_RATIO * self.hidden

    @property
    def modulations(self) -> int:
        """adaLN outputs per block, each `hidden` wide: shift, scale and gate twice, or scale and gate."""
        return 6 if self.modulation_shift else 4

    # --- parameters ---------------------------------------------------------------------------------
    def param_breakdown(self) -> dict[str, int]:
        """Trainable parameters by part (DiT: the tied-embedder network)."""
        d, p, h = self.hidden, self.patch, self.mlp_hidden
        attention = 4 * (d * d + d)  # q, k, v, out projections with bias
        ada_ln = d * self.modulations * d + self.modulations * d  # the block's modulation
        if self.swiglu:  # one (d -> 2h) projection for the gate and its input, one (h -> d)
            mlp = d * 2 * h + 2 * h + h * d + d
        else:
            mlp = d * h + h + h * d + d
        norms = 2 * d if self.rmsnorm else 0  # RMSNorm's weight; DiT's LayerNorms are not affine
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        final_norm = d if self.rmsnorm else 0
        return {
            "patch_embed": self.in_channels * p * p * d + d,
            "embedder": self.embedder_params,
            "blocks": self.depth * (attention + ada_ln + mlp + norms + qk_norm),
            "final_layer": final_norm
            + (d * 2 * d + 2 * d)
            + (d * p * p * self.out_channels + p * p * self.out_channels),
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
        """Multiply-adds of one transformer block's forward for one image (SwiGLU's 3 x width x hidden equals
        GELU's 2 x width x 4 width at hidden 8/3 width)."""
        s, d = self.tokens, self.hidden
        mlp = (3 if self.swiglu else 2) * d * self.mlp_hidden
        linear = s * (4 * d * d + mlp)  # qkv + out, and the MLP
        attention = 2 * s * s * d  # q k^T and attention x v
        ada_ln = self.modulations * d * d
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


_NAME = re.compile(r"^(?:(lightning[-_]?dit|dit)[-_]?)?(s|b|l|xl)[/-]?(\d+)$", re.IGNORECASE)
PREFIX = {"dit": "DiT", "lightningdit": "LightningDiT"}
SIZES = {"dit": FAMILY, "lightningdit": LIGHTNINGDIT_SIZES}
PATCHES = {"dit": PATCH_SIZES, "lightningdit": LIGHTNINGDIT_PATCHES}
KNOWN_MODELS = [
    f"{PREFIX[family]}-{size}/{patch}"
    for family in FAMILIES
    for size in SIZES[family]
    for patch in PATCHES[family]
]
OPTIONS = ("rope", "rmsnorm", "swiglu", "qk_norm", "modulation_shift")  # LightningDiT's block switches


def parse_model_name(name: str) -> tuple[str, str, int]:
    """'DiT-XL/2', 'XL/2', 'dit-xl-2' -> ('dit', 'XL', 2); 'LightningDiT-XL/1' -> ('lightningdit', 'XL', 1).
    Unknown names suggest the closest known one."""
    match = _NAME.match(name.strip())
    family = (match.group(1) or "dit").lower().replace("-", "").replace("_", "") if match else "dit"
    if not match or match.group(2).upper() not in SIZES[family] or int(match.group(3)) not in PATCHES[family]:
        close = difflib.get_close_matches(name, KNOWN_MODELS, n=1, cutoff=0.3)
        hint = f"did you mean {close[0]}? " if close else ""
        raise PlanError(f"unknown --model {name!r}: {hint}known models are {', '.join(KNOWN_MODELS)}")
    return family, match.group(2).upper(), int(match.group(3))


def model_spec(
    name: str = "DiT-XL/2", resolution: int = 256, latents: str = "precomputed", **overrides
) -> DiTSpec:
    """A family member by name; `overrides` (depth, hidden, heads, patch, num_classes, and LightningDiT's
    block switches) make research variants."""
    family, size, patch = parse_model_name(name)
    depth, hidden, heads = SIZES[family][size]
    fields = {"depth": depth, "hidden": hidden, "heads": heads, "patch": patch}
    unknown = set(overrides) - set(fields) - {"num_classes", "learn_sigma", *OPTIONS}
    if unknown:
        raise PlanError(
            f"unknown model override(s) {sorted(unknown)}: use depth, hidden, heads, patch, num_classes"
        )
    fields.update({k: v for k, v in overrides.items() if v is not None})
    standard = {"depth": depth, "hidden": hidden, "heads": heads, "patch": fields["patch"]}
    custom = any(fields[k] != standard[k] for k in standard)
    label = f"{PREFIX[family]}-{size}/{fields['patch']}" + ("-custom" if custom else "")
    return DiTSpec(name=label, resolution=resolution, latents=latents, family=family, **fields)


def custom_spec(
    depth: int,
    hidden: int,
    heads: int,
    patch: int,
    resolution: int,
    latents: str = "precomputed",
    num_classes: int = NUM_CLASSES,
    name: str = "DiT-custom",
    family: str = "dit",
    **options,
) -> DiTSpec:
    """A research variant or a tiny test network (e.g. depth 2, hidden 32, 8x8 latents); `options`:
    LightningDiT's block switches and its tokenizer."""
    return DiTSpec(
        name=name,
        depth=depth,
        hidden=hidden,
        heads=heads,
        patch=patch,
        resolution=resolution,
        latents=latents,
        num_classes=num_classes,
        family=family,
        **options,
    )
