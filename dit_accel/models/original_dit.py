"""Original DiT checkpoints (the DiT repository's `.pt` state dicts) as tied dit-accel models.

The original fuses q, k and v into one qkv projection, names every layer its own way and stores its fixed
sin-cos positional table; this module reads such a file (weights only unless trusted), infers the network
from the tensor shapes, checks the table, and renames the tensors into diffusers' layout. The model keeps
the original's timestep-frequency shift (0), which `dit_accel.models.dit` records beside saved weights.
"""

from __future__ import annotations

import math
import pickle
import zipfile
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel

from dit_accel.errors import UserError, first_line
from dit_accel.models.diffusers_format import load_diffusers_state_dict
from dit_accel.models.dit import (
    EMBEDDER_PREFIX,
    ORIGINAL_DIT_FREQ_SHIFT,
    build_model,
    network_mismatch,
    spec_from_shapes,
)
from planner.spec import FAMILY, DiTSpec


def load_original_dit(
    path_or_state_dict,
    spec: DiTSpec | None = None,
    *,
    heads: int | None = None,
    prefer: str = "ema",
    trust_pickle: bool = False,
    what: str = "original DiT",
) -> DiTTransformer2DModel:
    """A tied model (timestep shift 0, layer-norm eps 1e-6) that reproduces an original DiT checkpoint.

    Accepts a path to a `.pt` or an already-loaded dict: a plain state dict (the released checkpoints), or a
    training checkpoint {"model": ..., "ema": ...} (the EMA weights unless `prefer="model"`); a DDP
    "module." prefix is stripped. The spec is inferred from shapes (depth, hidden, patch, channels, latent
    size, classes, learned sigma); the head count cannot be, so it comes from the DiT family table, `heads`,
    or `spec`. Files are read with `weights_only=True`; `trust_pickle=True` allows other pickled objects.
    `what` names the repository in errors (SiT's and REPA's checkpoints have this layout too).
    """
    state = original_state_dict(path_or_state_dict, prefer=prefer, trust_pickle=trust_pickle, what=what)
    inferred = spec_from_original_state_dict(
        state,
        heads=heads if spec is None else spec.heads,
        latent_size=None if spec is None else spec.latent_size,
        what=what,
    )
    if spec is not None:
        _check_same_network(spec, inferred)
    else:
        spec = inferred
    model = build_model(spec, timestep_freq_shift=ORIGINAL_DIT_FREQ_SHIFT, init="torch")
    if "pos_embed" in state:
        _check_positional_table(state, model)
    load_diffusers_state_dict(model, original_to_diffusers_state_dict(state, spec.depth))
    return model


PICKLE_PROTOCOL_2_OR_LATER = 0x80  # the first byte of torch.save's legacy (pre-zip) format


def load_torch_file(
    path: Path,
    trust_pickle: bool = False,
    what: str = "original DiT",
    trust_fix: str = "pass --trust-checkpoint only if you trust where it came from",
):
    """torch.load for a file the user named: what is not torch's zip nor a pickle (an empty file, an HTML
    error page saved as .pt, a truncated download) is named as such, not sent to the unpickler, whose errors
    for it range from KeyError to an empty message; a real pickle with Python objects asks for trust, in the
    words of `trust_fix` (the import commands have --trust-checkpoint; a reader without it says what to do)."""
    fix = f"pass --checkpoint the {what} repository's .pt file, downloaded whole"
    with path.open("rb") as handle:
        first = handle.read(1)
    if not zipfile.is_zipfile(path) and first != bytes([PICKLE_PROTOCOL_2_OR_LATER]):
        what = (
            "an empty file" if not first else "neither torch's zip format nor a pickle (text? an HTML page?)"
        )
        raise UserError(f"cannot read {path} as a torch checkpoint: it is {what}", fix)
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as error:
        raise UserError(
            f"{path} holds Python objects besides tensors (a training checkpoint's args?) and is read "
            f"weights-only ({first_line(error)[:100]})",
            trust_fix,
        ) from None
    except (RuntimeError, EOFError, IndexError, KeyError, ValueError, OSError) as error:  # truncated, damaged
        raise UserError(
            f"cannot read {path} as a torch checkpoint ({first_line(error)[:120]})", fix
        ) from None


