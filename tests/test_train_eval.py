"""`--eval-every`: FID and IS of the EMA while training (dit_accel.train.evaluation), in process on a 1-block
pixel-space DiT at 16 px and a random Inception at 75 px (tests/test_evaluate.py's), against what
`dit-accel sample --evaluate` computes from the checkpoints of the same steps."""

import json
import math

import numpy as np
import pytest
import test_train_e2e as e2e
import torch
from test_evaluate import (
    EVAL_PX,
    _blobs,
    _fitted_random_inception,
    plan_tiny_pixel,
    write_tiny_pixel_workspace,
)
from test_sample import fresh_accelerate_state

EVAL = ["--eval-every", 2, "--eval-samples", 8, "--eval-steps", 2, "--eval-input-px", EVAL_PX]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_eval")
    write_tiny_pixel_workspace(root)
    plan_tiny_pixel("--objective", "flow", "--out", str(root / "plan-flow"))
    reference = _blobs(12, seed=1, px=16)  # the run's samples' side
    torch.save(_fitted_random_inception(reference).state_dict(), root / "inception.pth")
    np.savez(root / "reference.npz", reference)
    return root


def _train(workspace, run, *extra, env=None, plan="plan") -> int:
    argv = ["--plan", workspace / plan / "plan.json", "--data-path", workspace / "images"]
    argv += ["--output-dir", run, "--num-workers", 0, "--no-progress-bar", "--lr", "3e-3", "--log-every", 1]
    return e2e.run_in_process([*argv, *extra], env=env)


@pytest.fixture(scope="module")
def evaluated(workspace):
    """4 steps, an evaluation at steps 2 and 4 (TensorBoard on), a checkpoint at each."""
    run = workspace / "run"
    weights = [
        "--eval-reference",
        workspace / "reference.npz",
        "--inception-weights",
        workspace / "inception.pth",
    ]
    extra = ["--max-steps", 4, "--checkpoint-every", 2, *EVAL, *weights]
    assert _train(workspace, run, *extra, env={"XDG_CACHE_HOME": str(workspace / "cache")}) == 0
    return run


