"""REPA's frozen encoder: a DINOv2 ViT/14 read from its published state dict, offline, and what it sees.

Written here (not torch.hub) so a run needs no network and no code from elsewhere at run time: the module
names are DINOv2's own (patch_embed.proj, cls_token, pos_embed, register_tokens, blocks.N.{norm1, attn.qkv,
attn.proj, ls1.gamma, norm2, mlp.fc1|w12, mlp.fc2|w3, ls2.gamma}, norm), so the published
`dinov2_vit{s,b,l,g}14[_reg4]_pretrain.pth` files load strictly, and the architecture (width, depth, MLP or
SwiGLU, registers) is read from their shapes. The positional table (37 x 37 patches, for 518 px) is resampled
ONCE to the grid the run needs, bicubic with antialiasing as REPA does at load (timm's resample), so every
forward sees a table of its own size.

What the encoder sees (`preprocess`): the clean image in [-1, 1] -> [0, 1] -> ImageNet mean/std -> bicubic
resize to one encoder patch per DiT token (224 px for 256 px XL/2, REPA's 224 * (resolution // 256)).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dit_accel.errors import UserError
from planner.repa import ENCODER_PATCH

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYER_NORM_EPS = 1e-6  # DINOv2's, for every layer norm
HEAD_DIM = 64  # every DINOv2 backbone: heads = width / 64
WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors")
HOW_TO_GET = (
    "download a DINOv2 backbone's weights (e.g. https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/"
    "dinov2_vitb14_pretrain.pth) and pass --repa-encoder FILE (or a folder holding one such file)"
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """ViT-g's feed-forward: w12 gives both halves, silu(x1) * x2 goes through w3."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w12, self.w3 = nn.Linear(dim, 2 * hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, swiglu: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = Attention(dim, heads)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = SwiGLU(dim, mlp_hidden) if swiglu else Mlp(dim, mlp_hidden)
        self.ls2 = LayerScale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, ENCODER_PATCH, stride=ENCODER_PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class DinoV2(nn.Module):
    """A DINOv2 ViT/14 backbone in its published layout; `forward` gives the normed patch tokens (B, N, dim)."""

    def __init__(
        self,
        dim: int,
        depth: int,
        mlp_hidden: int,
        swiglu: bool = False,
        registers: int = 0,
        pos_grid: int = 37,
    ):
        super().__init__()
        self.dim, self.registers = dim, registers
        self.patch_embed = PatchEmbed(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + pos_grid * pos_grid, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, dim))  # in the published file; unused without masks
        self.register_tokens = nn.Parameter(torch.zeros(1, registers, dim)) if registers else None
        self.blocks = nn.ModuleList(Block(dim, dim // HEAD_DIM, mlp_hidden, swiglu) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)

    @property
    def grid(self) -> int:
        return round((self.pos_embed.shape[1] - 1) ** 0.5)

    def resample_positions(self, grid: int) -> None:
        """The positional table resampled to `grid` x `grid` patches, once (bicubic, antialiased, in fp32)."""
        if grid == self.grid:
            return
        table = self.pos_embed.detach().float()
        patches = table[:, 1:].reshape(1, self.grid, self.grid, self.dim).permute(0, 3, 1, 2)
        patches = F.interpolate(
            patches, size=(grid, grid), mode="bicubic", antialias=True, align_corners=False
        )
        patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, self.dim)
        resampled = torch.cat([table[:, :1], patches], dim=1).to(self.pos_embed.dtype)
        self.pos_embed = nn.Parameter(resampled, requires_grad=self.pos_embed.requires_grad)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        if x.shape[1] != self.pos_embed.shape[1] - 1:
            raise ValueError(
                f"{x.shape[1]} patches but the positional table has {self.pos_embed.shape[1] - 1}"
            )
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1) + self.pos_embed
        if self.register_tokens is not None:
            x = torch.cat(
                [x[:, :1], self.register_tokens.expand(x.shape[0], -1, -1).to(x.dtype), x[:, 1:]], 1
            )
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, 1 + self.registers :]


