"""The diffusers layout in and out of the tied model: a transformer (or DiT pipeline) folder loaded, the model
saved or exported for stock diffusers (the embedder copied per block), `dit_accel.json` beside the weights
(the spec and timestep shift that config.json cannot say), and the class table padded to DiTPipeline's fixed
null class 1000 and back."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import load_file, save_file
from torch import nn

from dit_accel.atomic import staged_folder, write_json_atomically
from dit_accel.errors import UserError
from dit_accel.models.dit import (
    DIFFUSERS_FREQ_SHIFT,
    EMBEDDER_PREFIX,
    _make_dit_accel_model,
    spec_from_config,
    spec_from_model,
    timestep_freq_shift,
)
from planner.spec import DiTSpec

CONFIG_NAME = "config.json"


WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


SIDECAR_NAME = "dit_accel.json"  # the spec and the timestep shift: what config.json cannot say


SIDECAR_FORMAT = "dit-accel-model/1"


def load_model(path: str | os.PathLike, *, timestep_freq_shift: int | None = None) -> DiTTransformer2DModel:
    """A tied model from a diffusers-layout folder: a transformer folder (config.json + weights) or a DiT
    pipeline folder (its `transformer/`). The per-block embedder copies must agree.

    The timestep shift comes from `dit_accel.json` when the folder has one (written by `save_model`),
    else it is diffusers' (1): a stock diffusers checkpoint is run exactly as diffusers runs it.
    """
    folder = transformer_folder(path)
    config = json.loads((folder / CONFIG_NAME).read_text())
    sidecar = read_sidecar(folder)
    if timestep_freq_shift is None:
        timestep_freq_shift = sidecar.get("timestep_freq_shift", DIFFUSERS_FREQ_SHIFT)
    model = DiTTransformer2DModel(**_dit_init_kwargs(config, folder))
    spec = DiTSpec(**sidecar["spec"]) if "spec" in sidecar else spec_from_config(model.config)
    _make_dit_accel_model(model, spec, timestep_freq_shift)
    load_diffusers_state_dict(model, read_weights(folder))
    return model


def transformer_folder(path: str | os.PathLike) -> Path:
    """The folder holding the transformer's config.json, given it or a pipeline folder above it."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(
            f"model path {folder} does not exist: pass a transformer folder or a DiT pipeline folder"
        )
    if not folder.is_dir():
        raise UserError(
            f"{folder} is a file: pass the folder holding config.json (for an original DiT .pt, use import-dit)"
        )
    if not (folder / CONFIG_NAME).exists() and (folder / "transformer" / CONFIG_NAME).exists():
        folder = folder / "transformer"
    if not (folder / CONFIG_NAME).exists():
        raise UserError(
            f"{folder} has no {CONFIG_NAME}: expected a diffusers transformer folder or a pipeline folder with transformer/"
        )
    return folder


def read_sidecar(folder: Path) -> dict:
    path = Path(folder) / SIDECAR_NAME
    if not path.exists():
        return {}
    try:
        sidecar = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(
            f"{path} is not JSON ({str(error)[:100]})", "use weights this dit-accel wrote"
        ) from None
    if not isinstance(sidecar, dict):
        raise UserError(
            f"{path} holds a JSON {type(sidecar).__name__}, not an object", "use weights this dit-accel wrote"
        )
    shift = sidecar.get("timestep_freq_shift")
    if shift is not None and (type(shift) is not int or shift not in (0, 1)):
        raise UserError(
            f"{path}: timestep_freq_shift is {shift!r}, not 0 or 1", "use weights this dit-accel wrote"
        )
    if sidecar.get("format") != SIDECAR_FORMAT:
        raise UserError(
            f"{path} has format {sidecar.get('format')!r}",
            f"this dit-accel reads {SIDECAR_FORMAT!r}: upgrade dit-accel",
        )
    return sidecar


