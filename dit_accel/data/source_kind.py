"""What `--data-path` names: an image folder, or which kind of Hugging Face dataset (dit_accel.data.hf_source
reads them). Apart from the readers so that a flag's check can ask without importing torch or datasets."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

PARQUET, TAR = ".parquet", ".tar"


@dataclass
class DatasetOptions:
    """Which part of a dataset holds the training data (`--split`, `--image-column`, `--label-column`)."""

    split: str | None = None
    image_column: str = "image"
    label_column: str = "label"


def dataset_kind(path: str | os.PathLike) -> str | None:
    """'saved', 'parquet', 'webdataset' or 'hub' for a dataset; None for anything else (an image folder, or a
    path the folder checks then explain). Cheap: it looks at the top of a folder and its data/ only."""
    text = os.path.expanduser(str(path))
    if glob.has_magic(text):
        return _kind_of_files(glob.glob(text, recursive=True))
    location = Path(text)
    if location.is_file():
        return _kind_of_files([text])
    if location.is_dir():
        if (location / "dataset_dict.json").is_file() or (location / "state.json").is_file():
            return "saved"
        return _kind_of_files([*map(str, location.glob("*")), *map(str, location.glob("data/*"))])
    if _looks_like_hub_name(text):
        return "hub"
    return None


def _kind_of_files(files: list[str]) -> str | None:
    if any(name.endswith(PARQUET) for name in files):
        return "parquet"
    if any(name.endswith(TAR) for name in files):
        return "webdataset"
    return None


def _looks_like_hub_name(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and ":" not in text