def architecture_of(state: dict[str, torch.Tensor]) -> dict:
    """DinoV2's constructor arguments read from a state dict's shapes."""
    try:
        dim = state["cls_token"].shape[-1]
        depth = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("blocks."))
        swiglu = "blocks.0.mlp.w12.weight" in state
        mlp_hidden = state["blocks.0.mlp.w3.weight" if swiglu else "blocks.0.mlp.fc1.weight"].shape[
            1 if swiglu else 0
        ]
        registers = state["register_tokens"].shape[1] if "register_tokens" in state else 0
        pos_grid = round((state["pos_embed"].shape[1] - 1) ** 0.5)
    except (KeyError, ValueError, IndexError) as error:
        raise UserError(
            f"the REPA encoder's weights are not a DINOv2 ViT/14 state dict (no {error})", HOW_TO_GET
        ) from None
    return dict(
        dim=dim, depth=depth, mlp_hidden=mlp_hidden, swiglu=swiglu, registers=registers, pos_grid=pos_grid
    )


def weights_file(path: str | Path) -> Path:
    """The one weights file at `path` (a file, or a folder holding exactly one .pth/.pt/.safetensors)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        if len(found) != 1:
            what = "no weights file" if not found else f"{len(found)} weights files"
            raise UserError(f"REPA encoder folder {path} holds {what}", HOW_TO_GET)
        return found[0]
    if not path.is_file():
        raise UserError(f"REPA encoder weights {path} do not exist", HOW_TO_GET)
    return path


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    file = weights_file(path)
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file), device="cpu")
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated download, a pickle that is not tensors
        raise UserError(
            f"REPA encoder weights {file} cannot be read ({type(error).__name__})", HOW_TO_GET
        ) from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    return {
        key.removeprefix("module."): tensor for key, tensor in state.items() if not key.startswith("head.")
    }


def load_encoder(path: str | Path, grid: int, device: torch.device | str = "cpu") -> DinoV2:
    """The frozen encoder from `path`, its positions resampled to `grid` x `grid`, in fp32 eval mode on
    `device`, every parameter without gradient (nothing of it is trained, saved or optimised)."""
    state = read_state(path)
    encoder = DinoV2(**architecture_of(state))
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(
            f"the REPA encoder's weights do not fit DINOv2's layout: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}",
            HOW_TO_GET,
        )
    encoder.resample_positions(grid)
    encoder.requires_grad_(False)
    return encoder.to(device).eval()


def encoder_of_shape(name: str, grid: int, device: torch.device | str = "cpu") -> DinoV2:
    """A frozen encoder of a published backbone's shape (planner.repa's `name`) with its weights left at their
    initial values: what `dit-accel verify` traces on fake tensors, where only shapes and dtypes count."""
    from planner.repa import encoder_spec

    spec = encoder_spec(name)
    with torch.device(device):
        encoder = DinoV2(spec.dim, spec.depth, spec.mlp_hidden, spec.swiglu, spec.registers, pos_grid=grid)
    encoder.requires_grad_(False)
    return encoder.eval()


def preprocess(images: torch.Tensor, grid: int) -> torch.Tensor:
    """Clean images in [-1, 1] -> what DINOv2 expects: [0, 1], ImageNet-normalised, bicubic-resized to one
    encoder patch per DiT token."""
    x = (images.float() + 1) / 2
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    side = ENCODER_PATCH * grid
    if x.shape[-2:] != (side, side):
        x = F.interpolate(x, size=(side, side), mode="bicubic", align_corners=False)
    return x


DEMO_ENCODER = dict(dim=64, depth=2, mlp_hidden=128)  # DINOv2's layout at a CPU's size


def write_demo_encoder(path, seed: int = 0):
    """A tiny random encoder in DINOv2's published layout (a plain state dict, as torch.hub's .pth is), so
    that REPA runs on a CPU with no download (`demo-data --repa-encoder`). Its features align the network
    with nothing meaningful: the plumbing is the point. Written whole or not at all."""
    from dit_accel.atomic import write_atomically

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = DinoV2(**DEMO_ENCODER)
        with torch.no_grad():
            for param in encoder.parameters():
                param.normal_(0, 0.2)
    state = {key: value.clone() for key, value in encoder.state_dict().items()}
    return write_atomically(path, lambda file: torch.save(state, file))
