"""VA-VAE (Yao et al., CVPR 2025), LightningDiT's tokenizer, as diffusers' `AutoencoderKL`.

VA-VAE f16d32 is the latent-diffusion (LDM) autoencoder, trained aligned to DINOv2: 128 base channels,
multipliers 1, 1, 2, 2, 4 (16x downsampling), two residual blocks a level, self-attention at 16 px (the last
encoder level and the first decoder level) beside the middle block's, 32 latent channels. diffusers'
AutoencoderKL expresses it exactly once those levels are its attention blocks (AttnDownEncoderBlock2D,
AttnUpDecoderBlock2D), so no module of ours is needed: `vavae_config` gives the constructor arguments and
`ldm_to_diffusers` maps the released checkpoint's LDM names onto it (1x1 attention convolutions to linear
layers, the decoder's levels in the order diffusers runs them). The training-only parts of the released file
(the DINOv2 alignment's `foundation_model`/`linear_proj`, the loss's LPIPS and discriminator) are left out.

Its latents are normalised per channel (the data set's mean and std), not by one scaling factor:
`models.vae.LatentNorm`. A VA-VAE folder says so in its `dit_accel_vae.json` (`TOKENIZER_FILE`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dit_accel.errors import UserError

TOKENIZER_FILE = "dit_accel_vae.json"  # in a VAE folder: which tokenizer, how its latents are normalised
TOKENIZER_FORMAT = "dit-accel-vae/1"
KEPT_PREFIXES = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")
_FIX = "pass the released VA-VAE .pt (hustvl/vavae-imagenet256-f16d32-dinov2), downloaded whole"


def vavae_config(
    base_channels: int = 128,
    multipliers: tuple[int, ...] = (1, 1, 2, 2, 4),
    latent_channels: int = 32,
    blocks: int = 2,
    attention_levels: tuple[int, ...] = (4,),
    groups: int = 32,
    resolution: int = 256,
) -> dict:
    """AutoencoderKL's arguments for an LDM autoencoder with attention at `attention_levels` (0: full size);
    the defaults are VA-VAE f16d32's. Its latents are not scaled (`scaling_factor` 1): see `LatentNorm`."""
    levels = len(multipliers)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": tuple(
            "AttnDownEncoderBlock2D" if i in attention_levels else "DownEncoderBlock2D" for i in range(levels)
        ),
        "up_block_types": tuple(
            "AttnUpDecoderBlock2D" if levels - 1 - k in attention_levels else "UpDecoderBlock2D"
            for k in range(levels)
        ),
        "block_out_channels": tuple(base_channels * m for m in multipliers),
        "layers_per_block": blocks,
        "latent_channels": latent_channels,
        "norm_num_groups": groups,
        "sample_size": resolution,
        "scaling_factor": 1.0,
    }


def build_vavae(**config):
    from diffusers import AutoencoderKL

    return AutoencoderKL(**vavae_config(**config))


