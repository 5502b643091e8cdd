"""What a Hugging Face user expects of a training run, on the tiny model and real accelerate/tensorboard:
trackers (--report-to), sample grids while training (--sample-every), plain progress lines in a log,
--resume latest, --hflip recorded and held, and fine-tuning from one's own exported DiTPipeline.

One module-scoped workspace (test_train_e2e's) and one tracked run shared by several tests.
"""

import json

import numpy as np
import pytest
import torch
from accelerate.state import PartialState
from PIL import Image
from test_train_e2e import make_workspace, run_in_process

from dit_accel.run import checkpoint as ckpt
from dit_accel.run.weights import load_for_inference

BASE = ["--num-workers", "0", "--lr", "3e-3", "--no-progress-bar"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("conventions"))


def _args(workspace, run, *extra) -> list:
    return [
        "--plan",
        workspace["plan1"],
        "--latents",
        workspace["latents"],
        "--output-dir",
        run,
        *BASE,
        *extra,
    ]


@pytest.fixture(scope="module")
def tracked(workspace, tmp_path_factory):
    """4 steps with TensorBoard, a sample grid every 2 steps, the progress bar on (stderr is not a terminal)."""
    import io
    import sys

    capture = pytest.MonkeyPatch()
    run = tmp_path_factory.mktemp("tracked") / "run"
    err = io.StringIO()
    capture.setattr(sys, "stderr", err)
    try:
        extra = ["--max-steps", 4, "--log-every", 1, "--checkpoint-every", 2, "--report-to", "tensorboard"]
        extra += ["--sample-every", 2, "--sample-classes", "0,3", "--sample-steps", 3, "--progress-bar"]
        code = run_in_process(_args(workspace, run, *extra))
    finally:
        capture.undo()
    assert code == 0, err.getvalue()
    return {"run": run, "stderr": err.getvalue()}