def _dit_init_kwargs(config: dict, folder: Path) -> dict:
    """The constructor arguments of DiTTransformer2DModel found in a config.json (older hub configs name the
    class Transformer2DModel and carry extra keys that a DiT does not use)."""
    if (
        config.get("norm_type", "ada_norm_zero") != "ada_norm_zero"
        or config.get("cross_attention_dim") is not None
    ):
        raise UserError(
            f"{folder / CONFIG_NAME} is not a class-conditional DiT (norm_type ada_norm_zero, no cross-attention)"
        )
    accepted = set(inspect.signature(DiTTransformer2DModel.__init__).parameters) - {"self"}
    return {key: value for key, value in config.items() if key in accepted}


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """safetensors (single file or sharded with an index) or a legacy .bin, read on the CPU."""
    folder = Path(folder)
    single = folder / WEIGHTS_NAME
    index = folder / (WEIGHTS_NAME + ".index.json")
    legacy = folder / "diffusion_pytorch_model.bin"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(folder / shard)))
        return state
    if legacy.exists():
        try:  # weights-only: a received folder's pickle never runs code
            return torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as error:
            raise UserError(
                f"{legacy} cannot be read as plain tensors ({type(error).__name__}): refused, since weights "
                "never run code when read",
                "use the folder's diffusion_pytorch_model.safetensors, or re-save the model from a trusted copy",
            ) from None
    raise UserError(
        f"{folder} has no {WEIGHTS_NAME} (nor a sharded index or a .bin): the weights are missing"
    )


def load_diffusers_state_dict(model: DiTTransformer2DModel, state: dict[str, torch.Tensor]) -> None:
    """Load a diffusers-layout state dict into the tied model.

    Every block's embedder copy present must equal the first one present (else an error names the first
    block that disagrees); copies left out (e.g. de-duplicated by a safetensors writer) are filled in.
    """
    state = dict(state)
    depth = len(model.transformer_blocks)
    suffixes = sorted({key.split(EMBEDDER_PREFIX, 1)[1] for key in state if EMBEDDER_PREFIX in key})
    for suffix in suffixes:
        copies = [(i, state.get(f"transformer_blocks.{i}.{EMBEDDER_PREFIX}{suffix}")) for i in range(depth)]
        present = [(i, tensor) for i, tensor in copies if tensor is not None]
        reference_block, reference = present[0]
        for i, tensor in present[1:]:
            if tensor.shape != reference.shape or not torch.equal(tensor, reference):
                raise UserError(
                    f"block {i}'s embedder copy ({EMBEDDER_PREFIX}{suffix}) differs from block {reference_block}'s: "
                    "this checkpoint was trained with untied embedders and cannot load into the tied DiT exactly"
                )
        for i, tensor in copies:
            if tensor is None:
                state[f"transformer_blocks.{i}.{EMBEDDER_PREFIX}{suffix}"] = reference
    _strict_load(model, state)