_RESNET = {"nin_shortcut": "conv_shortcut"}
_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def ldm_to_diffusers(state: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """An LDM autoencoder's state dict in diffusers' AutoencoderKL names (see the module docstring)."""
    mapped = {}
    for key, tensor in state.items():
        new = _rename(key, levels)
        if new is None:
            raise UserError(f"the VA-VAE checkpoint has a tensor {key} the LDM autoencoder does not", _FIX)
        if ".attentions." in new and tensor.ndim == 4:  # LDM's 1x1 convolutions are diffusers' linear layers
            tensor = tensor[:, :, 0, 0]
        mapped[new] = tensor
    return mapped


def _rename(key: str, levels: int) -> str | None:
    if key.startswith(("quant_conv.", "post_quant_conv.")):
        return key
    side, rest = key.split(".", 1)
    for ldm, ours in (("norm_out.", "conv_norm_out."), ("conv_in.", "conv_in."), ("conv_out.", "conv_out.")):
        if rest.startswith(ldm):
            return f"{side}.{ours}{rest[len(ldm) :]}"
    if m := re.match(r"mid\.(block_1|attn_1|block_2)\.(\w+)\.(.+)$", rest):
        part, layer, tail = m.groups()
        where = {"block_1": "resnets.0", "attn_1": "attentions.0", "block_2": "resnets.1"}[part]
        names = _ATTENTION if part == "attn_1" else _RESNET
        return f"{side}.mid_block.{where}.{names.get(layer, layer)}.{tail}"
    if m := re.match(r"(down|up)\.(\d+)\.(block|attn)\.(\d+)\.(\w+)\.(.+)$", rest):
        direction, level, kind, index, layer, tail = m.groups()
        position = int(level) if direction == "down" else levels - 1 - int(level)
        group = "down_blocks" if direction == "down" else "up_blocks"
        names = _ATTENTION if kind == "attn" else _RESNET
        child = "attentions" if kind == "attn" else "resnets"
        return f"{side}.{group}.{position}.{child}.{index}.{names.get(layer, layer)}.{tail}"
    if m := re.match(r"(down|up)\.(\d+)\.(downsample|upsample)\.conv\.(.+)$", rest):
        direction, level, kind, tail = m.groups()
        position = int(level) if direction == "down" else levels - 1 - int(level)
        group = "down_blocks.{}.downsamplers" if direction == "down" else "up_blocks.{}.upsamplers"
        return f"{side}.{group.format(position)}.0.conv.{tail}"
    return None


def config_from_ldm_state(state: dict[str, torch.Tensor]) -> dict:
    """`vavae_config`'s arguments read off an LDM autoencoder's tensors."""
    try:
        conv_in = state["encoder.conv_in.weight"]
        if conv_in.dim() != 4 or conv_in.shape[0] == 0:
            raise UserError(
                f"the VA-VAE checkpoint's encoder.conv_in.weight has shape {tuple(conv_in.shape)}, not a "
                "convolution's (out, in, k, k)",
                _FIX,
            )
        base = conv_in.shape[0]
        levels = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.down."))
        blocks = 1 + max(int(k.split(".")[4]) for k in state if k.startswith("encoder.down.0.block."))
        multipliers = tuple(
            state[f"encoder.down.{i}.block.{blocks - 1}.conv2.weight"].shape[0] // base for i in range(levels)
        )
        latent = state["quant_conv.weight"].shape[0] // 2
        groups = _groups(base)
    except (KeyError, ValueError) as error:
        raise UserError(f"the VA-VAE checkpoint is not an LDM autoencoder: it lacks {error}", _FIX) from None
    attention = tuple(i for i in range(levels) if f"encoder.down.{i}.attn.0.q.weight" in state)
    return dict(
        base_channels=base,
        multipliers=multipliers,
        latent_channels=latent,
        blocks=blocks,
        attention_levels=attention,
        groups=groups,
    )


def _groups(channels: int) -> int:
    return 32 if channels % 32 == 0 else next(g for g in (16, 8, 4, 2, 1) if channels % g == 0)


_TENSORS_ONLY_FIX = (
    'where you trust the file, save its tensors alone once (python -c "import torch; torch.save(torch.load('
    "'IN.pt', weights_only=False)['state_dict'], 'OUT.pt')\") and pass OUT.pt"
)


def load_vavae_checkpoint(path: str | Path):
    """(AutoencoderKL, notes) from a released VA-VAE `.pt` (a state dict, or {"state_dict": ...}), read
    weights-only; one line for a file that is not one."""
    from dit_accel.models.original_dit import load_torch_file

    raw = load_torch_file(Path(path), what="VA-VAE", trust_fix=_TENSORS_ONLY_FIX)
    state = raw.get("state_dict", raw) if isinstance(raw, dict) else raw
    if not isinstance(state, dict) or "encoder.conv_in.weight" not in state:
        raise UserError(f"{path} is not a VA-VAE checkpoint (no encoder.conv_in.weight)", _FIX)
    kept = {k: v for k, v in state.items() if k.startswith(KEPT_PREFIXES) and isinstance(v, torch.Tensor)}
    left = sorted({k.split(".")[0] for k in state if not k.startswith(KEPT_PREFIXES)})
    config = config_from_ldm_state(kept)
    vae = build_vavae(**config)
    mapped = ldm_to_diffusers(kept, len(config["multipliers"]))
    expected = vae.state_dict()
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise UserError(
            f"the VA-VAE checkpoint {path} lacks {len(missing)} tensors (first: {missing[0]})", _FIX
        )
    for key, tensor in mapped.items():
        if key not in expected or tensor.shape != expected[key].shape:
            raise UserError(
                f"the VA-VAE checkpoint's tensors do not fit one LDM autoencoder ({key}: {tuple(tensor.shape)})",
                _FIX,
            )
    vae.load_state_dict(mapped, strict=True)
    notes = [f"left out what only VA-VAE's training uses: {', '.join(left)}"] if left else []
    return vae.eval().requires_grad_(False), notes
