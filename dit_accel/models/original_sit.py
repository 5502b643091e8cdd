"""SiT and REPA checkpoints (their repositories' `.pt` state dicts) as flow models in dit-accel's convention.

Both networks are the DiT network in the original DiT's key layout (SiT's models.py and REPA's models/sit.py
keep its names, fused qkv and sin-cos tables), so `dit_accel.models.original_dit` reads them; what differs is how
they are called and what they output, and that is folded into the weights here, so that every flow model
dit-accel holds runs one way (t = 0 data, t = 1 noise, the first C channels the velocity d x_t / dt):

  SiT   t runs the other way (t_SiT = 1 - t) and it predicts the velocity of that time (v_SiT = -v). The
        timestep features of 1 - t are a fixed linear map of those of t (per frequency f: cos f(1-t) =
        cos f cos ft + sin f sin ft, sin f(1-t) = sin f cos ft - cos f sin ft), folded into the timestep
        MLP's first layer; the velocity channels of the output layer are negated. Its learned-sigma half
        (which SiT drops in its forward and never trains) is kept as it is.
  REPA  the same time and velocity as dit-accel's; its network has no learned-sigma half (C output
        channels), so the output layer is padded with C zero channels to the DiT's 2C. Its projector
        (`projectors.*`, used only by the training loss) is not part of the sampling network and is left out
        (with a line saying so: an imported REPA model samples and fine-tunes as a flow model).

Exact in real arithmetic; in float32 the folded layer rounds differently (docs/sampling.md states the
measured difference).
"""

from __future__ import annotations

import math

import torch

from dit_accel.errors import UserError
from dit_accel.models.original_dit import check_complete, load_original_dit, original_state_dict

LAYOUTS = ("sit", "repa")
REPOSITORY = {"sit": "SiT", "repa": "REPA"}  # as errors name them
TIMESTEP_FEATURES = 256  # the DiT's frequency embedding size (half cos, half sin)
REPA_PROJECTOR_PREFIX = "projectors."


def time_reversal_matrix(features: int = TIMESTEP_FEATURES, max_period: float = 10000.0) -> torch.Tensor:
    """R (float64) with features(1 - t) = R @ features(t) for the original DiT's [cos(t f), sin(t f)] features."""
    half = features // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / half)
    cos, sin = torch.diag(torch.cos(freqs)), torch.diag(torch.sin(freqs))
    return torch.cat([torch.cat([cos, sin], dim=1), torch.cat([sin, -cos], dim=1)], dim=0)


def _output_rows(state: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(patch, input channels, output channels) of an original-layout state dict."""
    _, in_channels, patch, _ = state["x_embedder.proj.weight"].shape
    return patch, in_channels, state["final_layer.linear.weight"].shape[0] // (patch * patch)


def sit_to_dit_accel(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A SiT state dict whose network, called with dit-accel's t, outputs dit-accel's velocity (module docstring)."""
    state = dict(state)
    weight = state["t_embedder.mlp.0.weight"]
    if weight.shape[1] != TIMESTEP_FEATURES:
        raise UserError(f"SiT's timestep MLP takes {TIMESTEP_FEATURES} features, this one {weight.shape[1]}")
    state["t_embedder.mlp.0.weight"] = (weight.double() @ time_reversal_matrix()).to(weight.dtype)
    patch, in_channels, out_channels = _output_rows(state)
    velocity_rows = (torch.arange(patch * patch * out_channels) % out_channels) < in_channels
    sign = torch.where(velocity_rows, -1.0, 1.0)
    state["final_layer.linear.weight"] = state["final_layer.linear.weight"] * sign[:, None].to(weight.dtype)
    state["final_layer.linear.bias"] = state["final_layer.linear.bias"] * sign.to(weight.dtype)
    return state


def with_sigma_half(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's 2C output channels for a network that outputs C (REPA's): C zero channels appended."""
    patch, in_channels, out_channels = _output_rows(state)
    if out_channels == 2 * in_channels:
        return state
    if out_channels != in_channels:
        raise UserError(
            f"the checkpoint outputs {out_channels} channels for {in_channels} inputs: SiT's network outputs "
            f"{2 * in_channels} (learned sigma) or {in_channels}, REPA's {in_channels}"
        )
    state = dict(state)
    weight, bias = state["final_layer.linear.weight"], state["final_layer.linear.bias"]
    rows = weight.reshape(patch * patch, in_channels, -1)  # output row = (patch position, channel)
    state["final_layer.linear.weight"] = torch.cat([rows, torch.zeros_like(rows)], dim=1).reshape(
        patch * patch * 2 * in_channels, -1
    )
    biases = bias.reshape(patch * patch, in_channels)
    state["final_layer.linear.bias"] = torch.cat([biases, torch.zeros_like(biases)], dim=1).flatten()
    return state


def without_repa_projector(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state dict without REPA's projector, and the keys left out."""
    projector = sorted(key for key in state if key.startswith(REPA_PROJECTOR_PREFIX))
    return {key: value for key, value in state.items() if key not in projector}, projector


def load_flow_checkpoint(
    path_or_state_dict,
    layout: str,
    *,
    heads: int | None = None,
    prefer: str = "ema",
    trust_pickle: bool = False,
):
    """(model, notes): a SiT or REPA checkpoint as a tied dit-accel DiT (original timestep shift, 0) that
    computes dit-accel's velocity at dit-accel's t; `notes` says what was changed or left out."""
    if layout not in LAYOUTS:
        raise UserError(f"the checkpoint layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    what = REPOSITORY[layout]
    state = original_state_dict(path_or_state_dict, prefer=prefer, trust_pickle=trust_pickle, what=what)
    notes = []
    state, projector = without_repa_projector(state)
    check_complete(state, what)  # before the folds below read any tensor
    if projector:
        notes.append(
            f"REPA's projector ({len(projector)} tensors) left out: only REPA's training loss uses it"
        )
    if _output_rows(state)[2] == _output_rows(state)[1]:
        notes.append("a zero learned-sigma half added to the output layer (the DiT's 2C channels)")
    state = with_sigma_half(state)
    if layout == "sit":
        state = sit_to_dit_accel(state)
        notes.append("time reversed (t = 1 - t_SiT) and velocity negated, folded into the weights")
    return load_original_dit(state, heads=heads, prefer=prefer, what=what), notes