def _an(what: str) -> str:
    return ("an " if what[0].lower() in "aeiou" else "a ") + what


def original_state_dict(
    path_or_state_dict, *, prefer: str = "ema", trust_pickle: bool = False, what: str = "original DiT"
) -> dict[str, torch.Tensor]:
    """The network's tensors from a checkpoint file or dict of the DiT repository's layout (`what`: the
    repository named in errors: original DiT, SiT, REPA, LightningDiT; see `load_original_dit`)."""
    if prefer not in ("ema", "model"):
        raise UserError(f"prefer must be 'ema' or 'model', got {prefer!r}")
    if isinstance(path_or_state_dict, dict):
        raw = path_or_state_dict
    else:
        path = Path(path_or_state_dict)
        if not path.is_file():
            raise UserError(
                f"{what} checkpoint {path} is not a file: pass the .pt state dict of the {what} repository"
            )
        raw = load_torch_file(path, trust_pickle, what)
    if not isinstance(raw, dict):
        raise UserError(f"{_an(what)} checkpoint is a dict of tensors, got {type(raw).__name__}")
    if not any(isinstance(value, torch.Tensor) for value in raw.values()):
        order = ("ema", "model") if prefer == "ema" else ("model", "ema")
        found = [key for key in order if isinstance(raw.get(key), dict)]
        if not found:
            raise UserError(
                f"no state dict found in the checkpoint (top-level keys: {sorted(raw)[:6]})",
                "expected tensors or 'ema'/'model'",
            )
        raw = raw[found[0]]
    state = {
        key.removeprefix("module."): value for key, value in raw.items() if isinstance(value, torch.Tensor)
    }
    if "x_embedder.proj.weight" not in state:
        raise UserError(
            f"this is not {_an(what)} state dict (no x_embedder.proj.weight)",
            "for diffusers folders use load_model",
        )
    return state


def spec_from_original_state_dict(
    state: dict[str, torch.Tensor],
    heads: int | None = None,
    latent_size: int | None = None,
    what: str = "original DiT",
) -> DiTSpec:
    """Depth, width, patch, channels, latent size, classes and learned sigma, read off the tensor shapes
    (`heads`, and `latent_size` when the state dict has no pos_embed, must be given where they cannot be)."""
    check_complete(state, what)
    hidden, in_channels, patch, _ = state["x_embedder.proj.weight"].shape
    depth = len({key.split(".")[1] for key in state if key.startswith("blocks.")})
    out_channels = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    num_classes = state["y_embedder.embedding_table.weight"].shape[0] - 1
    if "pos_embed" in state:
        latent_size = math.isqrt(state["pos_embed"].shape[1]) * patch
    elif latent_size is None:
        raise UserError(
            "the checkpoint has no pos_embed, so its latent size is unknown: pass a spec (resolution)"
        )
    if heads is None:
        matches = [shape[2] for shape in FAMILY.values() if shape[:2] == (depth, hidden)]
        if not matches:
            raise UserError(
                f"a DiT of depth {depth} and width {hidden} is not in the family table, so its head count "
                "is unknown: pass heads (--heads)"
            )
        heads = matches[0]
    return spec_from_shapes(
        depth=depth,
        hidden=hidden,
        heads=heads,
        patch=patch,
        in_channels=in_channels,
        out_channels=out_channels,
        latent_size=latent_size,
        num_classes=num_classes,
    )


