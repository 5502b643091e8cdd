"""Preemption, launcher death, hangs and rank errors, with real 2-process `accelerate launch` runs over gloo
and real signals (os.kill): what a shared cluster does to a long run.

Each launched run is started once (module-scoped fixtures) and several tests read it.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_train_e2e as e2e
from ports import launch_port
from test_train_e2e import QUIET, _env, assert_same_rng, assert_same_state, make_workspace

from dit_accel.errors import EXIT_HUNG, EXIT_PREEMPTED, EXIT_USER
from dit_accel.run import checkpoint as ckpt

COMMON = [*QUIET, "--no-tensorboard", "--collective-timeout-s", "60"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The end-to-end tests' workspace (tests/test_train_e2e.py), made once for this module."""
    return make_workspace(tmp_path_factory.mktemp("train"))


LONG = ["--max-steps", "1000", "--checkpoint-every", "1000"]  # stopped by a signal long before the end


def _trainer_args(workspace, out: Path, *args, plan=None, data=None) -> list[str]:
    plan = plan or workspace["plan2"]
    data = data or ["--latents", workspace["latents"]]
    return [str(a) for a in ("--plan", plan, *data, "--output-dir", out, *COMMON, *args)]


def _wrapper(workspace, out: Path, *args, env=None, **kwargs) -> subprocess.Popen:
    """`dit-accel train ...` (the wrapper around accelerate launch), running."""
    command = [sys.executable, "-m", "dit_accel.cli", "train", "--main-process-port", launch_port()]
    return subprocess.Popen(
        command + _trainer_args(workspace, out, *args, **kwargs),
        env=_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _accelerate_launch(workspace, out: Path, *args, env=None) -> subprocess.Popen:
    plan = workspace["plan2"]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(plan.parent / "accelerate_config.yaml"),
        "--main_process_port",
        launch_port(),
        "-m",
        "dit_accel.train",
    ]
    return subprocess.Popen(
        command + _trainer_args(workspace, out, *args),
        env=_env(**(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


def _wait_for_step(out: Path, step: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until every rank has started optimizer step `step` (their heartbeats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        steps = []
        for rank in (0, 1):
            try:
                steps.append(json.loads((out / "logs" / f"heartbeat_rank{rank}.json").read_text())["step"])
            except (OSError, ValueError):
                pass
        if len(steps) == 2 and min(steps) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout_s} s")


def _finish(process: subprocess.Popen, timeout_s: float = 120) -> tuple[int, str]:
    _out, err = process.communicate(timeout=timeout_s)
    return process.returncode, err


def _stop_step(err: str) -> int:
    line = next(line for line in err.splitlines() if "preempted by SIG" in line)
    return int(line.split(" at step ")[1].split(":")[0])


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []


STOP_STEP = 3  # rank 0 sleeps in step 3's first micro-step while the signal comes: the stop is voted there
HELD = {"DIT_ACCEL_SLEEP_BEFORE_COLLECTIVE": f"{STOP_STEP}:0:3"}


def _wait_for_micro_step(out: Path, step: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until rank 0 is held in `step`'s first micro-step (its heartbeat)."""
    deadline = time.monotonic() + timeout_s
    beat = out / "logs" / "heartbeat_rank0.json"
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            if json.loads(beat.read_text())["step"] == step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout_s} s")


@pytest.fixture(scope="module")
def preempted_launcher(workspace, tmp_path_factory):
    """`dit-accel train`, SIGTERM to its `accelerate launch` child (torch elastic forwards it to the ranks)
    while step 3 runs; beside it, the same run straight to step 6 (checkpoints at 3 and 6)."""
    root = tmp_path_factory.mktemp("preempt")
    out, straight = root / "launcher", root / "straight"
    wrapper = _wrapper(workspace, out, *LONG, env=HELD)
    other = _wrapper(workspace, straight, "--max-steps", 2 * STOP_STEP, "--checkpoint-every", STOP_STEP)
    _wait_for_micro_step(out, STOP_STEP, wrapper)
    (launcher,) = _children(wrapper.pid)
    os.kill(launcher, signal.SIGTERM)
    code, err = _finish(wrapper)
    assert _finish(other)[0] == 0
    return {"out": out, "code": code, "err": err, "straight": straight}


@pytest.mark.launched
def test_sigterm_to_the_launcher_saves_the_step_and_exits_4(preempted_launcher):
    code, err, out = preempted_launcher["code"], preempted_launcher["err"], preempted_launcher["out"]
    assert code == EXIT_PREEMPTED, err[-3000:]
    step = _stop_step(err)
    assert step == STOP_STEP
    lines = [line for line in err.splitlines() if "preempted by SIG" in line]
    assert lines == [
        f"dit_accel.train: preempted by SIGTERM at step {step}: saved checkpoint "
        f"{out / 'checkpoints' / f'step_{step:08d}'}; exit 4 (requeue and resume with --resume auto)"
    ]
    assert _checkpoints(out) == [f"step_{step:08d}"]  # exactly one, at the stop step, complete
    assert ckpt.read_train_state(out / "checkpoints" / f"step_{step:08d}")["step"] == step
    assert "Traceback" not in err  # the launcher's SignalException traceback is left out


@pytest.mark.launched
def test_a_preempted_run_resumes_bit_identically(preempted_launcher, workspace, tmp_path):
    """Nothing is lost: the stop step's checkpoint equals a straight run's at that step, and the run resumed
    from it to step 6 equals the straight run there."""
    preempted, straight = preempted_launcher["out"], preempted_launcher["straight"]
    stop, target = f"step_{STOP_STEP:08d}", f"step_{2 * STOP_STEP:08d}"
    assert_same_state(straight / "checkpoints" / stop, preempted / "checkpoints" / stop)
    resumed = tmp_path / "resumed"
    shutil.copytree(preempted / "checkpoints", resumed / "checkpoints")
    every = ["--checkpoint-every", STOP_STEP]
    code, err = _finish(
        _wrapper(workspace, resumed, "--max-steps", 2 * STOP_STEP, *every, "--resume", "auto")
    )
    assert code == 0, err[-3000:]
    assert_same_state(straight / "checkpoints" / target, resumed / "checkpoints" / target)
    assert_same_rng(straight / "checkpoints" / target, resumed / "checkpoints" / target)  # both ranks


@pytest.mark.launched
def test_sigusr1_to_one_rank_stops_every_rank_at_the_same_step(workspace, tmp_path):
    """The signal reaches rank 1 only; the vote in the step's all-reduce stops both. Plain `accelerate
    launch` reports any failed rank as 1; `dit-accel train` gives the ranks' 4 (tested above)."""
    out = tmp_path / "rank1"
    launcher = _accelerate_launch(workspace, out, *LONG)
    _wait_for_step(out, 2, launcher)
    ranks = sorted(_children(launcher.pid))
    assert len(ranks) == 2
    rank1 = next(pid for pid in ranks if "RANK=1\0" in Path(f"/proc/{pid}/environ").read_text())
    os.kill(rank1, signal.SIGUSR1)
    code, err = _finish(launcher)
    assert code == 1, err[-3000:]  # what the shell sees from plain accelerate launch
    step = _stop_step(err)
    assert f"preempted by SIGUSR1 at step {step}" in err
    assert _checkpoints(out) == [f"step_{step:08d}"]
    for rank in (0, 1):
        assert "preempted by SIGUSR1" in (out / "logs" / f"rank{rank}.log").read_text()


@pytest.mark.launched
def test_sigterm_to_the_wrapper_is_forwarded_and_its_exit_code_is_the_ranks(workspace, tmp_path):
    """With DataLoader workers, as on a real node: the wrapper forwards the signal to the launcher's process
    group, which holds every rank's workers too; they must not die of it before their rank has saved."""
    out = tmp_path / "wrapper"
    wrapper = _wrapper(workspace, out, *LONG, "--num-workers", 2)
    _wait_for_step(out, 2, wrapper)
    (launcher,) = _children(wrapper.pid)
    ranks = _children(launcher)
    workers = [worker for rank in ranks for worker in _children(rank)]
    assert len(workers) >= 4, workers  # 2 per rank
    os.kill(wrapper.pid, signal.SIGTERM)
    code, err = _finish(wrapper)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "killed by signal" not in err and "Traceback" not in err, err[-3000:]
    assert _checkpoints(out) == [f"step_{_stop_step(err):08d}"]
    assert not any(map(_alive, [launcher, *ranks, *workers]))


@pytest.mark.launched
def test_sigterm_to_one_dataloader_worker_stops_the_run_as_one_to_its_rank(workspace, tmp_path):
    """A signal to a worker alone (a user's `kill` of the busiest process, an OOM killer's neighbour) was
    dropped by the worker's shield: the run trained on to its end, exit 0, without a word. The worker now
    passes it on to its rank: the run stops at a step, saved, exit 4, as a signal to the rank does."""
    out = tmp_path / "worker"
    wrapper = _wrapper(workspace, out, *LONG, "--num-workers", 1)
    _wait_for_step(out, 2, wrapper)
    (launcher,) = _children(wrapper.pid)
    rank1 = next(pid for pid in _children(launcher) if "RANK=1\0" in Path(f"/proc/{pid}/environ").read_text())
    (worker,) = _children(rank1)
    os.kill(worker, signal.SIGTERM)
    code, err = _finish(wrapper)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "preempted by SIGTERM at step" in err and "killed by signal" not in err, err[-3000:]
    assert _checkpoints(out) == [f"step_{_stop_step(err):08d}"]


def _wait_for(condition, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.01)


@pytest.mark.launched
def test_sigterm_while_the_launcher_starts_exits_4_in_one_line(workspace, tmp_path):
    """Preempted before torch elastic (or any rank) has a handler: the launcher dies of the signal itself.
    That is still a preemption (the SLURM script requeues only on 4): exit 4, one line, no traceback."""
    out = tmp_path / "early"
    wrapper = _wrapper(workspace, out, *LONG)
    _wait_for(lambda: _children(wrapper.pid), wrapper)  # the launcher exists, still importing
    os.kill(wrapper.pid, signal.SIGTERM)
    code, err = _finish(wrapper)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "dit-accel train: preempted by SIGTERM before the ranks could save (they were starting, or outlived "
        "the launcher's grace period): nothing new is saved; exit 4 (requeue and resume with --resume auto)"
    ), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert _checkpoints(out) == []


@pytest.mark.launched
def test_sigterm_while_the_ranks_set_up_stops_them_before_a_step(workspace, tmp_path):
    """The ranks have their handlers but are still setting up (data, model): every rank learns of the stop
    before the first step and exits 4 without training a step it would have to save."""
    out = tmp_path / "setup"
    wrapper = _wrapper(workspace, out, *LONG)
    _wait_for(lambda: (out / "logs" / "rank1.log").exists(), wrapper)
    os.kill(wrapper.pid, signal.SIGTERM)
    code, err = _finish(wrapper)
    assert code == EXIT_PREEMPTED, err[-3000:]
    lines = [line for line in err.splitlines() if "preempted by" in line]
    assert lines == [
        "dit_accel.train: preempted by SIGTERM while starting, before step 1: nothing new to save (no "
        "checkpoint yet); exit 4 (requeue and resume with --resume auto)"
    ], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert _checkpoints(out) == [] and not (out / "run.lock").exists()
    assert not (out / "logs" / "heartbeat_rank0.json").exists()  # no step was started


@pytest.mark.launched
def test_ranks_end_when_their_launcher_is_killed(workspace, tmp_path):
    out = tmp_path / "orphans"
    launcher = _accelerate_launch(workspace, out, *LONG)
    _wait_for_step(out, 2, launcher)
    ranks = _children(launcher.pid)
    assert len(ranks) == 2
    launcher.kill()  # SIGKILL: no chance to forward anything
    launcher.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks)), "ranks outlived their launcher"
    # They ended as preempted ones do (the parent-death signal is SIGTERM): the step saved.
    assert len(_checkpoints(out)) == 1


@pytest.mark.launched
def test_a_rank_stuck_before_a_collective_ends_the_run_naming_it(workspace, tmp_path):
    """Without accumulation (grad_accum 1), where DDP's all-reduce runs inside the only micro-step's
    backward: the waiting rank and the sleeping one are at the same micro-step, and only the forward mark
    tells which one is behind. Both ranks name rank 1, so does `doctor --log`, and the lock is released."""
    from dit_accel.doctor.logs import find_hang
    from dit_accel.run.lock import LOCK_NAME

    plan = e2e._make_plan(tmp_path / "plan_accum1", gpus=2, micro_batch=4, grad_accum=1)
    out = tmp_path / "hang"
    timeout_s = 4
    started = time.monotonic()
    wrapper = _wrapper(
        workspace,
        out,
        *LONG,
        "--collective-timeout-s",
        timeout_s,
        env={"DIT_ACCEL_SLEEP_BEFORE_COLLECTIVE": "2:1:600"},
        plan=plan,
    )
    code, err = _finish(wrapper)
    took_s = time.monotonic() - started
    assert code == EXIT_HUNG, err[-3000:]
    lines = [line for line in err.splitlines() if "--collective-timeout-s" in line]
    assert lines and all(
        "rank 1 stuck at step 2 for " in line
        and "before a collective (micro-step 1 of 1, in its forward)" in line
        and "other ranks are at step 2, waiting for it in the collective (rank 0)" in line
        for line in lines
    ), err[-3000:]
    assert find_hang(err).name == "rank 1 hung"
    assert not (out / LOCK_NAME).exists()  # the watchdog's os._exit released it first
    # (rank 1 sleeps 600 s: exit 5 with these lines is the watchdog's end, not the sleep's; no verdict here
    # depends on how long set-up took on a busy box, `took_s` is only printed)
    print(f"hang test: {took_s:.0f} s from launch to exit", file=sys.stderr)


@pytest.mark.launched
def test_a_bad_image_only_rank_1_reads_is_shown_on_the_console_and_exits_2(workspace, tmp_path):
    from dit_accel.data.folder import list_image_folder
    from dit_accel.data.order import SampleOrder

    plan = json.loads(workspace["plan2"].read_text())
    plan["decision"]["latents"] = "online"
    plan_dir = tmp_path / "online_plan"
    plan_dir.mkdir()
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    shutil.copy(workspace["plan2"].parent / "accelerate_config.yaml", plan_dir)
    images = tmp_path / "images"
    shutil.copytree(workspace["images"], images)
    listing, _ = list_image_folder(images)
    d = plan["decision"]
    order = SampleOrder(len(listing.paths), plan["global_batch"], d["micro_batch"], d["grad_accum"], 2, 0)
    rank0 = {i for m in range(d["grad_accum"]) for i, _ in order.micro_batch_items(1, m, 0)}
    firsts = {listing.labels.index(label) for label in set(listing.labels)}  # set-up decodes these
    bad = next(i for i, _ in order.micro_batch_items(1, 0, 1) if i not in rank0 | firsts)
    (images / listing.paths[bad]).write_bytes(b"not an image")

    wrapper = _wrapper(
        workspace,
        tmp_path / "bad",
        "--max-steps",
        4,
        plan=plan_dir / "plan.json",
        data=["--data-path", images, "--vae", workspace["vae"]],
    )
    code, err = _finish(wrapper)
    assert code == EXIT_USER, err[-3000:]
    # The folder was listed once, by rank 0, into the run's index that both ranks read.
    logs = [(tmp_path / "bad" / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert "listed once for every rank: " in logs[0] and "listed once" not in logs[1]
    assert (tmp_path / "bad" / "data_index" / "summary.json").is_file()
    line = next(line for line in err.splitlines() if "cannot decode image" in line)
    assert (
        line.startswith("dit_accel.train: [rank 1] error: cannot decode image ")
        and listing.paths[bad] in line
    )
    assert "Traceback" not in err, err[-3000:]


def test_a_set_up_error_through_the_wrapper_is_one_line_and_exit_2(workspace, tmp_path, capsys):
    from dit_accel.train.launch import main

    code = main(["--plan", str(workspace["plan2"]), "--num-processes", "1", "--latents", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USER and len(err) == 1
    assert err[0].startswith("dit-accel train: error: --num-processes 1 but ") and "2 processes" in err[0]


@pytest.mark.launched
def test_a_user_error_in_every_rank_through_the_wrapper_is_one_line(workspace, tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    code, err = _finish(_wrapper(workspace, tmp_path / "run", "--max-steps", 2, "--resume", missing))
    assert code == EXIT_USER, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(missing) in errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.launched
def test_a_one_process_run_that_fails_is_its_rank_line_without_the_launchers_traceback(workspace, tmp_path):
    """accelerate's one-process launcher (simple_launcher) ends in its own CalledProcessError traceback; the
    rank's line already said why, so the wrapper prints that line alone, with the rank's exit code."""
    missing = tmp_path / "no_such_checkpoint"
    launched = _wrapper(
        workspace, tmp_path / "run", "--max-steps", 2, "--resume", missing, plan=workspace["plan1"]
    )
    code, err = _finish(launched)
    assert code == EXIT_USER, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and "warn" not in line.lower()]
    assert len(lines) == 1 and str(missing) in lines[0] and "error:" in lines[0], err[-3000:]
