"""A run folder from elsewhere runs no code when read (docs/training.md, "What a resume trusts").

Each attack is the real one: a copy of a real run's checkpoint, one of its pickles replaced by a pickle
whose `__reduce__` calls `os.system` to touch a marker file, and COMPLETE's manifest rewritten to vouch for
it (whoever builds a folder writes its manifest too). The resume is refused in one line naming the file,
and the marker never appears. The sharded saves' `.metadata` attack is in tests/test_train_fsdp.py.
"""

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import test_train_e2e as e2e
import torch

from dit_accel.errors import UserError
from dit_accel.run import lineage
from dit_accel.run import pickles as run_pickles

workspace = e2e.workspace


class SystemPayload:
    """The attack: `os.system` called while unpickling (pickled by reference as posix.system)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _single(workspace, run: Path, *args) -> list:
    return ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", run, *e2e.QUIET]


def _revouch(checkpoint: Path) -> None:
    """Rewrite COMPLETE's manifest for the files as they now are, as an attacker would."""
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["manifest"] = {
        name: entry for name, entry in lineage.build_manifest(checkpoint).items() if name != "COMPLETE"
    }
    (checkpoint / "COMPLETE").write_text(json.dumps(marker, sort_keys=True) + "\n")
    assert lineage.damage(checkpoint) is None


@pytest.fixture(scope="module")
def trained(workspace, tmp_path_factory):
    """A real one-process run: two steps, a checkpoint after each."""
    run = tmp_path_factory.mktemp("trusted") / "run"
    argv = [*_single(workspace, run), "--no-tensorboard", "--max-steps", 2, "--checkpoint-every", 1]
    assert e2e.run_in_process(argv) == 0
    return run


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run, run / "checkpoints" / "step_00000002"


def _plant(path: Path, payload) -> None:
    torch.save(payload, path)  # torch's own zip format, as Accelerate writes these files


def _resume(workspace, run: Path, capsys) -> str:
    argv = [*_single(workspace, run), "--no-tensorboard", "--resume", "auto", "--max-steps", 3]
    return e2e._one_line_error(capsys, argv)


def test_the_scheduler_is_json_and_a_resume_is_still_exact(trained):
    checkpoint = trained / "checkpoints" / "step_00000002"
    state = json.loads((checkpoint / run_pickles.SCHEDULER_STATE).read_text())
    assert state["last_epoch"] == 2 and state["lr_lambdas"] == [{"warmup_steps": 0}]
    assert not (checkpoint / run_pickles.LEGACY_SCHEDULER_STATE).exists()


@pytest.mark.launched
def test_the_reported_attack_a_crafted_scheduler_pickle_runs_nothing(workspace, trained, tmp_path):
    """The issue's repro, as a user types it: a checkpoint of the layout Accelerate wrote before (the
    scheduler in custom_checkpoint_0.pkl), the pickle replaced by one that runs `touch` and returns the real
    state, the manifest rewritten; `python -m dit_accel.train --resume auto` once ran it and trained on."""
    run, checkpoint = _copy(trained, tmp_path)
    marker = tmp_path / "PWNED"
    real = json.loads((checkpoint / run_pickles.SCHEDULER_STATE).read_text())
    (checkpoint / run_pickles.SCHEDULER_STATE).unlink()
    # the real state, and beside it the call: loaded with weights_only=False, the run trained on
    _plant(checkpoint / run_pickles.LEGACY_SCHEDULER_STATE, dict(real, attack=SystemPayload(marker)))
    _revouch(checkpoint)
    argv = [str(a) for a in _single(workspace, run)] + [
        "--no-tensorboard",
        "--resume",
        "auto",
        "--max-steps",
        "3",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "dit_accel.train", *argv],
        env=e2e._env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not marker.exists()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{checkpoint / run_pickles.LEGACY_SCHEDULER_STATE} asks for posix.system" in lines[0], lines[0]
    assert not (checkpoint.parent / "step_00000003").exists()


@pytest.mark.parametrize(
    "name",
    ["optimizer.bin", "random_states_0.pkl", "scaler.pt", run_pickles.LEGACY_SCHEDULER_STATE],
)
def test_no_pickle_a_resume_reads_runs_its_payload(workspace, trained, tmp_path, capsys, name):
    run, checkpoint = _copy(trained, tmp_path)
    marker = tmp_path / "PWNED"
    if name == run_pickles.LEGACY_SCHEDULER_STATE:
        (checkpoint / run_pickles.SCHEDULER_STATE).unlink()
    if name == "optimizer.bin":  # the real AdamW state, with the payload beside it
        payload = dict(torch.load(checkpoint / name, weights_only=True), extra=SystemPayload(marker))
    else:
        payload = SystemPayload(marker)
    _plant(checkpoint / name, payload)
    _revouch(checkpoint)
    err = _resume(workspace, run, capsys)
    assert not marker.exists()
    assert f"{checkpoint / name} asks for posix.system" in err and "refused" in err, err


