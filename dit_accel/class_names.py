"""Class names of a model: what a run, its latent cache or a pipeline folder recorded, and `--labels` files.

Used by `dit-accel sample` (grid rows named by class) and `dit-accel export` (the pipeline's id2label).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dit_accel.errors import UserError


def read_labels_file(path: str | os.PathLike) -> list[str]:
    """Class names from a classes.json ({"classes": [...]}), a JSON list, or a JSON {"index": "name"} map."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(
            f"cannot read --labels {path} ({error}): pass a classes.json or a JSON list of class names"
        ) from None
    if isinstance(data, dict) and "classes" in data:
        data = data["classes"]
    if isinstance(data, dict):
        try:
            return [str(data[key]) for key in sorted(data, key=int)]
        except ValueError:
            raise UserError(
                f'--labels {path} maps names that are not class indices: expected {{"0": "tench", ...}}'
            ) from None
    if isinstance(data, list):
        return [str(name) for name in data]
    raise UserError(f"--labels {path} is neither a list of class names nor a classes.json")


def run_class_names(source) -> list[str] | None:
    """The class names of the run a checkpoint belongs to: classes.json in the run folder, its latent cache
    or a pipeline folder; else the sorted class folders of its image folder. None when nothing is recorded."""
    checkpoint = Path(source.info["checkpoint"])
    candidates = [
        checkpoint,
        checkpoint.parent.parent,
        Path(source.train_config.get("output_dir") or checkpoint),
    ]
    if source.train_config.get("latents"):
        candidates.append(Path(source.train_config["latents"]))
    for folder in candidates:
        if (folder / "classes.json").is_file():
            return read_labels_file(folder / "classes.json")
    if (checkpoint / "model_index.json").is_file():
        id2label = json.loads((checkpoint / "model_index.json").read_text()).get("id2label")
        if id2label:
            return [id2label[key] for key in sorted(id2label, key=int)]
    data_path = source.train_config.get("data_path")
    if data_path and Path(data_path).is_dir():
        return sorted(
            entry.name
            for entry in Path(data_path).iterdir()
            if entry.is_dir() and not entry.name.startswith(".")
        )
    return None
