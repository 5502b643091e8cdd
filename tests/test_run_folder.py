"""The run folder under real runs: lineage-aware rotation and --resume auto, the run lock, hyper-parameters
changed on resume, damaged checkpoints, a full disk, and a folder that already holds checkpoints.

Plans, demo data and the latent cache come from tests/test_train_e2e.py's workspace; one launched
2-process timeline (run, roll back, resume) serves several tests.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_train_e2e as e2e
import torch

from dit_accel.errors import UserError
from dit_accel.run import checkpoint as ckpt
from dit_accel.run import faults, lineage
from dit_accel.run import lock as runlock
from dit_accel.run.weights import load_weights

workspace = e2e.workspace
COMMON = ["--no-tensorboard"]


def _command(workspace, out: Path, *args) -> list[str]:
    return e2e.launch_command(workspace, out, *COMMON, *args)


def _launch(workspace, out: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(workspace, out, *args), env=e2e._env(), capture_output=True, text=True, timeout=300
    )


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """The trainer's own error lines in a launch's output (the launcher adds its own report around them)."""
    return [line for line in result.stderr.splitlines() if line.startswith("dit_accel.train: error:")]


def _every_rank_exited_2(result: subprocess.CompletedProcess) -> None:
    """Both ranks ended with the one-line error's code 2, no traceback of their own, none left hanging. (Plain `accelerate
    launch` then reports 1 with torch elastic's ChildFailedError traceback: the launcher's, not a rank's.)"""
    own, _, launcher = result.stderr.partition("torch/distributed/elastic/multiprocessing/api.py")
    assert "Traceback" not in own, own[-3000:]
    # torch elastic's summary lists each failed rank's exit code. It sends SIGTERM to the ranks still
    # tearing down once the first has exited, so a rank ends with 2 itself or by that signal (-15).
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", launcher))
    assert "2" in codes.values() and set(codes.values()) <= {"2", "-15"}, result.stderr[-3000:]
    assert len(codes) == 2 or "closing signal SIGTERM" in launcher, result.stderr[-3000:]


def _names(run: Path) -> list[str]:
    return sorted(path.name for path in (run / "checkpoints").iterdir())


def _log(run: Path, rank: int = 0) -> str:
    return (run / "logs" / f"rank{rank}.log").read_text()


# --- one launched timeline: steps 2, 4, 6; back to 2 with a new lr, on to 5; then --resume auto ---------------


@pytest.fixture(scope="module")
def timeline(workspace, tmp_path_factory):
    root = tmp_path_factory.mktemp("timeline")
    run = root / "run"
    _ok(_launch(workspace, run, "--max-steps", 6, "--checkpoint-every", 2, "--keep-last", 3))
    first = {name: ckpt.marker_id(run / "checkpoints" / name) for name in _names(run)}
    shutil.copytree(run / "checkpoints", root / "snapshot")  # pristine 2-rank checkpoints to damage
    rollback = _launch(
        workspace,
        run,
        "--resume",
        run / "checkpoints" / "step_00000002",
        "--max-steps",
        5,
        "--checkpoint-every",
        1,
        "--keep-last",
        2,
        "--lr",
        "1.5e-3",
    )
    _ok(rollback)
    after_rollback = _names(run)
    rollback_log = _log(run)
    auto = _launch(
        workspace,
        run,
        "--resume",
        "auto",
        "--max-steps",
        6,
        "--checkpoint-every",
        1,
        "--keep-last",
        2,
        "--lr",
        "1.5e-3",
    )
    _ok(auto)
    return dict(
        run=run,
        snapshot=root / "snapshot",
        first=first,
        after_rollback=after_rollback,
        rollback_log=rollback_log,
        auto=auto,
    )


@pytest.mark.launched
def test_rotation_and_resume_auto_follow_the_newest_timeline(timeline):
    run, first = timeline["run"], timeline["first"]
    assert sorted(first) == ["step_00000002", "step_00000004", "step_00000006"]
    # The rolled-back run kept its own newest two (4 and 5); its older ones (3, and 2 it resumed from) were
    # rotated along its timeline; the abandoned branch's 4 and 6 are kept, 4 under its branch name.
    branch_4 = f"step_00000004.branch-{first['step_00000004'][:8]}"
    assert timeline["after_rollback"] == sorted([branch_4, "step_00000004", "step_00000005", "step_00000006"])
    assert ckpt.marker_id(run / "checkpoints" / branch_4) == first["step_00000004"]
    kept = [line for line in timeline["rollback_log"].splitlines() if "abandoned branches" in line]
    assert kept and f"{branch_4}, step_00000006" in kept[-1]
    # --resume auto took the newest-written checkpoint (5), not the highest step (the abandoned 6).
    assert "step_00000005 at step 5" in _log(run)
    new_6 = lineage.read_marker(run / "checkpoints" / "step_00000006")
    assert new_6["parent"] == ckpt.marker_id(run / "checkpoints" / "step_00000005")
    branch_6 = f"step_00000006.branch-{first['step_00000006'][:8]}"
    assert ckpt.marker_id(run / "checkpoints" / branch_6) == first["step_00000006"]
    assert [node.path.name for node in ckpt.current_lineage(run)] == ["step_00000006", "step_00000005"]
    assert {path.name for path in ckpt.abandoned_checkpoints(run)} == {branch_4, branch_6}
    assert not (run / runlock.LOCK_NAME).exists()  # released at exit


@pytest.mark.launched
def test_a_new_lr_on_resume_applies_from_the_resumed_step(timeline):
    run = timeline["run"]
    assert "--lr changed on resume: 0.003 -> 0.0015, applied from step 3" in timeline["rollback_log"]
    final = run / "checkpoints" / "step_00000006"
    # metrics.jsonl holds one timeline, the current one (it once read 1..6, 3..5, 6: two timelines mixed);
    # the abandoned branch's lines (3 to 6 of the first launch) were moved to metrics.abandoned.jsonl.
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    lrs = {m["step"]: m["lr"] for m in metrics}
    assert lrs[1] == lrs[2] == 3e-3  # the first launch (no warmup)
    assert all(lrs[step] == pytest.approx(1.5e-3) for step in (3, 4, 5, 6))
    abandoned = [json.loads(line) for line in (run / "metrics.abandoned.jsonl").read_text().splitlines()]
    assert [(m["step"], m["lr"]) for m in abandoned] == [(step, 3e-3) for step in (3, 4, 5, 6)]
    assert (
        "4 lines of another" in timeline["rollback_log"]
        and "metrics.abandoned.jsonl" in timeline["rollback_log"]
    )
    assert (final / "metrics.jsonl").read_text() == (
        run / "metrics.jsonl"
    ).read_text()  # the checkpoint's copy
    scheduler = json.loads((final / "lr_scheduler.json").read_text())
    assert scheduler["base_lrs"] == [pytest.approx(1.5e-3)]
    groups = torch.load(final / "optimizer.bin", weights_only=False)["param_groups"]
    assert all(group["lr"] == pytest.approx(1.5e-3) for group in groups)
    assert "changed on resume" not in timeline["auto"].stdout  # the same lr again: nothing to say


def test_tensorboard_and_metrics_show_one_timeline_after_a_rollback(workspace, tmp_path):
    """Steps 1-4, back to step 2, on to 3: TensorBoard (read by its own EventAccumulator) and metrics.jsonl
    read 1, 2, 3 of the current timeline, not 1, 2, 3, 4, 3."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    tracked = [a for a in _single(workspace, run) if a != "--no-tensorboard"]  # TensorBoard on
    assert e2e.run_in_process([*tracked, "--max-steps", 4, "--checkpoint-every", 2]) == 0
    second = run / "checkpoints" / "step_00000002"
    assert e2e.run_in_process([*tracked, "--resume", second, "--max-steps", 3]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    folder = run / "tensorboard" / "dit-accel"  # both launches: their scalars and hparams
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    losses = events.Scalars("loss")
    assert [event.step for event in losses] == [1, 2, 3]
    assert [event.value for event in losses] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)


def test_the_plans_shape_cannot_change_on_resume(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    assert e2e.run_in_process(_single(workspace, run, "--max-steps", 1, "--checkpoint-every", 1)) == 0
    capsys.readouterr()
    plan = json.loads(workspace["plan1"].read_text())
    for name, changes, expected in (
        ("accum", {"micro_batch": 4, "grad_accum": 2}, "micro_batch 8 but the plan has 4"),
        ("bf16", {"precision": "bf16"}, "precision fp32 but the plan has bf16"),
    ):
        edited = json.loads(json.dumps(plan))
        edited["decision"].update(changes)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(edited))
        argv = _single(workspace, run, "--resume", "auto", "--max-steps", 2)
        argv[argv.index(workspace["plan1"])] = path
        err = e2e._one_line_error(capsys, argv)
        assert expected in err and "cannot change the plan's shape" in err, err
    assert _names(run) == ["step_00000001"]


# --- damaged checkpoints -------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_train_state(path: Path) -> None:
    state = json.loads(path.read_text())
    state["step"] = 7
    path.write_text(json.dumps(state))


def _garbage(path: Path) -> None:
    path.write_text("garbage\n")  # `echo garbage > COMPLETE`


def _drop_the_manifest(path: Path) -> None:
    marker = json.loads(path.read_text())
    del marker["manifest"]
    path.write_text(json.dumps(marker))


DAMAGE = {  # what is damaged -> (the file, how)
    "model.safetensors": ("model.safetensors", _truncate),
    "optimizer.bin": ("optimizer.bin", _flip_a_byte),
    "random_states_1.pkl": ("random_states_1.pkl", Path.unlink),
    "train_state.json": ("train_state.json", _edit_train_state),
    # An unreadable marker is damage, not an old-style checkpoint that may skip its manifest.
    "COMPLETE-garbage": ("COMPLETE", _garbage),
    "COMPLETE-truncated": ("COMPLETE", _truncate),
    "COMPLETE-empty": ("COMPLETE", lambda path: path.write_text("")),
    "COMPLETE-no-manifest": ("COMPLETE", _drop_the_manifest),
}


@pytest.mark.launched
@pytest.mark.parametrize("damaged", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_resume_auto_takes_the_previous_one(
    timeline, tmp_path, damaged, caplog
):
    run = tmp_path / "run"
    shutil.copytree(timeline["snapshot"], run / "checkpoints")
    newest = run / "checkpoints" / "step_00000006"
    assert lineage.damage(newest) is None
    name, damage = DAMAGE[damaged]
    damage(newest / name)
    with caplog.at_level("WARNING", logger="dit_accel.train"):
        assert ckpt.resolve_resume("auto", run) == run / "checkpoints" / "step_00000004"
    assert f"skips damaged checkpoint step_00000006: {newest / name}" in caplog.text
    with pytest.raises(UserError, match=re.escape(str(newest / name))):
        ckpt.resolve_resume(str(newest), run)


def test_resume_auto_skips_a_damaged_newest_checkpoint(workspace, tmp_path):
    run = tmp_path / "auto"
    assert e2e.run_in_process(_single(workspace, run, "--max-steps", 2, "--checkpoint-every", 1)) == 0
    _truncate(run / "checkpoints" / "step_00000002" / "model.safetensors")
    assert e2e.run_in_process(_single(workspace, run, "--resume", "auto", "--max-steps", 3)) == 0
    text = _log(run)
    assert "skips damaged checkpoint step_00000002" in text and "model.safetensors has" in text
    assert "step_00000001 at step 1" in text


def test_a_garbage_marker_is_damage_for_the_trainer(workspace, tmp_path, capsys):
    """`echo garbage > step_N/COMPLETE`: --resume auto says so and resumes the one before; an explicit
    --resume of it is one line, exit 2 (it once loaded unverified, exit 0)."""
    run = tmp_path / "run"
    assert e2e.run_in_process(_single(workspace, run, "--max-steps", 2, "--checkpoint-every", 1)) == 0
    newest = run / "checkpoints" / "step_00000002"
    _garbage(newest / "COMPLETE")
    capsys.readouterr()
    err = e2e._one_line_error(capsys, _single(workspace, run, "--resume", newest, "--max-steps", 3))
    assert f"checkpoint {newest} is damaged: {newest / 'COMPLETE'} is not JSON" in err, err
    assert e2e.run_in_process(_single(workspace, run, "--resume", "auto", "--max-steps", 2)) == 0
    text = _log(run)
    assert f"skips damaged checkpoint step_00000002: {newest / 'COMPLETE'} is not JSON" in text
    assert "step_00000001 at step 1" in text


def test_sample_export_and_init_from_check_the_manifest_too(workspace, tmp_path, capsys):
    """One byte of the newest ema.safetensors flipped: the very checkpoint --resume auto skips. Sampling,
    exporting or fine-tuning from it exits 2 in one line (it once sampled with no warning); a run folder gives
    its newest intact checkpoint, and says which it skipped."""
    from dit_accel.convert import export
    from dit_accel.sample import command as sample

    run = tmp_path / "run"
    assert e2e.run_in_process(_single(workspace, run, "--max-steps", 2, "--checkpoint-every", 1)) == 0
    newest = run / "checkpoints" / "step_00000002"
    _flip_a_byte(newest / "ema.safetensors")
    capsys.readouterr()
    named = f"checkpoint {newest} is damaged: {newest / 'ema.safetensors'} does not match its sha256"
    assert sample.main(["--checkpoint", str(newest), "--out", str(tmp_path / "grid.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dit-accel sample: error: {named}"), err
    assert export.main(["--checkpoint", str(newest), "--out", str(tmp_path / "pipeline")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    init = _single(
        workspace, tmp_path / "finetune", "--max-steps", 1, "--init-from", newest, "--init-from-ema"
    )
    assert named in e2e._one_line_error(capsys, init)

    model, _spec, info = load_weights(run)  # what sample, export and --init-from read of a run folder
    assert info["checkpoint"] == str(run / "checkpoints" / "step_00000001")
    err = capsys.readouterr().err
    assert "warning: skipping damaged checkpoint step_00000002" in err and "reading step_00000001" in err
    # The raw weights are intact: reading them is not refused.
    assert load_weights(newest, use_ema=False)[2]["checkpoint"] == str(newest)


@pytest.mark.parametrize("marker", ["old-style", "garbage"])
def test_a_rewritten_step_keeps_the_old_checkpoint_under_a_listed_branch_name(workspace, tmp_path, marker):
    """The new timeline writes a step whose checkpoint has an old-style marker (no id) or a damaged one:
    the old folder is kept as step_N.branch-ID with a name that is listed, logged and counted (it was
    `step_N.branch-step_000`, which no listing saw: a whole checkpoint's disk leaked)."""
    run = tmp_path / "run"
    assert e2e.run_in_process(_single(workspace, run, "--max-steps", 2, "--checkpoint-every", 1)) == 0
    old = run / "checkpoints" / "step_00000002"
    if marker == "old-style":  # as versions before lineage wrote it, for both checkpoints
        for step in (1, 2):
            path = run / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
            path.write_text(json.dumps({"step": step, "world_size": 1}, sort_keys=True) + "\n")
    else:
        _garbage(old / "COMPLETE")
    size_bytes = sum(path.stat().st_size for path in old.rglob("*"))
    first = run / "checkpoints" / "step_00000001"
    assert e2e.run_in_process(_single(workspace, run, "--resume", first, "--max-steps", 2)) == 0
    names = _names(run)
    assert len(names) == 3 and "step_00000001" in names and "step_00000002" in names, names
    (branch,) = [name for name in names if name.startswith("step_00000002.branch-")]
    assert re.fullmatch(r"step_00000002\.branch-[0-9a-f]{8}", branch), branch
    kept = run / "checkpoints" / branch
    assert sum(path.stat().st_size for path in kept.rglob("*")) == size_bytes  # the old one, whole
    assert kept in [path for _step, path in ckpt.complete_checkpoints(run)]
    assert kept in ckpt.abandoned_checkpoints(run)
    assert (
        f"abandoned branches (not on this run's timeline; delete them when no longer needed): {branch}"
        in (_log(run))
    )


@pytest.mark.launched
def test_an_explicit_resume_of_a_damaged_checkpoint_is_one_line(workspace, timeline, tmp_path):
    run = tmp_path / "explicit"
    shutil.copytree(timeline["snapshot"], run / "checkpoints")
    damaged = run / "checkpoints" / "step_00000006"
    (damaged / "random_states_1.pkl").unlink()
    result = _launch(workspace, run, "--resume", damaged, "--max-steps", 8)
    assert result.returncode != 0
    lines = _error_lines(result)
    assert len(lines) == 1 and "random_states_1.pkl is missing" in lines[0], result.stderr[-3000:]
    assert "--resume auto skips damaged ones" in lines[0]
    _every_rank_exited_2(result)
    assert "resumed from" not in _log(run)


# --- the run lock ----------------------------------------------------------------------------------------------


@pytest.mark.launched
def test_a_second_run_into_the_same_folder_is_refused(workspace, tmp_path):
    """Two launches into one folder: one trains, the other is refused by the lock on all ranks. The first holds
    the lock while the second starts (rank 0 sleeps 30 s in step 2, which a 2-core box under load needs: a
    second launch 1 s later once found the first already done, its lock released); the second starts once the
    lock exists."""
    run = tmp_path / "run"
    args = ("--max-steps", 40, "--checkpoint-every", 40)
    held = {faults.SLEEP_BEFORE_COLLECTIVE_ENV: "2:0:30"}
    runs = []
    for env in (e2e._env(**held), e2e._env()):
        runs.append(
            subprocess.Popen(
                _command(workspace, run, *args),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        deadline = time.monotonic() + 120
        while (
            not (run / runlock.LOCK_NAME).exists() and runs[0].poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.2)
    results = []
    for process in runs:
        out, err = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    winners = [result for result in results if result.returncode == 0]
    losers = [result for result in results if result.returncode != 0]
    assert len(winners) == 1 and len(losers) == 1, [r.stderr[-2000:] for r in results]
    lines = _error_lines(losers[0])
    assert len(lines) == 1, losers[0].stderr[-3000:]
    assert re.search(r"run is in use by another run \(pid \d+ on .*lock .*run\.lock\)", lines[0]), lines[0]
    assert "use another --output-dir" in lines[0] and "delete the lock file" in lines[0]
    _every_rank_exited_2(losers[0])
    assert not (run / runlock.LOCK_NAME).exists()
    assert _names(run) == ["step_00000040"]
    assert "is in use" not in _log(run, 0) + _log(run, 1)  # the refused run wrote nothing into the folder


@pytest.mark.launched  # the killed run is a real subprocess
def test_a_killed_runs_lock_is_taken_over(workspace, tmp_path):
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-m", "dit_accel.train", *map(str, _single(workspace, run, "--max-steps", 2))],
        env=e2e._env(DIT_ACCEL_CRASH_BEFORE_COMMIT="2", **{"DIT_ACCEL_EXIT_DIR": ""}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == 137, killed.stderr[-2000:]
    left = json.loads((run / runlock.LOCK_NAME).read_text())  # os._exit: no exit handler ran
    assert e2e.run_in_process(_single(workspace, run, "--resume", "auto", "--max-steps", 2)) == 0
    assert f"took over a stale run lock {run / runlock.LOCK_NAME}" in _log(run)
    assert f"pid {left['pid']} on this host is no longer running" in _log(run)
    assert not (run / runlock.LOCK_NAME).exists()


def _hold_lock(run: Path, then: str, pid: int | None = None) -> subprocess.Popen:
    """A real process that takes RUN/run.lock, says `held`, then runs `then` (os._exit(0): dies holding it).
    With `pid`: in a PID namespace of its own (`unshare`, as a container has), where its pid is `pid`."""
    code = "from dit_accel.run import lock as runlock; "
    code += f"runlock.acquire({str(run)!r}); print('held', flush=True); {then}"
    command = [sys.executable, "-c", code]
    if pid is not None:  # the namespace's next pid is chosen through ns_last_pid; `; true` keeps bash forking
        script = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {shlex.join(command)}; true"
        command = ["unshare", "-p", "-f", "--mount-proc", "--kill-child", "bash", "-c", script]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("held"), process.communicate()
    return process


def test_stale_and_foreign_locks(tmp_path):
    lock_path = tmp_path / runlock.LOCK_NAME
    dead = _hold_lock(tmp_path, "os._exit(0)")  # killed holding the lock: no exit handler ran
    dead.wait()
    lock, note = runlock.acquire(tmp_path)
    assert f"pid {dead.pid} on this host is no longer running" in note
    assert json.loads(lock_path.read_text())["pid"] == os.getpid()
    with pytest.raises(UserError, match="in use by another run"):
        runlock.acquire(tmp_path)  # this process is alive: a second holder is refused
    runlock.release_all()
    assert not lock_path.exists()

    lock_path.write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "started": "x"}))
    with pytest.raises(UserError, match="pid 1 on node-elsewhere.*delete the lock file"):
        runlock.acquire(tmp_path)  # fresh heartbeat on another host: refused
    old = time.time() - runlock.STALE_AFTER_S - 60
    os.utime(lock_path, (old, old))
    _lock, note = runlock.acquire(tmp_path)
    assert "heartbeat stopped 11 minutes ago" in note
    runlock.release_all()


def _can_unshare() -> bool:
    return shutil.which("unshare") is not None and (
        subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.launched
@pytest.mark.skipif(not _can_unshare(), reason="unshare -p needs root (a PID namespace of its own)")
def test_a_live_lock_from_another_pid_namespace_with_this_host_name_is_refused(tmp_path):
    """A container with host networking: the same host name, another PID namespace, where the holder's pid
    means no process here. A live holder is refused by its heartbeat (it once looked dead: "pid N on this
    host is no longer running", and two runs wrote one folder); once that stops for STALE_AFTER_S, the lock
    is taken over."""
    free = next(pid for pid in range(30000, 300, -1) if not Path(f"/proc/{pid}").exists())
    holder = _hold_lock(tmp_path, "time.sleep(120)", pid=free)
    try:
        found = json.loads((tmp_path / runlock.LOCK_NAME).read_text())
        assert found["host"] == os.uname().nodename and found["pid"] == free
        assert not Path(f"/proc/{free}").exists()  # the live holder's pid looks dead from here
        with pytest.raises(UserError) as refused:
            runlock.acquire(tmp_path)
        assert f"(pid {found['pid']} on {found['host']} in another PID namespace or boot" in str(
            refused.value
        )
        assert "in use by another run" in str(refused.value)
        old = time.time() - runlock.STALE_AFTER_S - 60  # what a holder killed 11 minutes ago leaves
        os.utime(tmp_path / runlock.LOCK_NAME, (old, old))
        _lock, note = runlock.acquire(tmp_path)
        assert "heartbeat stopped 11 minutes ago" in note
        runlock.release_all()
    finally:
        holder.kill()
        holder.wait()


def test_a_run_lock_that_is_a_folder_is_one_line_and_left_alone(tmp_path):
    (tmp_path / runlock.LOCK_NAME).mkdir()
    old = time.time() - 3600
    os.utime(tmp_path / runlock.LOCK_NAME, (old, old))
    with pytest.raises(UserError, match=r"run\.lock is not a run lock file but a folder.*remove it \(rm -r "):
        runlock.acquire(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [runlock.LOCK_NAME]  # nothing moved aside


# --- a folder that holds checkpoints, without --resume ---------------------------------------------------------


def _tree(folder: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _single(workspace, run: Path, *args) -> list:
    return [
        "--plan",
        workspace["plan1"],
        "--latents",
        workspace["latents"],
        "--output-dir",
        run,
        *e2e.QUIET,
        *COMMON,
        *args,
    ]


@pytest.mark.launched  # reads the launched timeline's checkpoints
def test_a_folder_with_checkpoints_needs_resume(workspace, timeline, tmp_path, capsys):
    run = tmp_path / "same"
    assert e2e.run_in_process(_single(workspace, run, "--max-steps", 1, "--checkpoint-every", 1)) == 0
    capsys.readouterr()
    for folder in (run, tmp_path / "other"):  # the same plan's checkpoints, and another network's
        if folder != run:
            shutil.copytree(timeline["snapshot"], folder / "checkpoints")
        before = _tree(folder)
        err = e2e._one_line_error(capsys, _single(workspace, folder, "--max-steps", 2))
        assert (
            f"{folder} already holds checkpoints" in err and "--resume auto" in err and "--output-dir" in err
        )
        assert _tree(folder) == before  # nothing written, the lock released


# --- a full disk -------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MiB filesystem (tmpfs), or a skip where this machine cannot mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.decode().strip()}): needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.launched
def test_a_full_disk_while_saving_is_one_line_and_leaves_no_partial_checkpoint(
    workspace, timeline, small_disk
):
    run = small_disk / "run"
    shutil.copytree(timeline["snapshot"], run / "checkpoints")  # a 2-rank run at step 6
    size_bytes = lineage.size_bytes(run / "checkpoints" / "step_00000006")
    filler = small_disk / "filler"
    with open(filler, "wb") as handle:  # leave room for half a checkpoint
        handle.write(b"\0" * (shutil.disk_usage(small_disk).free - size_bytes // 2))
    result = _launch(workspace, run, "--resume", "auto", "--max-steps", 7, "--keep-last", 3)
    assert result.returncode != 0
    lines = _error_lines(result)
    assert len(lines) == 1, result.stderr[-3000:]
    # Said once, not once per rank (rank 1 once added `dit_accel.train: [rank 1] error: no space left ...`).
    assert sum("no space left on" in line for line in result.stderr.splitlines()) == 1, result.stderr[-3000:]
    pattern = (
        rf"dit_accel.train: error: no space left on {re.escape(str(small_disk))} while saving checkpoint "
        r"step_00000007: needs about [0-9.e-]+ GiB, [0-9.e-]+ GiB free; free space or point --output-dir at a "
        r"larger disk$"
    )
    assert re.match(pattern, lines[0]), lines[0]
    _every_rank_exited_2(result)
    before = ["step_00000002", "step_00000004", "step_00000006"]
    assert _names(run) == before  # the older checkpoints survive; no step_7.tmp keeps the space
    assert all(lineage.damage(run / "checkpoints" / name) is None for name in before)
    # A save killed mid-write leaves its partial folder; the next start removes it before it saves.
    filler.unlink()
    leftover = run / "checkpoints" / "step_00000007.tmp"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(
        b"\0" * (shutil.disk_usage(small_disk).free - size_bytes // 2)
    )
    _ok(_launch(workspace, run, "--resume", "auto", "--max-steps", 7, "--keep-last", 3))
    assert "removed partial checkpoint folders" in _log(run) and "step_00000007.tmp" in _log(run)
    assert _names(run) == ["step_00000004", "step_00000006", "step_00000007"]
