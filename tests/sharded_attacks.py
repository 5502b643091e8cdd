"""The crafted sharded saves of docs/training.md, "What a resume trusts": each turns a real
torch.distributed.checkpoint folder into one whose reading by torch would call `os.system` (or read outside
the folder), the way an attacker who sends a run folder would, index and all."""

import io
import os
import pickle
import shutil
from pathlib import Path

import torch


class SystemPayload:
    """`os.system` called while unpickling (pickled by reference as posix.system)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _index(folder: Path):
    from dit_accel.run.sharded import SafeUnpickler

    with (folder / ".metadata").open("rb") as handle:
        return SafeUnpickler(handle).load()  # even a test reads an index as the trainer does


def _write_index(folder: Path, metadata) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _append_payload(folder: Path, marker: Path):
    """A torch.save'd payload appended to the folder's first shard file; its storage record."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    shard = sorted(folder.glob("*.distcp"))[0]
    buffer = io.BytesIO()
    torch.save(SystemPayload(marker), buffer)
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(buffer.getvalue())
    return _StorageInfo(relative_path=shard.name, offset=offset, length=len(buffer.getvalue()))


def bytes_entry(folder: Path, marker: Path, fqn: str | None = None) -> str:
    """Point a bytes entry (the first, or `fqn`, re-declared as bytes when it is a tensor) at the payload."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = _index(folder)
    if fqn is None:
        fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _append_payload(folder, marker)
    _write_index(folder, metadata)
    return fqn


def first_tensor(folder: Path) -> str:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _index(folder)
    return next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))


def rank_local_index(folder: Path, marker: Path) -> str:
    """No `.metadata`; `__0.metadata` and `__1.metadata` that torch falls back to and reads with pickle.load."""
    (folder / ".metadata").unlink()
    for rank in (0, 1):
        (folder / f"__{rank}.metadata").write_bytes(pickle.dumps(SystemPayload(marker)))
    return "__0.metadata"


def missing_index(folder: Path, marker: Path) -> str:
    (folder / ".metadata").unlink()
    return ".metadata"


def storage_outside(folder: Path, marker: Path) -> str:
    """Every storage record of one shard file renamed to `../NAME`, a copy of it beside the folder."""
    metadata = _index(folder)
    shard = sorted(folder.glob("*.distcp"))[0]
    outside = folder.parent / f"{folder.name}-{shard.name}"
    shutil.copy(shard, outside)
    for record in metadata.storage_data.values():
        if record.relative_path == shard.name:
            record.relative_path = f"../{outside.name}"
    _write_index(folder, metadata)
    return "../"


def truncated_shard(folder: Path, marker: Path) -> str:
    """Not an attack but damage: a shard file cut in half (a copy that ran out of disk)."""
    shard = sorted(folder.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.name


def unknown_layout(folder: Path, marker: Path) -> str:
    """An index that asks an allowed function for a name it does not know (a KeyError inside torch)."""
    (folder / ".metadata").write_bytes(pickle.dumps(_UnknownLayout()))
    return ".metadata"


class _UnknownLayout:
    def __reduce__(self):
        return (torch.serialization._get_layout, ("torch.no_such_layout",))


ATTACKS = {
    "bytes entry": bytes_entry,
    "rank-local index": rank_local_index,
    "missing index": missing_index,
    "storage outside": storage_outside,
    "truncated shard": truncated_shard,
    "unknown layout": unknown_layout,
}
