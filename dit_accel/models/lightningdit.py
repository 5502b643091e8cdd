"""LightningDiT (Yao et al., "Reconstruction vs. Generation", CVPR 2025): the DiT block with RMSNorm, a SwiGLU
MLP, 2-D rotary embedding on q and k beside the fixed sin-cos table, optional QK-norm and shift-free
modulation, predicting the velocity (no learned sigma) of VA-VAE f16d32 latents, usually at patch size 1.

Written for dit-accel from the paper and the released network's shapes (hustvl/LightningDiT), so its
published checkpoints load (`models.original_lightningdit`). Two departures in form, none in function:
the blocks live in `transformer_blocks` and the network is called `model(x, timestep=t, class_labels=y,
return_dict=False)[0]`, as diffusers' DiT is, so the trainer, samplers, activation checkpointing, per-block
compilation and FSDP2 treat both families alike; the rotary and sin-cos tables are buffers that are not
saved (they follow from the shapes). Class dropout is done by the trainer before the forward, as for DiT.

Time is dit-accel's (t = 0 data, t = 1 noise) and the output the velocity d x_t / d t, like every flow
model here (diffusion.flow); the released network runs the other way, which the importer folds into the
weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_2d_sincos_pos_embed
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from planner.spec import TIMESTEP_FREQ_DIM, DiTSpec

NORM_EPS = 1e-6  # every norm of the released network
ROPE_THETA = 10_000.0
MAX_PERIOD = 10_000  # of the sinusoidal timestep features


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, back in x's dtype, times a learned weight (initialised to one)."""

    def __init__(self, width: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(width: int, rms: bool) -> nn.Module:
    return RMSNorm(width) if rms else nn.LayerNorm(width, elementwise_affine=False, eps=NORM_EPS)


def rope_tables(head_dim: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (side * side, head_dim), of the 2-D rotary embedding of a side x side token grid (row-major
    tokens): the first half of each head turns with the token's row, the second with its column; each half's
    channels pair up (0, 1), (2, 3), ..., pair k at frequency theta^(-2k / half)."""
    half = head_dim // 2
    frequencies = ROPE_THETA ** (-torch.arange(0, half, 2, dtype=torch.float32) / half)
    angles = torch.arange(side, dtype=torch.float32)[:, None] * frequencies  # (side, half / 2)
    angles = angles.repeat_interleave(2, dim=-1)  # each angle for both members of its pair
    rows = angles[:, None, :].expand(side, side, half)
    columns = angles[None, :, :].expand(side, side, half)
    grid = torch.cat([rows, columns], dim=-1).reshape(side * side, head_dim)
    return grid.cos(), grid.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding: each channel pair (a, b) turned by its angle, (a cos - b sin, b cos + a sin), in
    fp32 (the tables' dtype, as the released network computes it under autocast) and back in x's dtype, so
    q, k and v keep one dtype when the parameters themselves are bf16 (FSDP2's mixed precision)."""
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (x * cos + turned * sin).to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    x = x * (1 + scale.unsqueeze(1))
    return x if shift is None else x + shift.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, qk_norm: bool, rms: bool):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.q_norm = make_norm(self.head_dim, rms) if qk_norm else nn.Identity()
        self.k_norm = make_norm(self.head_dim, rms) if qk_norm else nn.Identity()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor | None, rope_sin: torch.Tensor | None):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope_cos is not None:
            q, k = rotate(q, rope_cos, rope_sin), rotate(k, rope_cos, rope_sin)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, width))


