"""A checkpoint's COMPLETE marker: where it sits on the run's timeline, and what its files must be.

Lineage. A run resumed from an older checkpoint starts a new timeline; the checkpoints of the old one beyond
the resume point are an abandoned branch. Step numbers cannot tell the two apart, so every marker records an
`id`, its `parent` (the previous checkpoint of the same timeline: the one written before it by the same run,
or the one the run resumed from) and a `sequence` number one above every marker already in the folder. The
current timeline is the chain from the most recently written complete checkpoint (highest sequence) back
through parents; rotation and `--resume auto` follow it and leave other branches alone.

Manifest. The marker lists the size and sha256 of every file of the checkpoint (sharded folders included),
hashed by the main process after every rank has written. A truncated or bit-flipped file, a missing rank's
RNG file or an edited train_state.json is then found before anything is loaded, and named.

Old markers (before lineage and manifests) hold only step and world size: their checkpoints still load,
unverified, and count as one timeline ordered by step, older than any new marker. Only such a marker may
skip the manifest: one that does not parse (garbage, truncated, empty) or lacks its lineage or manifest is
damage (`marker_problem`), named like a damaged file, and its checkpoint is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

MARKER = "COMPLETE"
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Node:
    """One complete checkpoint as the lineage sees it."""

    step: int
    path: Path
    id: str  # the marker's id; an old marker's folder name
    parent: str | None  # None: the run's first checkpoint from scratch or --init-from
    sequence: int  # -1 for old markers, -2 for damaged ones
    legacy: bool
    damaged: str | None = None  # what is wrong with its marker (`marker_problem`)


_NEW_KEYS = ("id", "parent", "sequence", "manifest")


def _load_marker(folder: Path) -> tuple[dict, str | None]:
    """The marker and None, or {} and what makes it unusable."""
    path = folder / MARKER
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        return {}, f"{path} cannot be read ({type(error).__name__}): the checkpoint's marker is damaged"
    if not text.strip():
        return {}, f"{path} is empty (truncated): the checkpoint's marker is damaged"
    try:
        marker = json.loads(text)
    except ValueError:
        return {}, f"{path} is not JSON (overwritten or truncated): the checkpoint's marker is damaged"
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        return {}, f"{path} names no step: the checkpoint's marker is damaged"
    if not any(key in marker for key in _NEW_KEYS):
        return marker, None  # an old-style marker: step and world size only
    manifest = marker.get("manifest")
    if not (
        isinstance(marker.get("id"), str)
        and isinstance(marker.get("sequence"), int)
        and isinstance(manifest, dict)
        and all(
            isinstance(entry, dict) and {"bytes", "sha256"} <= entry.keys() for entry in manifest.values()
        )
    ):
        return {}, f"{path} lacks its id, sequence or manifest (edited?): the checkpoint's marker is damaged"
    return marker, None


def read_marker(folder: Path) -> dict:
    """The checkpoint's marker; {} for a damaged one (see `marker_problem`)."""
    return _load_marker(folder)[0]


def marker_problem(folder: Path) -> str | None:
    """What makes a checkpoint's marker unusable, naming the file; None for a sound (or old-style) one."""
    return _load_marker(folder)[1]


def new_marker(step: int, world_size: int, parent: str | None, sequence: int, manifest: dict) -> dict:
    return {
        "step": step,
        "world_size": world_size,
        "id": uuid.uuid4().hex,
        "parent": parent,
        "sequence": sequence,
        "manifest": manifest,
    }


def nodes(found: list[tuple[int, Path]]) -> list[Node]:
    """The lineage's view of complete checkpoints given as (step, folder), oldest step first."""
    result, previous_legacy = [], None
    for step, path in found:
        marker, problem = _load_marker(path)
        if problem:  # no place on any timeline: never the head while a sound checkpoint exists
            result.append(Node(step, path, path.name, None, -2, False, problem))
        elif "id" in marker:
            result.append(
                Node(step, path, marker["id"], marker.get("parent"), int(marker["sequence"]), False)
            )
        else:  # old marker: its parent is taken to be the old checkpoint just before it
            result.append(Node(step, path, path.name, previous_legacy, -1, True))
            previous_legacy = path.name
    return result