def test_an_rng_file_that_does_not_load_is_refused_not_skipped(workspace, trained, tmp_path, capsys):
    """Accelerate skips a random_states file it cannot load with an info line, and the resume goes on with
    other randomness than the run had; here it stops with one line."""
    run, checkpoint = _copy(trained, tmp_path)
    path = checkpoint / "random_states_0.pkl"
    path.write_bytes(path.read_bytes()[:100])
    _revouch(checkpoint)
    err = _resume(workspace, run, capsys)
    assert f"{path} cannot be read" in err, err
    torch.save({"random_state": None}, path)  # loads, but is not what Accelerate restores
    _revouch(checkpoint)
    err = _resume(workspace, run, capsys)
    assert f"{path} lacks the RNG states numpy_random_seed, torch_manual_seed" in err, err


def test_an_older_checkpoint_with_its_scheduler_pickle_resumes_exactly(workspace, trained, tmp_path):
    """A checkpoint written before lr_scheduler.json (Accelerate's custom_checkpoint_0.pkl, plain numbers)
    reads weights-only and resumes to the same weights as the JSON one."""
    run, checkpoint = _copy(trained, tmp_path)
    state = json.loads((checkpoint / run_pickles.SCHEDULER_STATE).read_text())
    (checkpoint / run_pickles.SCHEDULER_STATE).unlink()
    torch.save(state, checkpoint / run_pickles.LEGACY_SCHEDULER_STATE)
    _revouch(checkpoint)
    assert run_pickles.load_scheduler_state(checkpoint) == state
    other, _ = _copy(trained, tmp_path / "json")
    for folder in (run, other):
        argv = [*_single(workspace, folder), "--no-tensorboard", "--resume", "auto", "--max-steps", 3]
        assert e2e.run_in_process(argv) == 0
    from safetensors.torch import load_file

    a, b = (load_file(str(f / "checkpoints" / "step_00000003" / "model.safetensors")) for f in (run, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_safe_unpickler_builds_a_real_index_and_refuses_any_other_global(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, "lr": 1e-4}
    dcp.save(state, checkpoint_id=str(tmp_path / "save"), no_dist=True)
    metadata = run_pickles.check_dcp_metadata(tmp_path / "save")
    assert set(metadata.state_dict_metadata) == {"model.w", "model.b", "lr"}
    marker = tmp_path / "PWNED"
    (tmp_path / "save" / ".metadata").write_bytes(pickle.dumps(SystemPayload(marker)))
    with pytest.raises(UserError, match=r"\.metadata asks for posix\.system .*refused"):
        run_pickles.check_dcp_metadata(tmp_path / "save")
    assert not marker.exists()


def test_checkpoint_files_take_the_umask_like_every_other_file(trained, tmp_path):
    """safetensors' save_file creates its file 0600; a teammate in the run folder's group could not read the
    weights. Every file of a checkpoint now has a plain open()'s mode."""
    checkpoint = trained / "checkpoints" / "step_00000002"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in checkpoint.iterdir() if p.is_file()}
    umask = os.umask(0)
    os.umask(umask)
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_a_diffusers_folders_legacy_bin_is_read_weights_only(tmp_path):
    """`--init-from`, sample and export read a diffusers folder; its diffusion_pytorch_model.bin, where there is
    no safetensors file, is torch.load-ed weights-only and a payload is one line."""
    from dit_accel.models.diffusers_format import WEIGHTS_NAME, load_model, save_model
    from dit_accel.models.dit import build_model
    from planner.spec import DiTSpec

    spec = DiTSpec(name="DiT-S/2", depth=1, hidden=32, heads=2, patch=2, resolution=32, latents="pixel")
    folder = save_model(build_model(spec), tmp_path / "model")
    state = {key: tensor.clone() for key, tensor in load_model(folder).state_dict().items()}
    (folder / WEIGHTS_NAME).unlink()
    torch.save(state, folder / "diffusion_pytorch_model.bin")
    assert load_model(folder).state_dict().keys() == state.keys()  # plain tensors: read as before
    marker = tmp_path / "PWNED"
    torch.save(dict(state, attack=SystemPayload(marker)), folder / "diffusion_pytorch_model.bin")
    with pytest.raises(UserError, match="cannot be read as plain tensors .*refused"):
        load_model(folder)
    assert not marker.exists()
