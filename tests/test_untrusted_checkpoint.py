"""A run folder from elsewhere runs no code when read (docs/training.md, "What a resume trusts").

Each attack is the real one: a copy of a real run's checkpoint, one of its pickles replaced by a pickle
whose `__reduce__` calls `os.system` to touch a marker file, and COMPLETE's manifest rewritten to vouch for
it (whoever builds a folder writes its manifest too). The resume is refused in one line naming the file,
and the marker never appears. The sharded saves' attacks are in tests/test_sharded_trust.py and tests/test_train_fsdp.py.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import test_train_e2e as e2e
import torch
from sharded_attacks import SystemPayload

from dit_accel.errors import UserError
from dit_accel.run import lineage
from dit_accel.run import pickles as run_pickles

workspace = e2e.workspace


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
    assert run_pickles.load_weights_only(checkpoint / run_pickles.LEGACY_SCHEDULER_STATE) == state
    other, _ = _copy(trained, tmp_path / "json")
    for folder in (run, other):
        argv = [*_single(workspace, folder), "--no-tensorboard", "--resume", "auto", "--max-steps", 3]
        assert e2e.run_in_process(argv) == 0
    from safetensors.torch import load_file

    a, b = (load_file(str(f / "checkpoints" / "step_00000003" / "model.safetensors")) for f in (run, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


# --- numbers a resume reads: checked, or overruled by what the launch knows ----------------------------------


def _resumed_weights(workspace, run: Path, capsys) -> tuple[dict, str]:
    from safetensors.torch import load_file

    capsys.readouterr()
    argv = [*_single(workspace, run), "--no-tensorboard", "--resume", "auto", "--max-steps", 3]
    assert e2e.run_in_process(argv) == 0
    said = capsys.readouterr()
    return load_file(str(run / "checkpoints" / "step_00000003" / "model.safetensors")), said.out + said.err


def _crafted_numbers(checkpoint: Path, what: str) -> None:
    if what in ("lr 0.5", "lr NaN"):  # the scheduler's record: written for people, read by no resume
        path = checkpoint / run_pickles.SCHEDULER_STATE
        scheduler = json.loads(path.read_text())
        scheduler["base_lrs"] = [0.5 if what == "lr 0.5" else float("nan")]
        path.write_text(json.dumps(scheduler))
    else:  # AdamW's param groups, as Accelerate stores them (read back weights-only)
        state = torch.load(checkpoint / "optimizer.bin", weights_only=True)
        state["param_groups"][0].update(lr=0.5, initial_lr=0.5, eps=0.0, maximize=True)
        torch.save(state, checkpoint / "optimizer.bin")
    _revouch(checkpoint)


def test_no_number_in_a_checkpoint_steers_the_lr_or_adamw(workspace, trained, tmp_path, capsys):
    """The audit's finding: lr_scheduler.json's base_lrs 0.5 trained at 0.5 without a word, NaN wrote NaN
    weights. The lr is now the launch's at the applied step (train_state.json), AdamW's settings the launch's:
    each crafted copy resumes to the very weights of an untouched copy, and a crafted optimizer is named."""
    plain, _ = _copy(trained, tmp_path / "plain")
    reference, said = _resumed_weights(workspace, plain, capsys)
    assert "changed on resume" not in said and "AdamW's" not in said
    for what in ("lr 0.5", "lr NaN", "optimizer groups"):
        run, checkpoint = _copy(trained, tmp_path / what.replace(" ", "-"))
        _crafted_numbers(checkpoint, what)
        weights, said = _resumed_weights(workspace, run, capsys)
        assert all(torch.equal(weights[k], reference[k]) for k in reference), what
        if what == "optimizer groups":
            assert "--lr changed on resume: 0.5 -> 0.003, applied from step 3" in said, said
            assert "AdamW's eps in" in said and "is 0, this trainer's 1e-08" in said, said
            assert "AdamW's maximize in" in said, said


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("step", "10", "step is '10', not a whole number of at least 0"),
        ("step", -5, "step is -5, not a whole number of at least 0"),
        ("step", True, "step is True, not a whole number"),
        ("applied_steps", 9, "applied_steps 9 is more than the steps taken (2)"),
        ("world_size", 0, "world_size is 0, not a whole number of at least 1"),
        ("samples_seen", 1e30, "samples_seen is 1e+30, not a whole number"),
        ("step", 10, "says step 10, its COMPLETE marker step 2"),
        (None, [1, 2], "holds a JSON list, not an object"),
        (None, "{not json", "is not JSON"),
        (None, "NaN", "is not JSON"),
    ],
)
def test_a_crafted_train_state_is_one_line_before_anything_loads(
    workspace, trained, tmp_path, capsys, field, value, says
):
    run, checkpoint = _copy(trained, tmp_path)
    path = checkpoint / "train_state.json"
    if field is None:
        path.write_text(value if isinstance(value, str) else json.dumps(value))
    else:
        path.write_text(json.dumps(dict(json.loads(path.read_text()), **{field: value})))
    _revouch(checkpoint)
    err = _resume(workspace, run, capsys)
    assert f"{path}" in err and says in err, err
    assert not (run / "checkpoints" / "step_00000003").exists()


@pytest.mark.parametrize(
    "entry, says",
    [
        ({"../../../../etc/hostname": {"bytes": 1, "sha256": "0" * 64}}, "which is not a file inside"),
        ({"/etc/hostname": {"bytes": 1, "sha256": "0" * 64}}, "which is not a file inside"),
        ({"model.safetensors": "big"}, "lacks its id, sequence or manifest"),
        ({"model.safetensors": {"bytes": "12", "sha256": "0"}}, "no size and sha256"),
        ([], "lacks its id, sequence or manifest"),
    ],
)
def test_a_manifest_cannot_point_the_check_outside_the_checkpoint(trained, tmp_path, entry, says):
    """COMPLETE's manifest once named ../../etc/hostname and the check hashed that file; a list or a string
    for an entry was a traceback. Each is damage now, named in one line, and --resume auto passes over it."""
    _, checkpoint = _copy(trained, tmp_path)
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["manifest"] = entry if isinstance(entry, list) else dict(marker["manifest"], **entry)
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    found = lineage.damage(checkpoint)
    assert found is not None and says in found and len(found.splitlines()) == 1, found


def test_a_manifest_entry_linked_out_of_the_checkpoint_is_refused(trained, tmp_path):
    _, checkpoint = _copy(trained, tmp_path)
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", checkpoint / "extra")
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    marker["manifest"]["extra"] = {"bytes": 1, "sha256": "0" * 64}
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    assert "names 'extra', which is not a file inside the checkpoint" in lineage.damage(checkpoint)


# --- the catalogue: every file of a plain checkpoint, mutated; each read is a correct run or one line ---------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def _header_lies(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")  # safetensors' header length
    path.write_bytes(bytes(data))


def _json_edit(**fields):
    def edit(path: Path) -> None:
        path.write_text(json.dumps(dict(json.loads(path.read_text()), **fields)))

    return edit


MUTATIONS = {
    "truncated": _truncate,
    "a JSON list": lambda path: path.write_text("[]"),
    "not JSON": lambda path: path.write_text('{"step": '),
    "NaN": lambda path: path.write_text('{"step": NaN}'),
    "safetensors header lies": _header_lies,
    "a string shift": _json_edit(timestep_freq_shift="1"),
    "a negative step": _json_edit(step=-1),
}
CATALOGUE = [
    ("model.safetensors", "truncated"),
    ("model.safetensors", "safetensors header lies"),
    ("ema.safetensors", "truncated"),
    ("ema.safetensors", "safetensors header lies"),
    ("optimizer.bin", "truncated"),
    ("random_states_0.pkl", "truncated"),
    *(
        (name, how)
        for name in ("train_state.json", "train_config.json", "dit_accel.json", "plan.json")
        for how in ("truncated", "a JSON list", "not JSON", "NaN")
    ),
    ("dit_accel.json", "a string shift"),
    ("train_state.json", "a negative step"),
    ("train_config.json", "a negative step"),
]


@pytest.mark.parametrize("name, how", CATALOGUE, ids=[f"{n}-{h}" for n, h in CATALOGUE])
def test_every_file_of_a_checkpoint_mutated_is_one_line_or_a_correct_run(
    workspace, trained, tmp_path, capsys, name, how
):
    """A received checkpoint with one file mutated and its manifest rewritten: `--resume auto` and `sample
    --no-ema` (and with the EMA, for the EMA's file) each exit 2 with one line and no traceback, writing no
    new checkpoint, or run correctly. Before, several ended in tracebacks (a JSON list read as an object, a
    safetensors header claiming 2^62 bytes)."""
    from dit_accel.cli import main as dit_accel

    run, checkpoint = _copy(trained, tmp_path)
    MUTATIONS[how](checkpoint / name)
    _revouch(checkpoint)
    capsys.readouterr()
    argv = [*_single(workspace, run), "--no-tensorboard", "--resume", "auto", "--max-steps", 3]
    rc = e2e.run_in_process(argv)
    err = capsys.readouterr().err.strip()
    assert rc in (0, 2) and "Traceback" not in err, err[-3000:]
    if rc == 2:
        assert len(err.splitlines()) == 1, err
        assert not (run / "checkpoints" / "step_00000003").exists()
    for ema in ("--no-ema", "--ema") if name == "ema.safetensors" else ("--no-ema",):
        out = tmp_path / f"grid{ema}.png"
        rc = dit_accel(
            [
                "sample",
                "--checkpoint",
                str(checkpoint),
                ema,
                "--out",
                str(out),
                "--num-samples",
                "2",
                "--steps",
                "2",
                "--vae",
                str(workspace["vae"]),
            ]
        )
        err = capsys.readouterr().err.strip()
        assert rc in (0, 2) and "Traceback" not in err, err[-3000:]
        if rc == 2:
            assert len(err.splitlines()) == 1 and not out.exists(), err


@pytest.mark.parametrize("name", ["custom_checkpoint_1.pkl", "custom_checkpoint_0.pkl"])
def test_a_custom_object_pickle_this_trainer_never_writes_is_refused(
    workspace, trained, tmp_path, capsys, name
):
    """Accelerate reads custom_checkpoint_N.pkl with weights_only=False, or fails on their count with a
    RuntimeError; beside lr_scheduler.json even _0 is not ours."""
    run, checkpoint = _copy(trained, tmp_path)
    marker = tmp_path / "PWNED"
    _plant(checkpoint / name, {"attack": SystemPayload(marker)})
    _revouch(checkpoint)
    err = _resume(workspace, run, capsys)
    assert f"{checkpoint / name} is not a file this trainer writes" in err, err
    assert not marker.exists()


def test_a_checkpoints_folder_linked_into_another_run_is_refused_before_the_lock(
    workspace, trained, tmp_path, capsys
):
    """The lock is the run folder's: B's checkpoints/ linked into run A once let both write one timeline.
    A link to a folder of its own on another disk is still fine."""
    run_a, _ = _copy(trained, tmp_path)
    run_b = tmp_path / "b"
    run_b.mkdir()
    os.symlink(run_a / "checkpoints", run_b / "checkpoints")
    err = _resume(workspace, run_b, capsys)
    assert f"{run_b / 'checkpoints'} links to {(run_a / 'checkpoints').resolve()}" in err, err
    assert "the checkpoints of another run" in err
    run_c = tmp_path / "c"
    run_c.mkdir()
    (tmp_path / "disk" / "c-checkpoints").mkdir(parents=True)
    os.symlink(tmp_path / "disk" / "c-checkpoints", run_c / "checkpoints")
    argv = [*_single(workspace, run_c), "--no-tensorboard", "--max-steps", 1, "--checkpoint-every", 1]
    assert e2e.run_in_process(argv) == 0
    assert (tmp_path / "disk" / "c-checkpoints" / "step_00000001" / "COMPLETE").is_file()


@pytest.mark.launched
def test_a_read_only_run_folder_is_one_line(workspace, trained, tmp_path):
    """A run folder on a read-only mount (a real one: a tmpfs remounted read-only in a mount namespace of
    its own) was a traceback from the run lock; it is one line saying how to go on, exit 2."""
    import shlex

    mount = tmp_path / "ro"
    mount.mkdir()
    argv = [sys.executable, "-m", "dit_accel.train", *map(str, _single(workspace, mount / "run"))]
    argv += ["--no-tensorboard", "--resume", "auto", "--max-steps", "3"]
    script = (
        f"mount -t tmpfs -o size=64m tmpfs {mount} && cp -r {trained} {mount}/run && "
        f"mount -o remount,ro {mount} || exit 99; exec {shlex.join(argv)}"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    if done.returncode == 99:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()[:200]}")
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert f"{mount / 'run'} cannot be written (Read-only file system)" in err, err