_TOP_LAYERS = ("x_embedder.proj", "t_embedder.mlp.0", "t_embedder.mlp.2", "final_layer.adaLN_modulation.1")
_BLOCK_LAYERS = ("adaLN_modulation.1", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def check_complete(state: dict[str, torch.Tensor], what: str = "original DiT") -> None:
    """Every tensor a DiT of this depth has (the depth: its highest block), before any is read: a partial
    state dict (a truncated save, a subset, another network) is one line naming what is missing."""
    blocks = {
        int(key.split(".")[1]) for key in state if key.startswith("blocks.") and key.split(".")[1].isdigit()
    }
    layers = [*_TOP_LAYERS, "final_layer.linear"]
    layers += [f"blocks.{n}.{layer}" for n in range(max(blocks, default=-1) + 1) for layer in _BLOCK_LAYERS]
    wanted = [f"{layer}.{kind}" for layer in layers for kind in ("weight", "bias")]
    wanted.append("y_embedder.embedding_table.weight")
    missing = [key for key in wanted if not isinstance(state.get(key), torch.Tensor)]
    if not blocks:
        missing.insert(0, "blocks.0.*")
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise UserError(
            f"the {what} checkpoint is incomplete: it lacks {', '.join(missing[:4])}{more} "
            f"({len(state)} tensors found)",
            f"pass the whole .pt state dict of the {what} repository (a truncated or partial save cannot be "
            "imported)",
        )


def _check_same_network(spec: DiTSpec, inferred: DiTSpec) -> None:
    mismatch = network_mismatch(inferred, spec)
    if mismatch:
        raise UserError(
            f"the checkpoint has {mismatch}: pass the spec the checkpoint was trained with (or none)"
        )


def _check_positional_table(state: dict[str, torch.Tensor], model: DiTTransformer2DModel) -> None:
    """The original stores its fixed sin-cos table; diffusers recomputes it. They must agree."""
    ours = model.pos_embed.pos_embed
    theirs = state["pos_embed"].to(ours.dtype)
    if theirs.shape != ours.shape or not torch.allclose(theirs, ours, atol=1e-5, rtol=0):
        raise UserError(
            "the checkpoint's pos_embed is not the fixed 2-D sin-cos table the DiT uses: "
            "this network is not a standard DiT and cannot be reproduced by diffusers' DiT"
        )


def original_to_diffusers_state_dict(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Rename (and split the fused qkv of) an original DiT state dict into diffusers' DiT layout.

    Block 0 carries the embedder; `load_diffusers_state_dict` fills the other blocks' (tied) copies. Every
    original tensor except pos_embed (checked separately) must be used: leftovers are an error.
    """
    source = dict(state)
    source.pop("pos_embed", None)
    target: dict[str, torch.Tensor] = {}

    def move(old: str, new: str) -> None:
        for kind in ("weight", "bias"):
            if f"{old}.{kind}" not in source:
                raise UserError(
                    f"the original DiT checkpoint lacks {old}.{kind}: the file is incomplete or not a DiT"
                )
            target[f"{new}.{kind}"] = source.pop(f"{old}.{kind}")

    move("x_embedder.proj", "pos_embed.proj")
    embedder = f"transformer_blocks.0.{EMBEDDER_PREFIX}"
    move("t_embedder.mlp.0", embedder + "timestep_embedder.linear_1")
    move("t_embedder.mlp.2", embedder + "timestep_embedder.linear_2")
    target[embedder + "class_embedder.embedding_table.weight"] = source.pop(
        "y_embedder.embedding_table.weight"
    )
    for n in range(depth):
        old, new = f"blocks.{n}", f"transformer_blocks.{n}"
        move(f"{old}.adaLN_modulation.1", f"{new}.norm1.linear")  # same chunk order: shift, scale, gate x2
        for kind in ("weight", "bias"):
            fused = source.pop(f"{old}.attn.qkv.{kind}", None)
            if fused is None:
                raise UserError(f"the original DiT checkpoint lacks {old}.attn.qkv.{kind}")
            for name, part in zip(("to_q", "to_k", "to_v"), fused.chunk(3, dim=0)):
                target[f"{new}.attn1.{name}.{kind}"] = part.contiguous()
        move(f"{old}.attn.proj", f"{new}.attn1.to_out.0")
        move(f"{old}.mlp.fc1", f"{new}.ff.net.0.proj")
        move(f"{old}.mlp.fc2", f"{new}.ff.net.2")
    move("final_layer.adaLN_modulation.1", "proj_out_1")  # (shift, scale) in both
    move("final_layer.linear", "proj_out_2")
    if source:
        raise UserError(
            f"the original DiT checkpoint has tensors this DiT does not use: {', '.join(sorted(source)[:4])}"
        )
    return target