def test_fid_and_is_are_logged_at_each_multiple_of_eval_every_in_metrics_and_tensorboard(evaluated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [json.loads(line) for line in (evaluated / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval/fid" in line]
    assert [line["step"] for line in evals] == [2, 4]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3, 4]  # the step lines as before
    assert all(math.isfinite(line["eval/fid"]) and line["eval/is"] >= 1 for line in evals)
    assert evals[0]["eval/fid"] != evals[1]["eval/fid"] and evals[0]["eval/num_samples"] == 8
    events = EventAccumulator(str(evaluated / "tensorboard" / "dit-accel"), size_guidance={"scalars": 0})
    events.Reload()
    for tag, key in (("eval/fid", "eval/fid"), ("eval/is", "eval/is")):
        scalars = events.Scalars(tag)
        assert [event.step for event in scalars] == [2, 4], tag
        assert [event.value for event in scalars] == pytest.approx([line[key] for line in evals], rel=1e-6)
    # the checkpoint of step 2 holds its evaluation's line: a resume from it keeps it in the timeline
    copied = (evaluated / "checkpoints" / "step_00000002" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(copied[-1]) == evals[0]


def test_the_scores_are_those_sample_evaluate_gives_for_the_checkpoints_of_those_steps(
    evaluated, workspace, tmp_path
):
    """The same EMA, labels, seeds, sampler and batches: `sample --evaluate` on step 2's and step 4's
    checkpoints scores what the run logged (the reference's statistics from the run's cache)."""
    logged = [json.loads(line) for line in (evaluated / "metrics.jsonl").read_text().splitlines()]
    logged = {line["step"]: line for line in logged if "eval/fid" in line}
    for step in (2, 4):
        scores = _sample_evaluate(
            evaluated / "checkpoints" / f"step_{step:08d}", workspace, tmp_path / f"{step}.json"
        )
        assert scores["fid"] == pytest.approx(logged[step]["eval/fid"], rel=1e-6), step
        assert scores["inception_score"] == pytest.approx(logged[step]["eval/is"], rel=1e-6), step
    assert len(list((workspace / "cache").rglob("reference-*.npz"))) == 1  # computed once, by the run


def test_evaluating_changes_nothing_the_run_trains(evaluated, workspace, tmp_path):
    """Sampling draws from its own per-sample generators: the same run without --eval-every has the same
    losses and, at step 4, the same weights and EMA bit for bit."""
    from safetensors.torch import load_file

    plain = tmp_path / "plain"
    assert _train(workspace, plain, "--max-steps", 4, "--checkpoint-every", 2, "--no-tensorboard") == 0

    def losses(run):
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [line["loss"] for line in lines if "loss" in line]

    assert losses(plain) == losses(evaluated)
    for name in ("model.safetensors", "ema.safetensors"):
        ours, theirs = (load_file(run / "checkpoints" / "step_00000004" / name) for run in (plain, evaluated))
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name


def _sample_evaluate(checkpoint, workspace, results) -> dict:
    """`dit-accel sample --evaluate` with the run's evaluation settings, on one thread as the run sampled."""
    from dit_accel.sample.command import main as sample

    argv = [
        "--checkpoint",
        checkpoint,
        "--num-samples",
        8,
        "--batch-size",
        8,
        "--steps",
        2,
        "--cfg-scale",
        1.0,
    ]
    argv += ["--input-px", EVAL_PX, "--evaluate", workspace / "reference.npz", "--results", results]
    argv += ["--inception-weights", workspace / "inception.pth"]
    argv += ["--cache-dir", workspace / "cache" / "dit-accel" / "reference-stats"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fresh_accelerate_state():
            assert sample([str(a) for a in argv]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(results.read_text())


def test_a_flow_run_is_scored_with_the_ode_sample_uses_for_it(workspace, tmp_path):
    """The plan's objective decides the sampler (the run resolves --objective later): the ODE, as `sample`
    picks it for the checkpoint."""
    run = tmp_path / "flow"
    weights = [
        "--eval-reference",
        workspace / "reference.npz",
        "--inception-weights",
        workspace / "inception.pth",
    ]
    extra = ["--max-steps", 2, "--checkpoint-every", 2, "--no-tensorboard", *EVAL, *weights]
    env = {"XDG_CACHE_HOME": str(workspace / "cache")}
    assert _train(workspace, run, *extra, env=env, plan="plan-flow") == 0
    assert "ode 2 steps" in (run / "logs" / "rank0.log").read_text()
    (logged,) = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/fid" in line
    ]
    scores = _sample_evaluate(run / "checkpoints" / "step_00000002", workspace, tmp_path / "flow.json")
    assert scores["sampling"]["sampler"] == "ode"
    assert scores["fid"] == pytest.approx(logged["eval/fid"], rel=1e-6)


@pytest.mark.parametrize("problem", ["no reference", "no weights", "neither"])
def test_missing_files_are_refused_in_one_line_before_training(workspace, tmp_path, capsys, problem):
    """Everything missing is named in one line: with neither the reference nor the weights there, the
    weights alone were named first, and the reference only on the next try."""
    run = tmp_path / "run"
    reference = workspace / "reference.npz" if problem == "no weights" else tmp_path / "absent.npz"
    flags = [*EVAL, "--eval-reference", reference, "--max-steps", 1]
    if problem == "no reference":
        flags += ["--inception-weights", workspace / "inception.pth"]
    env = {"TORCH_HOME": str(tmp_path / "torch")}  # no weights in its hub cache
    assert _train(workspace, run, *flags, env=env) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dit_accel.train: error: "), err
    assert ("absent.npz does not exist" in err) == (problem != "no weights")
    assert ("curl -L --create-dirs" in err) == (problem != "no reference")
    assert not run.exists()  # refused with the flags: no run folder, no process group, no model


@pytest.mark.launched
def test_a_stop_signal_during_an_evaluation_ends_it_and_saves_the_step(workspace, tmp_path):
    """SIGTERM to the launcher while every rank samples for --eval-every: the evaluation once ran to its end
    before the stop was seen (63 s from TERM to exit, past a cluster's grace). Now every rank votes before
    each batch: the evaluation ends unscored, the step is saved, exit 4."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from ports import launch_port
    from test_preemption import _children
    from test_train_e2e import _env

    from dit_accel.errors import EXIT_PREEMPTED

    plan_tiny_pixel("--gpus", "2", "--out", str(tmp_path / "plan"))
    run = tmp_path / "run"
    command = [sys.executable, "-m", "dit_accel.cli", "train", "--main-process-port", launch_port()]
    command += ["--plan", tmp_path / "plan" / "plan.json", "--data-path", workspace / "images"]
    command += [
        "--output-dir",
        run,
        "--num-workers",
        0,
        "--no-progress-bar",
        "--no-tensorboard",
        "--log-every",
        1,
    ]
    command += ["--max-steps", 100, "--checkpoint-every", 100, "--eval-every", 2, "--eval-samples", 512]
    command += [
        "--eval-steps",
        50,
        "--eval-input-px",
        EVAL_PX,
        "--eval-reference",
        workspace / "reference.npz",
    ]
    command += ["--inception-weights", workspace / "inception.pth"]
    env = _env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    process = subprocess.Popen(
        [str(a) for a in command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log_path = run / "logs" / "rank0.log"
    deadline = time.monotonic() + 180
    while "eval step 2: sampling" not in (log_path.read_text() if log_path.exists() else ""):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    (launcher,) = _children(process.pid)
    os.kill(launcher, signal.SIGTERM)
    _out, err = process.communicate(timeout=180)
    assert process.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "preempted by SIGTERM at step 2" in err
    stopped = re.search(
        r"eval step 2: stopped by a signal after (\d+) of (\d+) batches", log_path.read_text()
    )
    assert stopped and int(stopped[1]) < int(stopped[2]) == 64  # 512 images, 2 ranks, micro-batch 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and not any("eval/fid" in line for line in lines)


def test_an_image_folder_changed_under_a_resumed_run_is_announced(workspace, tmp_path):
    """Two images swapped between classes (the same 8 entries), then the run pointed at another copy: each
    resume once went on without a word, as every changed flag does not ("changed on resume")."""
    import shutil

    images = shutil.copytree(workspace / "images", tmp_path / "images")
    run = tmp_path / "run"

    def train(steps: int, data) -> str:
        argv = ["--plan", workspace / "plan" / "plan.json", "--data-path", data, "--output-dir", run]
        argv += ["--num-workers", 0, "--no-progress-bar", "--no-tensorboard", "--max-steps", steps]
        assert e2e.run_in_process([*argv, "--checkpoint-every", 1, "--resume", "auto"]) == 0
        return (run / "logs" / "rank0.log").read_text()

    train(1, images)
    assert "the data changed on resume" not in train(2, images)  # the same folder: nothing to say
    classes = sorted(path for path in images.iterdir() if path.is_dir())
    first, second = sorted(classes[0].iterdir())[0], sorted(classes[1].iterdir())[0]
    first.rename(classes[1] / f"moved_{first.name}")
    second.rename(classes[0] / f"moved_{second.name}")
    log = train(3, images)
    assert (
        "the data changed on resume (the same 8 entries, other ones or in another order): the samples " in log
    )
    moved = shutil.copytree(images, tmp_path / "moved")
    log = train(4, moved)
    assert f"the data changed on resume (source {images} -> {moved}): the samples after step 3" in log
    # an image's bytes replaced under its name (its neighbour's copied over it): 8 images, all sampled
    victim, donor = sorted(classes[0].iterdir())[:2]
    (moved / classes[0].name / victim.name).write_bytes(donor.read_bytes())
    log = train(5, moved)  # the phrase is new to the log: no earlier start said it
    assert "the same 8 images by name, some of them with other contents" in log, log[-2000:]
