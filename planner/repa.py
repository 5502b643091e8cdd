"""REPA's frozen encoders (Yu et al., ICLR 2025): what each one weighs and computes, and the projector.

REPA aligns the output tokens of one early DiT/SiT block, through a small trained projector, with the patch
tokens of a frozen self-supervised encoder that sees the clean image. The planner counts three things for it:
the encoder's weights and no-grad forward (on every GPU, every step), the projector (trained: parameters,
gradients and AdamW state like the network's), and, in a latent run, the source image each batch then carries
(counted by planner.host).

The supported encoders are DINOv2's published ViT/14 backbones (Oquab et al., 2023), with or without register
tokens: the architecture is read from the weights' shapes by `dit_accel.repa.encoder`, and this table holds
the same numbers for the planner, which never reads weights. Pure Python: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlanError

ENCODER_PATCH = 14  # every DINOv2 backbone
PRETRAIN_GRID = 37  # DINOv2's positional table: 518 px / 14, plus the class token
DEFAULT_DEPTH = 8  # REPA's block for SiT-XL/2 (their Table 2)
DEFAULT_COEFF = 0.5  # REPA's lambda
DEFAULT_PROJECTOR_DIM = 2048  # REPA's projector width


@dataclass(frozen=True)
class EncoderSpec:
    """One DINOv2 ViT/14 backbone: widths and depth as the published state dict has them."""

    name: str
    dim: int
    depth: int
    heads: int
    mlp_hidden: int  # fc1's width (MLP), or the SwiGLU's hidden width (w3's input) for ViT-g
    swiglu: bool = False
    registers: int = 0
    weights_file: str = ""  # the published file name (dl.fbaipublicfiles.com/dinov2/<arch>/<file>)

    @property
    def params(self) -> int:
        """Every tensor of the published state dict (the pretrain file has no head)."""
        d = self.dim
        if self.swiglu:
            mlp = d * 2 * self.mlp_hidden + 2 * self.mlp_hidden + self.mlp_hidden * d + d
        else:
            mlp = d * self.mlp_hidden + self.mlp_hidden + self.mlp_hidden * d + d
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + d + 2 * d + mlp + d
        patch_embed = 3 * ENCODER_PATCH * ENCODER_PATCH * d + d
        tokens = d + (1 + PRETRAIN_GRID**2) * d + d + self.registers * d  # cls, pos table, mask, registers
        return patch_embed + tokens + self.depth * block + 2 * d

    def resolution(self, grid: int) -> int:
        """The encoder's input side for a DiT whose tokens form a `grid` x `grid` square: one encoder patch per
        DiT token (224 px for the 16 x 16 tokens of 256 px XL/2, as REPA resizes: 224 * (resolution // 256))."""
        return ENCODER_PATCH * grid

    def tokens(self, grid: int) -> int:
        return 1 + self.registers + grid * grid

    def fwd_macs_per_image(self, grid: int) -> int:
        """Multiply-adds of one image's forward at the resolution `grid` gives."""
        d, s = self.dim, self.tokens(grid)
        mlp = d * 2 * self.mlp_hidden + self.mlp_hidden * d if self.swiglu else 2 * d * self.mlp_hidden
        block = s * (4 * d * d + mlp) + 2 * s * s * d
        return grid * grid * 3 * ENCODER_PATCH * ENCODER_PATCH * d + self.depth * block

    def largest_matrix_params(self) -> int:
        """The largest weight of one block (the MLP's input projection, or qkv): autocast caches no cast of a
        weight that requires no gradient, so the frozen encoder's casts live one op at a time, this the largest."""
        return max(3 * self.dim * self.dim, self.dim * (2 if self.swiglu else 1) * self.mlp_hidden)

    def activation_bytes(self, grid: int, batch: int, bytes_per_value: int) -> int:
        """The no-grad forward's working set: nothing is saved for backward, so about one block's live
        tensors at a time (residual, normed input, qkv, attention output, the MLP's hidden) plus the
        attention scores when the kernel materialises them (counted: the safe side)."""
        d, s = self.dim, self.tokens(grid)
        heads_scores = self.heads * s * s
        per_token = d + d + 3 * d + d + (2 if self.swiglu else 1) * self.mlp_hidden
        return batch * (s * per_token + heads_scores) * bytes_per_value


def _dinov2(
    name: str, dim: int, depth: int, heads: int, arch: str, swiglu: bool = False
) -> list[EncoderSpec]:
    mlp_hidden = (int(4 * dim * 2 / 3) + 7) // 8 * 8 if swiglu else 4 * dim
    return [
        EncoderSpec(name, dim, depth, heads, mlp_hidden, swiglu, 0, f"dinov2_{arch}_pretrain.pth"),
        EncoderSpec(
            f"{name}-reg", dim, depth, heads, mlp_hidden, swiglu, 4, f"dinov2_{arch}_reg4_pretrain.pth"
        ),
    ]


ENCODERS: dict[str, EncoderSpec] = {
    spec.name: spec
    for spec in (
        *_dinov2("dinov2-s", 384, 12, 6, "vits14"),
        *_dinov2("dinov2-b", 768, 12, 12, "vitb14"),
        *_dinov2("dinov2-l", 1024, 24, 16, "vitl14"),
        *_dinov2("dinov2-g", 1536, 40, 24, "vitg14", swiglu=True),
    )
}


def encoder_spec(name: str) -> EncoderSpec:
    if name not in ENCODERS:
        raise PlanError(
            f"unknown REPA encoder {name!r}",
            f"use one of {', '.join(ENCODERS)} (DINOv2 ViT-S/B/L/g 14, '-reg' with 4 register tokens)",
        )
    return ENCODERS[name]


def encoder_by_shape(dim: int, depth: int, registers: int) -> EncoderSpec | None:
    """The table's entry for weights of this width, depth and register count (None: not a published one)."""
    for spec in ENCODERS.values():
        if (spec.dim, spec.depth, spec.registers) == (dim, depth, registers):
            return spec
    return None


def projector_params(hidden: int, encoder_dim: int, width: int = DEFAULT_PROJECTOR_DIM) -> int:
    """REPA's projector: Linear(hidden, width), SiLU, Linear(width, width), SiLU, Linear(width, encoder_dim)."""
    return (hidden * width + width) + (width * width + width) + (width * encoder_dim + encoder_dim)


def projector_fwd_macs_per_image(tokens: int, hidden: int, encoder_dim: int, width: int) -> int:
    return tokens * (hidden * width + width * width + width * encoder_dim)