def _events(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert files
    found = {}
    for path in files:
        events = EventAccumulator(str(path.parent), size_guidance={"scalars": 0, "images": 0})
        events.Reload()
        found.setdefault("scalars", {}).update({tag: events.Scalars(tag) for tag in events.Tags()["scalars"]})
        found.setdefault("images", {}).update({tag: events.Images(tag) for tag in events.Tags()["images"]})
    return found


def test_tensorboard_scalars_are_the_metrics_of_metrics_jsonl(tracked):
    metrics = [json.loads(line) for line in (tracked["run"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    scalars = _events(tracked["run"])["scalars"]
    for tag in ("loss", "lr", "grad_norm", "images_per_s"):
        assert [e.step for e in scalars[tag]] == [1, 2, 3, 4], tag
        for event, row in zip(scalars[tag], metrics):  # TensorBoard stores float32
            assert event.value == pytest.approx(row[tag], rel=1e-6), (tag, row["step"])
    assert len({m["loss"] for m in metrics}) == 4  # four different losses, not one value repeated


def test_tensorboard_shows_one_run_holding_the_hparams(tracked):
    """Accelerate's add_hparams writes the settings into a subfolder per launch, which TensorBoard lists as
    another, empty run: here every event file is in the one run folder, and that run holds the hparams."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = {path.parent for path in (tracked["run"] / "tensorboard").rglob("events.out.tfevents.*")}
    assert folders == {tracked["run"] / "tensorboard" / "dit-accel"}
    assert not [path for path in folders.pop().iterdir() if path.is_dir()]  # no hparams subfolders either
    events = EventAccumulator(str(tracked["run"] / "tensorboard" / "dit-accel"))
    events.Reload()
    hparams = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams
    assert b"ema_decay" in hparams["_hparams_/session_start_info"]  # the run's TrainConfig


NO_TENSORBOARD = """
import sys
for name in ("tensorboard", "tensorboardX", "torch.utils.tensorboard"):
    sys.modules[name] = None  # an environment without either package: importing one fails
from dit_accel.train.loop import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.launched
def test_no_tensorboard_needs_no_tensorboard_package(workspace, tmp_path):
    import subprocess
    import sys

    argv = [str(a) for a in _args(workspace, tmp_path / "run", "--max-steps", 1, "--no-tensorboard")]
    result = subprocess.run([sys.executable, "-c", NO_TENSORBOARD, *argv], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()
    assert not (tmp_path / "run" / "tensorboard").exists()
    blocked = [sys.executable, "-c", NO_TENSORBOARD, *argv[:-1], "--output-dir", str(tmp_path / "other")]
    result = subprocess.run(blocked, capture_output=True, text=True)  # TensorBoard on: refused, one line
    assert result.returncode == 2 and "the tensorboard package is not installed" in result.stderr


def test_sample_grids_go_to_the_run_folder_and_to_tensorboard(tracked):
    samples = tracked["run"] / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step_2.png", "step_4.png"]
    grids = [np.asarray(Image.open(samples / name)) for name in ("step_2.png", "step_4.png")]
    # two classes x two seeds of 64 px, in make_grid's layout, plus the class-name margin on the left
    assert grids[0].shape[0] == 2 * (64 + 2) + 2 and grids[0].shape[1] > 2 * (64 + 2) + 2
    assert not np.array_equal(grids[0], grids[1])  # the EMA moved between steps 2 and 4
    images = _events(tracked["run"])["images"]["samples"]
    assert [e.step for e in images] == [2, 4]
    decoded = np.asarray(Image.open(__import__("io").BytesIO(images[1].encoded_image_string)))
    assert np.array_equal(decoded[..., :3], grids[1])
    log = (tracked["run"] / "logs" / "rank0.log").read_text()
    assert "samples " in log and "EMA weights" in log


def test_progress_in_a_log_is_whole_lines(tracked):
    import re

    lines = [line for line in tracked["stderr"].splitlines() if re.match(r"\d+/4 step \(", line)]
    assert "\r" not in tracked["stderr"]
    # one line at the start and one per 10% (each step is 25%), none redrawn
    assert [line.split(" ")[0] for line in lines] == ["0/4", "1/4", "2/4", "3/4", "4/4"], tracked["stderr"]
    assert lines[-1].startswith("4/4 step (100%), ") and " step/s" in lines[-1]
    assert max(map(len, tracked["stderr"].splitlines())) < 300


def test_resume_latest_is_auto(workspace, tracked, tmp_path):
    from dit_accel.train.flags import parse_config

    config = parse_config([str(a) for a in _args(workspace, tmp_path / "x", "--resume", "latest")])
    assert config.resume == "auto"
    assert (
        run_in_process(
            _args(workspace, tracked["run"], "--max-steps", 5, "--resume", "latest", "--report-to", "none")
        )
        == 0
    )
    log = (tracked["run"] / "logs" / "rank0.log").read_text()
    assert (
        "at step 4" in log
        and ckpt.read_train_state(tracked["run"] / "checkpoints" / "step_00000005")["step"] == 5
    )


def test_a_resume_continues_with_the_runs_recorded_flags(workspace, tmp_path):
    """The README's resume command names no --lr, --log-every or --checkpoint-every: a resumed run takes them
    from its train_config.json (it resumed the demo at 10x lower lr before); a flag given still changes it."""
    run = tmp_path / "run"
    required = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", run]
    first = [*required, "--lr", "2e-3", "--log-every", 1, "--checkpoint-every", 2, "--num-workers", 0]
    assert run_in_process([*first, "--max-steps", 4, "--no-progress-bar", "--report-to", "none"]) == 0
    assert run_in_process([*required, "--max-steps", 6, "--resume", "auto"]) == 0
    recorded = json.loads((run / ckpt.TRAIN_CONFIG).read_text())
    assert (recorded["lr"], recorded["log_every"], recorded["checkpoint_every"]) == (2e-3, 1, 2)
    assert (recorded["max_steps"], recorded["report_to"], recorded["progress_bar"]) == (6, "none", False)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # --log-every 1 held
    assert {m["lr"] for m in metrics} == {2e-3}
    assert sorted(p.name for p in ckpt.checkpoints_dir(run).iterdir())[-1] == "step_00000006"
    log = (run / "logs" / "rank0.log").read_text()
    assert "flags not given take the run's recorded values" in log and "--lr 0.002" in log
    assert "parameters, one process;" in log and "replicated (DDP)" not in log  # nothing to replicate
    # a flag given on the resuming command line wins, and says so
    assert run_in_process([*required, "--max-steps", 7, "--resume", "auto", "--lr", "1e-3"]) == 0
    log = (run / "logs" / "rank0.log").read_text()
    assert "--lr changed on resume: 0.002 -> 0.001, applied from step 7" in log
    assert json.loads((run / ckpt.TRAIN_CONFIG).read_text())["lr"] == 1e-3


def test_what_a_resume_inherits_and_what_it_never_does(tmp_path):
    from dit_accel.train.flags import parse_config

    run = tmp_path / "run"
    run.mkdir()
    recorded = {"lr": 5e-3, "seed": 7, "betas": [0.9, 0.95], "latents": "/old/cache", "init_from": "/w"}
    recorded.update(resume="auto", plan="/old/plan.json", max_steps=100, hflip=False, unknown_key=1)
    (run / ckpt.TRAIN_CONFIG).write_text(json.dumps(recorded))
    argv = ["--plan", tmp_path / "plan.json", "--output-dir", run, "--data-path", tmp_path]
    config = parse_config([str(a) for a in [*argv, "--resume", "auto", "--seed", 0]])
    assert (config.lr, config.betas, config.max_steps, config.hflip) == (5e-3, (0.9, 0.95), 100, False)
    assert config.seed == 0  # given: the command line's, even where it is the default
    assert config.latents is None and config.data_path == str(tmp_path)  # one data source, the given one
    assert config.plan == str(tmp_path / "plan.json") and config.init_from is None
    assert parse_config([str(a) for a in argv]).lr == 1e-4  # no --resume: a new start, the defaults


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ({"lr": "2e-3"}, 'lr = "2e-3", which is not float'),
        ({"log_every": True}, "log_every = true, which is not int"),
        ({"betas": [0.9]}, "betas = [0.9], which is not a list of two numbers"),
        ({"hflip": "yes"}, 'hflip = "yes", which is not bool or null'),
    ],
    ids=["lr-string", "log-every-bool", "betas-one", "hflip-string"],
)
def test_a_recorded_setting_of_the_wrong_type_is_one_line_on_resume(
    workspace, tmp_path, capsys, edit, expected
):
    """A hand-edited train_config.json once reached the step as a TypeError traceback."""
    run = tmp_path / "run"
    required = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", run]
    assert run_in_process([*required, "--max-steps", 2, "--checkpoint-every", 2, "--num-workers", 0]) == 0
    recorded = json.loads((run / ckpt.TRAIN_CONFIG).read_text())
    (run / ckpt.TRAIN_CONFIG).write_text(json.dumps({**recorded, **edit}))
    capsys.readouterr()
    err = _one_line(capsys, [*required, "--max-steps", 3, "--resume", "auto"])
    assert expected in err and f"--{next(iter(edit)).replace('_', '-')}" in err


def _one_line(capsys, argv) -> str:
    code = run_in_process(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_a_missing_tracker_package_is_one_line(workspace, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("wandb", "tensorboard", "tensorboardX") else real(name, *a),
    )
    err = _one_line(capsys, _args(workspace, tmp_path / "w", "--max-steps", 1, "--report-to", "wandb"))
    assert "the wandb package is not installed" in err and "dit-accel[wandb]" in err
    err = _one_line(capsys, _args(workspace, tmp_path / "t", "--max-steps", 1))  # the default, tensorboard
    assert "the tensorboard package is not installed" in err
    err = _one_line(capsys, _args(workspace, tmp_path / "b", "--report-to", "mlflow"))
    assert "--report-to 'mlflow'" in err
    assert (
        not (tmp_path / "w").exists() and not (tmp_path / "t").exists()
    )  # refused before anything is written
    # all: every installed tracker (here none), so the run logs to its text files only
    assert run_in_process(_args(workspace, tmp_path / "all", "--max-steps", 1, "--report-to", "all")) == 0
    assert not (tmp_path / "all" / "tensorboard").exists()


def test_hflip_follows_the_cache_is_recorded_and_held_on_resume(workspace, tmp_path, capsys):
    from dit_accel.data.latents import ExtractConfig, extract_latents
    from dit_accel.data.latents import build_parser as extract_parser

    assert (
        extract_parser().parse_args(["--data-path", "d", "--vae", "v", "--out", "o", "--no-flip"]).flip
        is False
    )
    assert (
        extract_parser().parse_args(["--data-path", "d", "--vae", "v", "--out", "o", "--no-hflip"]).flip
        is False
    )
    assert extract_parser().parse_args(["--data-path", "d", "--vae", "v", "--out", "o"]).flip is True
    from dit_accel.data.demo import write_demo_data

    write_demo_data(tmp_path / "images", classes=4, per_class=2, resolution=64, seed=0)
    cache = tmp_path / "noflip"
    extract_latents(
        ExtractConfig(
            data_path=str(tmp_path / "images"),
            vae=str(workspace["vae"]),
            resolution=64,
            out=str(cache),
            batch_size=16,
            shard_size=64,
            num_workers=0,
            flip=False,
        )
    )
    assert json.loads((cache / "manifest.json").read_text())["flip"] is False
    capsys.readouterr()
    no_flip = [
        "--plan",
        workspace["plan1"],
        "--latents",
        cache,
        *BASE,
        "--report-to",
        "none",
        "--max-steps",
        1,
    ]
    err = _one_line(capsys, [*no_flip, "--output-dir", tmp_path / "a", "--hflip"])
    assert "--hflip" in err and "--no-hflip" in err and str(cache) in err
    assert run_in_process([*no_flip, "--output-dir", tmp_path / "b"]) == 0  # unset: the cache's own setting
    assert json.loads((tmp_path / "b" / "train_config.json").read_text())["hflip"] is False

    # A two-view cache flips unless told not to; a resumed run keeps what it trained with.
    run = tmp_path / "c"
    assert run_in_process(_args(workspace, run, "--report-to", "none", "--max-steps", 1)) == 0
    assert json.loads((run / "train_config.json").read_text())["hflip"] is True
    err = _one_line(
        capsys,
        _args(workspace, run, "--report-to", "none", "--max-steps", 2, "--resume", "auto", "--no-hflip"),
    )
    assert "trained with --hflip" in err and "new --output-dir" in err
    assert (
        run_in_process(
            _args(workspace, run, "--report-to", "none", "--max-steps", 2, "--resume", "auto", "--hflip")
        )
        == 0
    )


def test_fine_tune_from_an_exported_pipeline_round_trip(workspace, tmp_path, capsys):
    """train -> export (class table padded to 1,000 for DiTPipeline) -> train --init-from the pipeline."""
    from dit_accel.convert.export import main as export_main
    from dit_accel.models.diffusers_format import load_model
    from dit_accel.models.dit import conditioning_embedder
    from dit_accel.train.resume import read_init_weights
    from planner.planfile import read_plan

    source = tmp_path / "source"
    assert (
        run_in_process(
            _args(workspace, source, "--report-to", "none", "--max-steps", 2, "--ema-decay", "0.5")
        )
        == 0
    )
    pipe = tmp_path / "pipe"
    capsys.readouterr()
    assert export_main(["--checkpoint", str(source), "--out", str(pipe)]) == 0
    # 2 updates at decay 0.5: a quarter of the EMA is still its start, said as `sample` says it (once silent)
    err = capsys.readouterr().err
    assert "dit-accel export: warning: the EMA weights are still 25% their initial weights" in err
    assert "the pipeline's images will look untrained; export the trained weights with --no-ema" in err
    exported = load_model(pipe)
    assert conditioning_embedder(exported).class_embedder.embedding_table.weight.shape[0] == 1001
    assert json.loads((pipe / "transformer" / "dit_accel_export.json").read_text())["num_classes"] == 4

    spec = read_plan(workspace["plan1"]).spec()
    init = read_init_weights(str(pipe), spec)
    ema, _, _ = load_for_inference(source, use_ema=True)
    for name, param in ema.named_parameters():  # the run's own EMA, its 5-row class table back
        assert torch.equal(init.parameters[name], param), name

    tuned = tmp_path / "tuned"
    assert (
        run_in_process(_args(workspace, tuned, "--report-to", "none", "--max-steps", 1, "--init-from", pipe))
        == 0
    )
    assert str(pipe) in ckpt.read_train_state(tuned / "checkpoints" / "step_00000001")["init_from"]

    # Padding rows that are not the null row are real classes: refused, as is a plan for another class count.
    table = conditioning_embedder(exported).class_embedder.embedding_table.weight
    with torch.no_grad():
        table[7] += 1.0
    from dit_accel.models.diffusers_format import save_model

    save_model(exported, tmp_path / "edited")
    err = _one_line(
        capsys, _args(workspace, tmp_path / "e", "--max-steps", 1, "--init-from", tmp_path / "edited")
    )
    assert "num_classes 1000 (wanted 4)" in err and "not export's padding" in err


@pytest.mark.launched  # two real processes, a zero3 (FSDP2) plan: the EMA is sharded
def test_sample_every_under_fsdp_gathers_the_sharded_ema(tmp_path):
    from test_train_fsdp import _plan, _start

    from dit_accel.data.demo import write_demo_data
    from dit_accel.images import make_grid
    from dit_accel.sample.generate import SampleSettings, sample_images
    from dit_accel.train.samples import SAMPLES_PER_CLASS

    write_demo_data(tmp_path / "images", classes=4, per_class=2, resolution=32, seed=0)
    plan_dir = _plan(tmp_path / "plan", "--sharding", "zero3", "--precision", "fp32")
    args = [
        "--max-steps",
        2,
        "--sample-every",
        2,
        "--sample-classes",
        "1,2",
        "--sample-steps",
        3,
        "--ema-decay",
        0.5,
    ]
    run, process = _start(plan_dir, tmp_path / "images", tmp_path / "run", *args)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    grid = np.asarray(Image.open(run / "samples" / "step_2.png"))

    # The same grid from the checkpoint's EMA (saved full) in this one process: what the sharded run sampled.
    model, spec, info = load_for_inference(run, use_ema=True)
    assert info["weights"] == "ema" and info["step"] == 2
    labels = [1, 1, 2, 2]
    settings = SampleSettings(cfg_scale=4.0, steps=3, seed=0)
    images = sample_images(model, spec, lambda x: x.clamp(-1, 1), labels, range(4), settings)
    expected = make_grid(images, SAMPLES_PER_CLASS)
    margin = grid.shape[1] - expected.shape[1]
    assert margin > 0 and np.abs(grid[:, margin:].astype(int) - expected.astype(int)).max() <= 1


def test_a_latent_cache_changed_under_a_resumed_run_is_announced(workspace, tmp_path):
    """Another cache (other images encoded) under a resumed run: once silent when it had as many entries."""
    from dit_accel.data.demo import write_demo_data
    from dit_accel.data.latents import ExtractConfig, extract_latents

    other = tmp_path / "other"
    write_demo_data(tmp_path / "images", classes=4, per_class=16, resolution=64, seed=9)
    extract_latents(
        ExtractConfig(
            data_path=str(tmp_path / "images"),
            vae=str(workspace["vae"]),
            resolution=64,
            out=str(other),
            batch_size=16,
            shard_size=64,
            num_workers=0,
        )
    )
    PartialState._reset_state()
    run = tmp_path / "run"
    required = [
        "--plan",
        workspace["plan1"],
        "--output-dir",
        run,
        "--num-workers",
        0,
        "--checkpoint-every",
        1,
    ]
    assert run_in_process([*required, "--latents", workspace["latents"], "--max-steps", 1]) == 0
    assert run_in_process([*required, "--latents", other, "--max-steps", 2, "--resume", "auto"]) == 0
    log = (run / "logs" / "rank0.log").read_text()
    assert (
        f"the data changed on resume (source {workspace['latents']} -> {other}): the samples after step 1"
        in log
    )
    state = ckpt.read_train_state(run / "checkpoints" / "step_00000002")
    assert state["data"]["source"] == str(other) and state["data"]["entries"] == 64


def test_resuming_under_a_plan_of_the_other_objective_names_the_run_not_a_flag(workspace, tmp_path, capsys):
    """A ddpm run resumed under a flow plan blamed `--objective ddpm`, a flag the user never typed (the
    value came from the run's train_config.json): the message names the run, what it trains, and the two
    ways out. A flag typed now still gets the flag's message."""
    plan = json.loads(workspace["plan1"].read_text())
    flow = tmp_path / "flow.json"
    flow.write_text(json.dumps(dict(plan, objective="flow")))
    run = tmp_path / "run"
    required = ["--latents", workspace["latents"], "--output-dir", run, "--num-workers", 0]
    assert run_in_process(["--plan", workspace["plan1"], *required, "--max-steps", 1]) == 0
    capsys.readouterr()
    err = _one_line(capsys, ["--plan", flow, *required, "--max-steps", 2, "--resume", "auto"])
    assert f"the run in {run} trains ddpm (its recorded settings {run / ckpt.TRAIN_CONFIG} say so)" in err
    assert "plans flow; resume it under a plan made with `dit-plan --objective ddpm`, or train flow" in err
    assert "drop --objective" not in err
    fresh = ["--output-dir", tmp_path / "fresh", "--latents", workspace["latents"], "--max-steps", 1]
    err = _one_line(capsys, ["--plan", flow, *fresh, "--objective", "ddpm"])
    assert "--objective ddpm contradicts the plan's objective flow" in err
