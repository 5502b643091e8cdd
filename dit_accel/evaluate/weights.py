"""Where the TF-ported Inception-v3 weights are, without importing torch: the trainer refuses a missing file
while it checks its flags, before any process group, run folder or model exists.

The default place is the torch hub cache as torch.hub computes it ($TORCH_HOME/hub, else
$XDG_CACHE_HOME/torch/hub, else ~/.cache/torch/hub), folder checkpoints/, under either published name.
"""

from __future__ import annotations

import os
from pathlib import Path

from dit_accel.errors import UserError

WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
# torch-fidelity's name first; pytorch-fid publishes the same conversion under the second one
WEIGHTS_NAMES = ("weights-inception-2015-12-05-6726825d.pth", "pt_inception-2015-12-05-6726825d.pth")


def hub_checkpoints_dir() -> Path:
    """torch.hub.get_dir() / "checkpoints" for a process that never called torch.hub.set_dir."""
    cache = os.getenv("XDG_CACHE_HOME", os.path.join("~", ".cache"))
    torch_home = os.path.expanduser(os.getenv("TORCH_HOME", os.path.join(cache, "torch")))
    return Path(torch_home) / "hub" / "checkpoints"


def default_weights_path() -> Path:
    """The first of the two published names that is in the cache, else the first."""
    folder = hub_checkpoints_dir()
    for name in WEIGHTS_NAMES:
        if (folder / name).is_file():
            return folder / name
    return folder / WEIGHTS_NAMES[0]


REFERENCE_FETCH = (
    "fetch the ADM reference batch once (e.g. VIRTUAL_imagenet256_labeled.npz from openai/guided-diffusion's "
    'evaluations; docs/evaluation.md, "What you need once")'
)


def check_evaluation_files(
    reference: str | os.PathLike | None, weights: str | os.PathLike | None, flag: str
) -> Path:
    """The reference batch (`flag` names its option) and the Inception weights, both looked for before
    either is read, so that everything missing is named in one line, not one round trip each. Returns the
    weights' path."""
    problems, fixes = [], []
    if reference is not None and not Path(reference).is_file():
        problems.append(f"{flag} {reference} does not exist")
        fixes.append(REFERENCE_FETCH)
    try:
        path = weights_file(weights)
    except UserError as missing:
        problems.append(missing.problem)
        fixes.append(missing.fix)
        path = None
    if problems:
        raise UserError(" and ".join(problems), "; ".join(fixes))
    return path


def weights_file(weights: str | os.PathLike | None) -> Path:
    """`weights` (--inception-weights), else the cache's file; a missing one is a one-line error saying how to
    fetch it (nothing is downloaded)."""
    path = Path(weights) if weights else default_weights_path()
    if not path.is_file():
        raise UserError(
            f"the Inception-v3 weights are not at {path}",
            f"fetch them once: curl -L --create-dirs -o {path} {WEIGHTS_URL} (or pass --inception-weights FILE)",
        )
    return path