def _strict_load(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """load_state_dict with one readable line for missing, unexpected or mis-shaped tensors."""
    expected = model.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {', '.join(unexpected[:3])})")
        raise UserError(
            f"the weights do not fit this DiT: {'; '.join(parts)}", "check the checkpoint matches the config"
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise UserError(
                f"weight {key} has shape {tuple(tensor.shape)} but the model expects {tuple(expected[key].shape)}"
            )
    model.load_state_dict(state, strict=True)


def save_model(model: DiTTransformer2DModel, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """dit-accel's model checkpoint: the diffusers layout plus `dit_accel.json` (spec, timestep shift).

    `load_model` restores it exactly, whatever the shift. A stock diffusers loader reads it too and gives the
    same outputs when the shift is diffusers' (1); use `export_diffusers` to make that a guarantee.
    """
    return _write_diffusers_layout(model, Path(out_dir), overwrite)


def export_diffusers(
    model: DiTTransformer2DModel,
    out_dir: str | os.PathLike,
    *,
    allow_freq_shift_change: bool = False,
    overwrite: bool = False,
) -> Path:
    """The diffusers layout for stock `DiTTransformer2DModel.from_pretrained` (embedder copied per block).

    A model with the original DiT's timestep shift (0) would run with diffusers' shift (1) there and give
    different outputs, so it is refused unless `allow_freq_shift_change=True` (then it warns); the written
    `dit_accel.json` still lets dit-accel reload it with shift 0.
    """
    if timestep_freq_shift(model) != DIFFUSERS_FREQ_SHIFT:
        message = (
            "this model uses the original DiT's timestep frequency shift (0); stock diffusers always uses 1, "
            "so its outputs would differ slightly"
        )
        if not allow_freq_shift_change:
            raise UserError(
                message + ": pass --allow-freq-shift-change (allow_freq_shift_change=True) to export anyway"
            )
        warnings.warn(message + " (exported anyway, as asked)", stacklevel=2)
    return _write_diffusers_layout(model, Path(out_dir), overwrite)


def diffusers_state_dict(model: DiTTransformer2DModel) -> dict[str, torch.Tensor]:
    """The state dict with every block's embedder as its own tensor (safetensors refuses shared storage)."""
    state, seen = {}, set()
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().contiguous()
        pointer = (tensor.device, tensor.untyped_storage().data_ptr())
        state[key] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return state


def sidecar(model: DiTTransformer2DModel) -> dict:
    """What `dit_accel.json` holds beside a model's weights: the spec and the timestep shift, which a diffusers
    config.json cannot say. `load_model` and `load_for_inference` rebuild the model from it."""
    return {
        "format": SIDECAR_FORMAT,
        "timestep_freq_shift": timestep_freq_shift(model),
        "spec": dataclasses.asdict(spec_from_model(model)),
    }


def _write_diffusers_layout(model: DiTTransformer2DModel, out_dir: Path, overwrite: bool) -> Path:
    with staged_folder(out_dir, overwrite) as staging:
        state = {key: tensor.to("cpu") for key, tensor in diffusers_state_dict(model).items()}
        save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        model.save_config(str(staging))
        write_json_atomically(staging / SIDECAR_NAME, sidecar(model))
    return out_dir


PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__: class_null = [1000] * batch_size


EXPORT_INFO = "dit_accel_export.json"  # in OUT/transformer/: the model's own class count before padding


def with_pipeline_null_class(model):
    """The model itself when its null class is already 1000, else a copy with the class table padded so the
    null class sits at row 1000 (DiTPipeline's fixed null label). Same outputs for every real class."""
    from dit_accel.models.dit import (
        build_model,
        set_timestep_freq_shift,
        spec_from_model,
        timestep_freq_shift,
    )

    spec = spec_from_model(model)
    if spec.num_classes == PIPELINE_NULL_CLASS:
        return model
    if spec.num_classes > PIPELINE_NULL_CLASS:
        raise UserError(
            f"this model has {spec.num_classes} classes, but DiTPipeline always uses label 1000 as the null "
            f"class for guidance, which would be a real class here: it cannot be exported as a DiTPipeline"
        )
    padded = build_model(dataclasses.replace(spec, num_classes=PIPELINE_NULL_CLASS), init="torch")
    set_timestep_freq_shift(padded, timestep_freq_shift(model))
    state = dict(model.state_dict())
    table_names = [name for name in state if name.endswith("class_embedder.embedding_table.weight")]
    table = state[table_names[0]]
    new_table = table[-1:].repeat(PIPELINE_NULL_CLASS + 1, 1)  # every row the null row ...
    new_table[: spec.num_classes] = table[: spec.num_classes]  # ... except the real classes
    for name in table_names:
        state[name] = new_table
    padded.load_state_dict(state)
    return padded.to(next(model.parameters()).device).eval()


def exported_num_classes(folder: str | os.PathLike) -> int | None:
    """The class count a pipeline (or its transformer) folder had before export padded it to 1,000."""
    from dit_accel.models.diffusers_format import transformer_folder

    path = transformer_folder(folder) / EXPORT_INFO
    return int(json.loads(path.read_text())["num_classes"]) if path.is_file() else None


def unpad_class_table(parameters: dict, num_classes: int) -> dict:
    """The weights of an exported model with its class table back to `num_classes` + 1 rows (the real classes,
    then the null row from row 1000); refused unless the rows in between are the padding export wrote."""
    import torch

    names = [name for name in parameters if name.endswith("class_embedder.embedding_table.weight")]
    out = dict(parameters)
    for name in names:
        table = parameters[name]
        if table.shape[0] != PIPELINE_NULL_CLASS + 1 or num_classes >= PIPELINE_NULL_CLASS:
            raise ValueError(f"{name} has {table.shape[0]} rows: not a padded export")
        null_row = table[PIPELINE_NULL_CLASS : PIPELINE_NULL_CLASS + 1]
        if not torch.equal(
            table[num_classes:PIPELINE_NULL_CLASS], null_row.expand(PIPELINE_NULL_CLASS - num_classes, -1)
        ):
            raise ValueError(f"rows {num_classes}..999 of {name} are not export's padding: real classes")
        out[name] = torch.cat([table[:num_classes], null_row])
    return out