class SwiGLU(nn.Module):
    """silu(x W1) * (x W2), then W3: W1 and W2 as one (width -> 2 hidden) projection."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(width, 2 * hidden)
        self.w3 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


class GeluMLP(nn.Module):
    """DiT's MLP (tanh GELU), for a LightningDiT built without SwiGLU."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class LightningDiTBlock(nn.Module):
    """x + gate * attention(modulated norm(x)), then the same with the MLP; adaLN from the conditioning."""

    def __init__(self, spec: DiTSpec):
        super().__init__()
        width = spec.hidden
        self.norm1 = make_norm(width, spec.rmsnorm)
        self.attn = Attention(width, spec.heads, spec.qk_norm, spec.rmsnorm)
        self.norm2 = make_norm(width, spec.rmsnorm)
        self.mlp = SwiGLU(width, spec.mlp_hidden) if spec.swiglu else GeluMLP(width, spec.mlp_hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, spec.modulations * width))
        self.shift = spec.modulation_shift

    def forward(self, hidden_states, conditioning, rope_cos=None, rope_sin=None):
        parts = self.adaLN_modulation(conditioning).chunk(6 if self.shift else 4, dim=1)
        if self.shift:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = parts
        else:
            (scale_msa, gate_msa, scale_mlp, gate_mlp), shift_msa, shift_mlp = parts, None, None
        attended = self.attn(modulate(self.norm1(hidden_states), shift_msa, scale_msa), rope_cos, rope_sin)
        x = hidden_states + gate_msa.unsqueeze(1) * attended
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class TimestepEmbedder(nn.Module):
    """t -> [cos, sin] of t times 128 geometric frequencies (period up to 10,000) -> MLP, as DiT's."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIMESTEP_FREQ_DIM, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIMESTEP_FREQ_DIM // 2
        frequencies = torch.exp(-math.log(MAX_PERIOD) * torch.arange(half, dtype=torch.float32) / half)
        angles = t.float()[:, None] * frequencies.to(t.device)[None]
        features = torch.cat([angles.cos(), angles.sin()], dim=-1)  # fp32, then the weights' dtype (FSDP2)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class FinalLayer(nn.Module):
    def __init__(self, spec: DiTSpec):
        super().__init__()
        width, patch = spec.hidden, spec.patch
        self.norm_final = make_norm(width, spec.rmsnorm)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.linear = nn.Linear(width, patch * patch * spec.out_channels)

    def forward(self, x: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(conditioning).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class LightningDiT(nn.Module):
    """The network of one `DiTSpec` of the lightningdit family (see the module docstring)."""

    def __init__(self, spec: DiTSpec):
        super().__init__()
        if spec.family != "lightningdit":
            raise ValueError(f"{spec.name} is not a LightningDiT")
        width, patch, side = spec.hidden, spec.patch, spec.latent_size // spec.patch
        self.dit_spec = spec
        self.x_embedder = nn.Conv2d(spec.in_channels, width, kernel_size=patch, stride=patch)
        self.t_embedder = TimestepEmbedder(width)
        self.y_embedder = nn.Embedding(spec.num_classes + 1, width)  # the last row: the null class
        self.transformer_blocks = nn.ModuleList(LightningDiTBlock(spec) for _ in range(spec.depth))
        self.final_layer = FinalLayer(spec)
        table = get_2d_sincos_pos_embed(width, side, base_size=side, output_type="pt")
        self.register_buffer("pos_embed", table.float().unsqueeze(0), persistent=False)
        cos, sin = rope_tables(spec.head_dim, side) if spec.rope else (None, None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, hidden_states, timestep, class_labels, return_dict: bool = True):
        spec = self.dit_spec
        # The residual stream takes the parameters' dtype: fp32 master weights keep it fp32 (the fp32 sin-cos
        # table promotes the patch embedding's autocast output, as in the released network); bf16 parameters
        # (FSDP2's mixed precision, which leaves buffers fp32) keep it bf16, so every linear meets its dtype.
        table = self.pos_embed.to(self.x_embedder.weight.dtype)
        x = self.x_embedder(hidden_states).flatten(2).transpose(1, 2) + table
        conditioning = self.t_embedder(timestep) + self.y_embedder(class_labels)
        for block in self.transformer_blocks:
            x = block(x, conditioning, self.rope_cos, self.rope_sin)
        x = self.final_layer(x, conditioning)
        side, p, channels = spec.latent_size // spec.patch, spec.patch, spec.out_channels
        x = x.reshape(x.shape[0], side, side, p, p, channels).permute(0, 5, 1, 3, 2, 4)
        out = x.reshape(x.shape[0], channels, side * p, side * p)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def build_lightningdit(spec: DiTSpec, init: str = "dit") -> LightningDiT:
    """A LightningDiT; `init="dit"`: the released initialisation (Xavier-uniform linears, zero biases, the patch
    embedding as a linear layer, normal(0, 0.02) class table and timestep MLP, adaLN-Zero: every block and the
    output start at zero); `init="torch"`: PyTorch's defaults (to overwrite with loaded weights)."""
    model = LightningDiT(spec)
    if init == "dit":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        conv = model.x_embedder
        nn.init.xavier_uniform_(conv.weight.view(conv.weight.shape[0], -1))
        nn.init.zeros_(conv.bias)
        nn.init.normal_(model.y_embedder.weight, std=0.02)
        nn.init.normal_(model.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(model.t_embedder.mlp[2].weight, std=0.02)
        for layer in [block.adaLN_modulation[-1] for block in model.transformer_blocks] + [
            model.final_layer.adaLN_modulation[-1],
            model.final_layer.linear,
        ]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
    return model
