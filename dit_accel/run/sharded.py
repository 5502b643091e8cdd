"""A sharded save (FSDP2, torch.distributed.checkpoint) checked whole before torch reads any of it.

torch.distributed.checkpoint trusts its folder: it unpickles `.metadata` with plain `pickle.load`, falls back
to rank-local `__R.metadata` files when `.metadata` is missing, reads each storage record's `relative_path`
wherever it points, and loads every entry the index declares as bytes with `torch.load(weights_only=False)`.
The index, not the model, decides which entries are bytes. So before any `dcp.load` (resume, `--init-from`,
sample, export) `check_sharded_save` holds the folder to what this trainer writes:

- exactly one index, `.metadata`, unpickled by `SafeUnpickler` (its own dataclasses only);
- every storage record a plain file of the folder (no `/`, no link), its slice inside the file, no stream
  transform (this trainer writes none);
- every bytes entry read here weights-only and made of plain data (numbers, strings, containers); in a
  model's save there are none at all: a model's state is tensors.

torch then reads the same files (a folder changed between the check and the read is a machine already lost,
not a received file). A refusal is one line naming the file and what it held.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path

from dit_accel.run.pickles import refused

INDEX = ".metadata"  # torch.distributed.checkpoint's index of a sharded save
_PLAIN = (bool, int, float, str, bytes, type(None))
MODEL_SAVE_PREFIX = "pytorch_model_fsdp"  # Accelerate's folder of a model's sharded weights


def _allowed(module: str, name: str) -> bool:
    """The classes a sharded save's index is made of: torch.distributed.checkpoint's metadata dataclasses
    and enums, the filesystem writer's storage records, torch's sizes, dtypes and layouts, and paths."""
    import dataclasses
    import enum

    import torch

    if module == "torch.distributed.checkpoint.metadata":
        import torch.distributed.checkpoint.metadata as metadata

        found = getattr(metadata, name, None)
        return isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds only `_allowed` classes (Python's documented way to restrict globals): a
    pickle asking for anything else, `os.system` above all, is refused before it is called."""

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def _is_plain(value, depth: int = 0) -> bool:
    """Numbers, strings and containers of them (what an optimizer's param groups hold), a few levels deep."""
    if isinstance(value, _PLAIN):
        return True
    if depth > 8:
        return False
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, (str, int)) and _is_plain(item, depth + 1) for key, item in value.items())
    return False


def _read_index(path: Path):
    try:
        with path.open("rb") as handle:
            metadata = SafeUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise refused(path, f"asks for {error} (a sharded save's index holds plain records only)") from None
    except (EOFError, OSError, ValueError, TypeError, AttributeError, KeyError, IndexError) as error:
        raise refused(path, f"cannot be read ({type(error).__name__}: {error})") from None
    if type(metadata).__name__ != "Metadata":
        raise refused(path, f"holds a {type(metadata).__name__}, not a sharded save's index")
    return metadata


def _files(folder: Path) -> dict[str, int]:
    """The folder's plain files and their sizes; refused where it holds a link or a second index."""
    if folder.is_symlink() or not folder.is_dir():
        raise refused(folder, "is not a folder of this checkpoint (a link, or missing)")
    sizes = {}
    for entry in os.scandir(folder):
        found = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(found.st_mode):
            raise refused(folder / entry.name, "is not a plain file (a sharded save holds files only)")
        if entry.name.endswith(INDEX) and entry.name != INDEX:
            raise refused(
                folder / entry.name,
                f"is a second index beside {INDEX} (torch would read it with plain pickle.load)",
            )
        sizes[entry.name] = found.st_size
    if INDEX not in sizes:
        raise refused(folder / INDEX, "is missing: a sharded save without its index")
    return sizes


def check_sharded_save(folder: str | Path, tensors_only: bool = False):
    """The index of the sharded save in `folder`, after every check above; `tensors_only` for a model's save.
    Returns torch's `Metadata`."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    folder = Path(folder)
    sizes, index = _files(folder), folder / INDEX
    metadata = _read_index(index)
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise refused(index, "lacks its entries or its storage records")
    for key, record in storage.items():
        name = getattr(record, "relative_path", None)
        offset, length = getattr(record, "offset", None), getattr(record, "length", None)
        if (
            not isinstance(key, MetadataIndex)
            or not isinstance(name, str)
            or name not in sizes
            or "/" in name
        ):
            raise refused(index, f"names storage {name!r}, which is not a file of {folder}")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise refused(index, f"gives {name} a slice of offset {offset!r} and length {length!r}")
        if offset + length > sizes[name]:
            raise refused(
                index, f"reads bytes {offset}-{offset + length} of {name}, which holds {sizes[name]}"
            )
        if getattr(record, "transform_descriptors", None):
            raise refused(
                index, f"asks torch to transform {name} while reading it ({record.transform_descriptors})"
            )
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            continue
        if not isinstance(entry, BytesStorageMetadata):
            raise refused(index, f"declares {fqn!r} as a {type(entry).__name__}")
        if tensors_only:
            raise refused(
                index, f"declares the weight {fqn!r} as pickled bytes (a model's save holds tensors)"
            )
        record = storage.get(MetadataIndex(fqn))
        if record is None:
            raise refused(index, f"declares {fqn!r} but stores it nowhere")
        with (folder / record.relative_path).open("rb") as handle:
            handle.seek(record.offset)
            data = handle.read(record.length)
        try:
            value = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as error:  # torch raises UnpicklingError, RuntimeError or worse for crafted bytes
            raise refused(
                folder / record.relative_path,
                f"holds {fqn!r} as more than plain data ({type(error).__name__}: {str(error).splitlines()[0][:100]})",
            ) from None
        if not _is_plain(value):
            raise refused(
                folder / record.relative_path, f"holds {fqn!r} as a {type(value).__name__}, not plain data"
            )
    return metadata


def check_sharded_saves(checkpoint: str | Path) -> None:
    """Every sharded save in a checkpoint, before `accelerator.load_state` hands them to torch: each
    sub-folder is one (the model's, tensors only, and AdamW's); a plain checkpoint has none."""
    for folder in sorted(path for path in Path(checkpoint).iterdir() if path.is_dir()):
        check_sharded_save(folder, tensors_only=folder.name.startswith(MODEL_SAVE_PREFIX))
