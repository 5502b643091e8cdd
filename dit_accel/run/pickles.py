"""The pickles a checkpoint holds, read so that none can run code: run folders travel between people and
clusters, and `--resume`, `sample`, `export` and `--init-from` read folders their users did not write.

Accelerate's `load_state` reads optimizer.bin, scaler.pt and random_states_R.pkl with torch's weights-only
unpickler (plain containers, numbers, tensors and numpy arrays; anything else is refused), but it reads a
registered object's custom_checkpoint_N.pkl with `weights_only=False`, skips an RNG file that fails to load
without a word, and torch.distributed.checkpoint (the sharded saves) reads each folder's `.metadata` with
plain `pickle.load`. So:

- the lr scheduler is not registered with Accelerate: its state is `lr_scheduler.json`, and an older
  checkpoint's custom_checkpoint_0.pkl is read weights-only before Accelerate reads it (and the
  resume never takes a number from either: the lr is a function of the applied steps);
- before `load_state`, every rank reads its own RNG file (and the fp16 scaler's) weights-only and refuses
  one that does not load (`check_before_load`), so a resume is exact or does not happen;
- every sharded save is checked whole first (`run.sharded`): its one `.metadata` unpickled by a restricted
  unpickler, its storage confined to its folder, and every entry torch would unpickle with
  `weights_only=False` read weights-only there and held to plain data.

A refusal is one line naming the file and what it asked for; the SHA-256 manifest in COMPLETE does not
help here, since whoever builds a folder writes its manifest too.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

from dit_accel.errors import UserError

SCHEDULER_STATE = "lr_scheduler.json"  # the lr scheduler's state_dict, as JSON
LEGACY_SCHEDULER_STATE = "custom_checkpoint_0.pkl"  # what Accelerate wrote for it before
SCALER_STATE = "scaler.pt"  # Accelerate's name for the fp16 GradScaler's state
RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")  # what Accelerate restores from it

_FIX = "resume from a checkpoint this trainer wrote (--resume auto skips none; pass an older --resume PATH)"


def random_states_name(rank: int) -> str:
    return f"random_states_{rank}.pkl"


def refused(path: Path, what: str) -> UserError:
    return UserError(
        f"{path} {what}: refused, since a checkpoint's files never run code when read",
        "use a checkpoint this trainer wrote, or delete the file's folder if you do not know where it came from",
    )


def load_weights_only(path: Path):
    """torch.load of a pickle that may hold only containers, numbers, strings, tensors and numpy arrays
    (Accelerate's own weights-only loader, with numpy's RNG state allowed); one line otherwise."""
    from accelerate.utils.other import load

    try:
        return load(path, map_location="cpu")
    except pickle.UnpicklingError as error:
        asked = re.search(r"GLOBAL ([\w.]+)", str(error))
        raise refused(
            path, f"asks for {asked.group(1) if asked else 'a Python object'} (holds more than plain data)"
        ) from None
    except (EOFError, RuntimeError, OSError, ValueError) as error:
        raise refused(
            path, f"cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
        ) from None


def check_before_load(checkpoint: Path, rank: int) -> None:
    """What this rank's `accelerator.load_state` will read besides the weights and AdamW's state, checked
    first: its RNG states (Accelerate would skip a file that fails to load and resume inexactly), the fp16
    scaler's state where there is one (`run.sharded` checks the sharded saves)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "model.safetensors").is_file() and (checkpoint / "pytorch_model.bin").is_file():
        raise refused(checkpoint / "pytorch_model.bin", "stands where this trainer writes model.safetensors")
    states = load_weights_only(checkpoint / random_states_name(rank))
    missing = [key for key in RNG_KEYS if not isinstance(states, dict) or key not in states]
    if missing:
        raise UserError(
            f"{checkpoint / random_states_name(rank)} lacks the RNG states {', '.join(missing)}: the resume "
            "would not repeat the run's randomness",
            _FIX,
        )
    if (checkpoint / SCALER_STATE).is_file():
        load_weights_only(checkpoint / SCALER_STATE)
    legacy = not (checkpoint / SCHEDULER_STATE).is_file()  # an older checkpoint: its scheduler's pickle
    for path in sorted(checkpoint.glob("custom_checkpoint_*.pkl")):
        if not (legacy and path.name == LEGACY_SCHEDULER_STATE):  # Accelerate would unpickle it, or fail
            raise refused(
                path, "is not a file this trainer writes (Accelerate would read it as a registered object)"
            )


def scheduler_state_json(scheduler) -> str:
    """The scheduler's state_dict as JSON (LambdaLR with a `WarmupConstant`: numbers, lists and one small
    dict), exact: Python writes every float so that it reads back bit for bit."""
    return json.dumps(scheduler.state_dict(), sort_keys=True) + "\n"
