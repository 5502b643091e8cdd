"""LightningDiT's released checkpoints (hustvl/LightningDiT `.pt`: a state dict, or a training checkpoint's
"ema"/"model") read into dit-accel's LightningDiT (`models.lightningdit`).

The network is inferred from the tensor shapes: depth, width, patch, latent channels and grid, classes, and
the block switches (RMSNorm: a norm weight; SwiGLU: `mlp.w12`; QK-norm: `attn.q_norm`; RoPE: the stored
rotary tables; shift-free modulation: 4 rather than 6 adaLN outputs). The head count comes from the rotary
table or the QK-norm weight (each one head wide), else from the released sizes, else `heads`. The stored
sin-cos and rotary tables are checked against the ones dit-accel builds, then dropped (they follow from the
shapes). Time is folded as for SiT (`models.original_sit`): LightningDiT runs t the other way (t = 0 noise)
and predicts that time's velocity, so its timestep MLP's first layer takes the time-reversal map and its
output layer is negated; the network then computes dit-accel's velocity at dit-accel's t.
"""

from __future__ import annotations

import math
import re

import torch

from dit_accel.errors import UserError
from dit_accel.models.lightningdit import LightningDiT, build_lightningdit
from dit_accel.models.original_dit import original_state_dict
from dit_accel.models.original_sit import time_reversal_matrix
from planner.spec import LIGHTNINGDIT_SIZES, TOKENIZERS, DiTSpec

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
TABLE_ATOL = 1e-5  # the stored tables (float32 of float64 numpy) against dit-accel's float32 ones
_FIX = "pass the .pt file of hustvl/LightningDiT (for DiT use import-dit, for SiT import-sit)"