def head(all_nodes: list[Node]) -> Node | None:
    """The most recently written checkpoint: the tip of the current timeline."""
    return max(all_nodes, key=lambda node: (node.sequence, node.step), default=None)


def chain(all_nodes: list[Node], tip: Node | None) -> list[Node]:
    """`tip` and its ancestors that still exist, newest first."""
    by_id = {node.id: node for node in all_nodes}
    line, seen = [], set()
    while tip is not None and tip.id not in seen:
        line.append(tip)
        seen.add(tip.id)
        tip = by_id.get(tip.parent) if tip.parent else None
    return line


def next_sequence(all_nodes: list[Node]) -> int:
    return max((node.sequence for node in all_nodes), default=-1) + 1


def hash_file(path: Path, sync: bool = False) -> dict:
    """Size and sha256 of one file; with `sync`, also fsynced (when writing a checkpoint)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(handle.fileno())  # the data is durable before the marker that vouches for it
    return {"bytes": size, "sha256": digest.hexdigest()}


def hash_files(paths: list[Path], sync: bool = False) -> list[dict]:
    """`hash_file` of each path, in parallel threads (hashlib releases the GIL): a DiT-XL/2 checkpoint is
    about 11 GB, written and verified on the main process while the other ranks wait."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda path: hash_file(path, sync=sync), paths))


def build_manifest(folder: Path) -> dict:
    """{relative path: {bytes, sha256}} of every file under `folder`, each fsynced on the way."""
    paths = sorted(Path(root) / name for root, _dirs, files in os.walk(folder) for name in files)
    hashed = hash_files(paths, sync=True)
    return {path.relative_to(folder).as_posix(): entry for path, entry in zip(paths, hashed)}


def damage(folder: Path, names: list[str] | None = None) -> str | None:
    """What is wrong with a checkpoint's marker or its files against its manifest (naming the file), or None
    when intact. An old-style marker (written before manifests existed) is taken as intact. `names`: check
    only these files and folders (what a reader of the weights reads), not the whole checkpoint."""
    marker, problem = _load_marker(folder)
    if problem:
        return problem
    manifest = marker.get("manifest")
    if manifest is None:
        return None
    problem = _manifest_problem(folder, manifest)
    if problem:
        return problem
    if names is not None:
        manifest = {
            name: entry
            for name, entry in manifest.items()
            if any(name == wanted or name.startswith(wanted + "/") for wanted in names)
        }
    for name, expected in sorted(manifest.items()):  # the cheap checks first: presence and size
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return (
                f"{path} has {size:,} bytes, its manifest says {expected['bytes']:,} (truncated or replaced)"
            )
    names = sorted(manifest)
    for name, found in zip(names, hash_files([folder / name for name in names])):
        if found["sha256"] != manifest[name]["sha256"]:
            return f"{folder / name} does not match its sha256 in {folder / MARKER} (corrupted or edited)"
    return None


def _manifest_problem(folder: Path, manifest: dict) -> str | None:
    """A manifest entry that would steer the check outside the checkpoint, or whose size is not a count."""
    where, inside = folder / MARKER, folder.resolve()
    for name, entry in manifest.items():
        path = Path(name)
        if (
            not name
            or path.is_absolute()
            or ".." in path.parts
            or not (folder / path).resolve().is_relative_to(inside)
        ):
            return f"{where} names {name!r}, which is not a file inside the checkpoint (edited)"
        if type(entry["bytes"]) is not int or not isinstance(entry["sha256"], str):
            return f"{where} gives {name!r} no size and sha256 (edited or damaged)"
    return None


def size_bytes(folder: Path) -> int:
    """A checkpoint's size: from its manifest, else by walking it."""
    manifest = read_marker(folder).get("manifest")
    if manifest is not None:
        return sum(entry["bytes"] for entry in manifest.values())
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
