"""A checkpoint's records parsed once into checked values: a run folder may come from anyone, and a number
read from it (a step, a count) steers what the run does next. A record that is not JSON, not an object, or
holds a field of the wrong type or range is refused in one line naming the file and the field; a weights
file whose header does not describe its bytes (truncated, or a header length that lies) is refused before
a reader maps it."""

from __future__ import annotations

import json
from pathlib import Path

from dit_accel.errors import UserError

_FIX = "resume from a checkpoint this trainer wrote (--resume auto skips none; pass an older --resume PATH)"

# train_state.json: counts (>= 0) and sizes (>= 1); `step` must be there, the rest where a checkpoint has them
_COUNTS = (
    "step",
    "applied_steps",
    "skipped_steps",
    "epoch",
    "samples_into_epoch",
    "dataset_size",
    "samples_seen",
)
_SIZES = ("world_size", "global_batch", "micro_batch", "grad_accum")


def read_json_object(path: Path, fix: str = _FIX) -> dict:
    """A JSON object, or one line naming the file: not there, not JSON, or another kind of value."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: not a complete checkpoint of this trainer", fix) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not JSON ({str(error)[:120]})", fix) from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object", fix)
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a record may hold")


def is_count(value, least: int = 0) -> bool:
    """An int (not a bool) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def read_train_state(path: Path) -> dict:
    """train_state.json: every count an int in range, the applied and skipped steps within the steps."""
    state = read_json_object(path)
    if not is_count(state.get("step")):
        raise UserError(f"{path}: step is {state.get('step')!r}, not a whole number of at least 0", _FIX)
    for names, least in ((_COUNTS, 0), (_SIZES, 1)):
        for name in names:
            if state.get(name) is not None and not is_count(state[name], least):  # None: not known
                raise UserError(
                    f"{path}: {name} is {state[name]!r}, not a whole number of at least {least}", _FIX
                )
    for name in ("applied_steps", "skipped_steps"):
        if (state.get(name) or 0) > state["step"]:
            raise UserError(
                f"{path}: {name} {state[name]} is more than the steps taken ({state['step']})", _FIX
            )
    if state.get("seed") is not None and not is_count(state["seed"]):
        raise UserError(f"{path}: seed is {state['seed']!r}, not a whole number of at least 0", _FIX)
    if "data" in state and not isinstance(state["data"], (dict, type(None))):
        raise UserError(f"{path}: data is a {type(state['data']).__name__}, not an object", _FIX)
    return state


def check_safetensors(path: Path, fix: str = _FIX) -> None:
    """A safetensors file whose header parses and whose tensors fit the file: what `safe_open` reads (the
    header only), so a truncated or crafted file is one line, not a SafetensorError from deep in a load."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except (SafetensorError, OSError, ValueError) as error:
        raise UserError(
            f"{path} is not a readable safetensors file ({str(error).splitlines()[0][:120]})", fix
        ) from None


def check_torch_zip(path: Path, fix: str = _FIX) -> None:
    """A torch.save file (a zip archive) whose directory reads: a truncated one is one line here, before a
    loader reports an 'internal miniz error'. Its contents are read, weights-only, by the loader."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise UserError(f"{path} is not a complete torch file ({error})", fix) from None
