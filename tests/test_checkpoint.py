"""checkpoint.py with a real (single-process) Accelerator: commit, rotate, partial folders, exact restore."""

import json

import pytest
import torch
from torch import nn

from dit_accel.errors import UserError
from dit_accel.run import checkpoint as ckpt
from dit_accel.train.ema import EMA
from dit_accel.train.optim import build_optimizer, build_scheduler


@pytest.fixture
def accelerator(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _parts(accelerator, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    optimizer = build_optimizer(model, lr=1e-2)
    scheduler = build_scheduler(optimizer, warmup_steps=3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ema = EMA(accelerator.unwrap_model(model), decay=0.9)
    return model, optimizer, scheduler, ema


def _train_steps(model, optimizer, scheduler, ema, steps):
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        ema.update(model)
        optimizer.zero_grad()


def _save(accelerator, run_dir, step, ema, keep_last=2, scheduler=None, **kwargs):
    state = {"step": step, "world_size": 1, "global_batch": 5}
    return ckpt.save_checkpoint(
        accelerator,
        run_dir,
        step,
        ema=ema,
        scheduler=scheduler or build_scheduler(build_optimizer(nn.Linear(1, 1), lr=1e-2), warmup_steps=3),
        train_state=state,
        plan={"schema": "x"},
        config={"lr": 1},
        keep_last=keep_last,
        **kwargs,
    )


def test_commit_rotate_and_layout(accelerator, tmp_path):
    model, optimizer, scheduler, ema = _parts(accelerator)
    for step in (1, 2, 3):
        _train_steps(model, optimizer, scheduler, ema, 1)
        final = _save(accelerator, tmp_path, step, ema)
        assert final.name == f"step_{step:08d}" and ckpt.is_complete(final)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000003"]  # keep_last=2, nothing .tmp left behind
    files = {p.name for p in final.iterdir()}
    assert {
        "model.safetensors",
        "optimizer.bin",
        "lr_scheduler.json",
        "random_states_0.pkl",
        "ema.safetensors",
        "train_state.json",
        "plan.json",
        "train_config.json",
        "COMPLETE",
    } <= files
    assert json.loads((final / "COMPLETE").read_text())["step"] == 3
    assert ckpt.latest_checkpoint(tmp_path) == final
    assert ckpt.resolve_checkpoint(tmp_path) == final
    assert ckpt.resolve_checkpoint(tmp_path / "checkpoints") == final


def test_interrupted_write_is_never_loaded_and_old_ones_survive(accelerator, tmp_path):
    model, optimizer, scheduler, ema = _parts(accelerator)
    _save(accelerator, tmp_path, 1, ema, keep_last=1)

    def die(tmp_dir, step):
        raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        _save(accelerator, tmp_path, 2, ema, keep_last=1, before_commit=die)
    # The half-written folder exists but does not count; the older checkpoint was not rotated away.
    assert (tmp_path / "checkpoints" / "step_00000002.tmp" / "model.safetensors").exists()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000001"
    assert ckpt.resolve_resume("auto", tmp_path).name == "step_00000001"
    # A folder with the final name but no marker (e.g. copied by hand, interrupted) is ignored too.
    (tmp_path / "checkpoints" / "step_00000009").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(UserError, match="incomplete"):
        ckpt.resolve_checkpoint(tmp_path / "checkpoints" / "step_00000009")
    with pytest.raises(UserError, match="incomplete"):
        ckpt.load_checkpoint(
            accelerator, tmp_path / "checkpoints" / "step_00000002.tmp", ema=ema, scheduler=scheduler
        )
    # The next successful save clears the leftovers.
    _save(accelerator, tmp_path, 3, ema, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000009"]


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    assert ckpt.resolve_resume("auto", tmp_path) is None
    assert ckpt.resolve_resume(None, tmp_path) is None
    with pytest.raises(UserError, match="no complete checkpoint"):
        ckpt.resolve_resume(str(tmp_path), tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_restore_is_exact(accelerator, tmp_path):
    model, optimizer, scheduler, ema = _parts(accelerator)
    _train_steps(model, optimizer, scheduler, ema, 2)
    saved = _save(accelerator, tmp_path, 2, ema, scheduler=scheduler)
    rng_after_save = torch.get_rng_state()
    _train_steps(model, optimizer, scheduler, ema, 2)
    expected = (
        [p.detach().clone() for p in model.parameters()],
        {k: v.clone() for k, v in ema.shadow.items()},
        scheduler.get_last_lr(),
    )

    # Perturb everything, then restore and replay the same two steps.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.manual_seed(123)
    state = ckpt.load_checkpoint(accelerator, saved, ema=ema, scheduler=scheduler)
    assert state["step"] == 2
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    _train_steps(model, optimizer, scheduler, ema, 2)
    for got, want in zip(model.parameters(), expected[0]):
        assert torch.equal(got, want)
    for name, want in expected[1].items():
        assert torch.equal(ema.shadow[name], want)
    assert scheduler.get_last_lr() == expected[2]


def test_rotation_follows_the_timeline_and_keeps_other_branches(accelerator, tmp_path):
    model, optimizer, scheduler, ema = _parts(accelerator)
    for step in (1, 2, 3):
        _save(accelerator, tmp_path, step, ema, keep_last=3)
    old = {step: ckpt.marker_id(tmp_path / "checkpoints" / f"step_{step:08d}") for step in (1, 2, 3)}
    # Back to step 1: the new timeline's step 2 replaces nothing; the abandoned 2 and 3 stay, 2 renamed.
    new_2 = _save(accelerator, tmp_path, 2, ema, keep_last=2, parent=old[1])
    assert ckpt.latest_checkpoint(tmp_path) == new_2
    assert ckpt.marker_id(tmp_path / "checkpoints" / f"step_00000002.branch-{old[2][:8]}") == old[2]
    assert [n.path.name for n in ckpt.current_lineage(tmp_path)] == ["step_00000002", "step_00000001"]
    new_3 = _save(accelerator, tmp_path, 3, ema, keep_last=2, parent=ckpt.marker_id(new_2))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == sorted(
        [
            "step_00000002",
            "step_00000003",
            f"step_00000002.branch-{old[2][:8]}",
            f"step_00000003.branch-{old[3][:8]}",
        ]
    )  # step 1 rotated along the new timeline; the abandoned 2 and 3 kept
    assert ckpt.resolve_resume("auto", tmp_path) == new_3
    assert len(ckpt.abandoned_checkpoints(tmp_path)) == 2


def test_old_markers_without_a_manifest_still_load(accelerator, tmp_path):
    model, optimizer, scheduler, ema = _parts(accelerator)
    old = _save(accelerator, tmp_path, 1, ema)
    (old / ckpt.COMPLETE).write_text(json.dumps({"step": 1, "world_size": 1}))  # as versions before manifests
    (old / ckpt.TRAIN_STATE).write_text(json.dumps({"step": 1, "world_size": 1, "global_batch": 5}))
    assert ckpt.resolve_resume("auto", tmp_path) == old  # unverifiable, so taken as intact
    assert ckpt.load_checkpoint(accelerator, old, ema=ema, scheduler=scheduler)["step"] == 1
    new = _save(accelerator, tmp_path, 2, ema)  # continues the old timeline
    assert json.loads((new / ckpt.COMPLETE).read_text())["parent"] == "step_00000001"
    assert [n.path for n in ckpt.current_lineage(tmp_path)] == [new, old]


def test_resume_auto_refuses_a_timeline_of_damaged_checkpoints(accelerator, tmp_path):
    model, optimizer, scheduler, ema = _parts(accelerator)
    only = _save(accelerator, tmp_path, 1, ema)
    (only / ckpt.EMA_WEIGHTS).write_bytes(b"not the weights")
    with pytest.raises(
        UserError, match="every checkpoint of the current timeline .* is damaged .*ema.safetensors"
    ):
        ckpt.resolve_resume("auto", tmp_path)  # never a silent restart at step 0