def load_lightningdit(
    path_or_state_dict, *, heads: int | None = None, prefer: str = "ema", trust_pickle: bool = False
) -> tuple[LightningDiT, list[str]]:
    """(model, notes) from a released LightningDiT checkpoint: dit-accel's LightningDiT computing dit-accel's
    velocity at dit-accel's t (see the module docstring); `notes` say what was changed or checked."""
    state = original_state_dict(
        path_or_state_dict, prefer=prefer, trust_pickle=trust_pickle, what="LightningDiT"
    )
    spec = spec_from_released(state, heads)
    model = build_lightningdit(spec, init="torch")
    _check_table(state, "pos_embed", model.pos_embed, "the fixed sin-cos positional table")
    if spec.rope:
        _check_table(state, "feat_rope.freqs_cos", model.rope_cos, "the rotary embedding's cos table")
        _check_table(state, "feat_rope.freqs_sin", model.rope_sin, "the rotary embedding's sin table")
    ours = released_to_dit_accel(state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    if missing or unexpected:
        parts = [
            f"lacks {', '.join(missing[:3])}" if missing else "",
            f"has no place for {', '.join(unexpected[:3])}" if unexpected else "",
        ]
        raise UserError(
            f"the LightningDiT checkpoint is not the released network: it {'; '.join(p for p in parts if p)}",
            _FIX,
        )
    for key, tensor in ours.items():
        if tensor.shape != expected[key].shape:
            raise UserError(
                f"the LightningDiT checkpoint's {key} has shape {tuple(tensor.shape)}, the network inferred from "
                f"its other tensors needs {tuple(expected[key].shape)}",
                _FIX,
            )
    model.load_state_dict(ours, strict=True)
    notes = [
        f"{spec.name} ({spec.params_trainable:,} parameters) on {spec.tokenizer} latents "
        f"({spec.in_channels} channels, {spec.latent_size}x{spec.latent_size})",
        "time reversed (t = 1 - t_LightningDiT) and velocity negated, folded into the weights",
        "the stored sin-cos" + (" and rotary tables" if spec.rope else " table") + " match dit-accel's",
    ]
    return model, notes


def spec_from_released(state: dict[str, torch.Tensor], heads: int | None = None) -> DiTSpec:
    """The LightningDiT spec a released state dict describes (module docstring); one line when it is not one."""
    for needed in (
        "y_embedder.embedding_table.weight",
        "pos_embed",
        "final_layer.linear.weight",
        "blocks.0.adaLN_modulation.1.weight",
    ):
        if needed not in state:
            raise UserError(f"the LightningDiT checkpoint lacks {needed}", _FIX)
    hidden, in_channels, patch, _ = state["x_embedder.proj.weight"].shape
    depth = 1 + max(int(m.group(1)) for key in state if (m := _BLOCK.match(key)))
    tokens = state["pos_embed"].shape[-2]
    side = math.isqrt(tokens)
    out_channels = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    if out_channels == 2 * in_channels:
        raise UserError(
            f"this checkpoint outputs {out_channels} channels for {in_channels} (a learned sigma): a DiT or SiT "
            "network, not LightningDiT's velocity-only one",
            "import it with import-dit or import-sit",
        )
    tokenizer = next((t.name for t in TOKENIZERS.values() if t.channels == in_channels), None)
    if tokenizer is None or out_channels != in_channels or side * side != tokens:
        raise UserError(
            f"the LightningDiT checkpoint has {in_channels} input and {out_channels} output channels on {tokens} "
            "tokens: not a released network (32 channels of VA-VAE latents, a square grid)",
            _FIX,
        )
    if "feat_rope.freqs_cos" in state:
        head_dim = state["feat_rope.freqs_cos"].shape[-1]
    elif "blocks.0.attn.q_norm.weight" in state:
        head_dim = state["blocks.0.attn.q_norm.weight"].shape[0]
    else:
        known = [h for d, w, h in LIGHTNINGDIT_SIZES.values() if (d, w) == (depth, hidden)]
        head_dim = hidden // (heads or (known[0] if known else 0)) if (heads or known) else 0
    if not head_dim or hidden % head_dim:
        raise UserError(
            f"cannot tell the head count of a {depth}-block, {hidden}-wide LightningDiT from its tensors",
            "pass --heads",
        )
    size = next(
        (name for name, shape in LIGHTNINGDIT_SIZES.items() if shape == (depth, hidden, hidden // head_dim)),
        None,
    )
    modulations = state["blocks.0.adaLN_modulation.1.weight"].shape[0] // hidden
    return DiTSpec(
        name=f"LightningDiT-{size}/{patch}" if size else "LightningDiT-custom",
        family="lightningdit",
        depth=depth,
        hidden=hidden,
        heads=hidden // head_dim,
        patch=patch,
        resolution=side * patch * TOKENIZERS[tokenizer].downsample,
        num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1,
        tokenizer=tokenizer,
        rope="feat_rope.freqs_cos" in state,
        rmsnorm="blocks.0.norm1.weight" in state,
        swiglu="blocks.0.mlp.w12.weight" in state,
        qk_norm="blocks.0.attn.q_norm.weight" in state,
        modulation_shift=modulations == 6,
    )


def released_to_dit_accel(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released keys in dit-accel's names, time and velocity folded in; the fixed tables left out."""
    renamed = {}
    for key, tensor in state.items():
        if key in ("pos_embed", "feat_rope.freqs_cos", "feat_rope.freqs_sin"):
            continue
        key = _BLOCK.sub(lambda m: f"transformer_blocks.{m.group(1)}.", key)
        key = key.replace("x_embedder.proj.", "x_embedder.").replace(
            "y_embedder.embedding_table.", "y_embedder."
        )
        renamed[key] = tensor
    first = renamed.get("t_embedder.mlp.0.weight")
    if first is not None and first.shape[1] == time_reversal_matrix().shape[0]:
        renamed["t_embedder.mlp.0.weight"] = (first.double() @ time_reversal_matrix()).to(first.dtype)
    for key in ("final_layer.linear.weight", "final_layer.linear.bias"):
        if key in renamed:
            renamed[key] = -renamed[key]
    return renamed


def _check_table(state: dict, key: str, ours: torch.Tensor, what: str) -> None:
    if key not in state:
        return
    stored = state[key].float().reshape(ours.shape)
    difference = (stored - ours.float()).abs().max().item()
    if difference > TABLE_ATOL:
        raise UserError(
            f"the checkpoint's {key} differs from {what} by up to {difference:.3g}: not the released network",
            _FIX,
        )
