"""The trainer end to end on the CPU: plans written by dit-plan, demo data, a latent cache made with a tiny
AutoencoderKL, real accelerate (in-process for one process, `accelerate launch` over gloo for two).

One module-scoped workspace (VAE, images, latents, plans) and a few shared runs keep this under a minute.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence import has_true_gradient
from ports import launch_port
from safetensors.torch import load_file

from dit_accel.run import checkpoint as ckpt
from dit_accel.run.weights import load_for_inference

TINY_MODEL = [
    "--model",
    "DiT-S/2",
    "--depth",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--resolution",
    "64",
    "--num-classes",
    "4",
    "--vram",
    "8G",
    "--precision",
    "fp32",
]
STEPS = 24  # long enough for the loss to fall clearly at lr 3e-3; a checkpoint at 12 and at 24
QUIET = ["--num-workers", "0", "--no-progress-bar", "--log-every", "1", "--lr", "3e-3"]
WARMUP = ["--warmup-steps", "4"]


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("DIT_ACCEL_INJECT_NAN", "DIT_ACCEL_CRASH_BEFORE_COMMIT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    env.update(extra)
    return env


def _make_plan(out: Path, gpus: int, micro_batch: int, grad_accum: int, global_batch: int = 8) -> Path:
    """`dit-plan` writes plan.json and accelerate_config.yaml; --max-micro-batch pins the layout compared."""
    from planner.cli import main as dit_plan

    assert (
        dit_plan(
            [
                *TINY_MODEL,
                "--gpus",
                str(gpus),
                "--global-batch",
                str(global_batch),
                "--sharding",
                "ddp",
                "--checkpointing",
                "1",
                "--max-micro-batch",
                str(micro_batch),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["decision"]["micro_batch"], plan["decision"]["grad_accum"]) == (micro_batch, grad_accum)
    assert plan["decision"]["checkpointed_blocks"] == 1 and plan["decision"]["precision"] == "fp32"
    return out / "plan.json"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("train"))


def make_workspace(root: Path) -> dict:
    """Demo images, a tiny VAE, the latent cache, and plans for 1 and 2 processes (global batch 8)."""
    from dit_accel.data.demo import demo_vae, write_demo_data
    from dit_accel.data.latents import ExtractConfig, extract_latents

    demo_vae(64).save_pretrained(root / "vae")
    write_demo_data(root / "images", classes=4, per_class=16, resolution=64, seed=0)
    extract_latents(
        ExtractConfig(
            data_path=str(root / "images"),
            vae=str(root / "vae"),
            resolution=64,
            out=str(root / "latents"),
            batch_size=16,
            shard_size=64,
            num_workers=0,
        )
    )
    return {
        "root": root,
        "latents": root / "latents",
        "images": root / "images",
        "vae": root / "vae",
        "plan1": _make_plan(root / "plan1", gpus=1, micro_batch=8, grad_accum=1),
        "plan2": _make_plan(root / "plan2", gpus=2, micro_batch=2, grad_accum=2),
    }


def run_in_process(argv: list[str], env: dict | None = None) -> int:
    """`python -m dit_accel.train ARGV` in this process (one process, no launcher), state reset around it.

    With one intra-op thread, as the launched processes (OMP_NUM_THREADS=1): a run continued in another
    process then repeats the same float computation, whatever the CPU's kernels split across threads."""
    from accelerate.state import AcceleratorState, GradientState

    from dit_accel.train.loop import main

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    saved = {name: os.environ.get(name) for name in (env or {})}
    os.environ.update(env or {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def launch_command(workspace, out: Path, *args, processes=2) -> list[str]:
    """`accelerate launch` of the trainer on the workspace's plan and latents, as a user types it."""
    plan = workspace[f"plan{processes}"]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launcher += [str(plan.parent / "accelerate_config.yaml"), "--num_processes", str(processes)]
    trainer = ["-m", "dit_accel.train", "--plan", str(plan), "--latents", str(workspace["latents"])]
    return [
        *launcher,
        "--main_process_port",
        launch_port(),
        *trainer,
        "--output-dir",
        str(out),
        *QUIET,
        *map(str, args),
    ]


def _launch(workspace, out: Path, *args, env=None, processes=2) -> subprocess.CompletedProcess:
    command = launch_command(workspace, out, *args, processes=processes)
    return subprocess.run(command, env=_env(**(env or {})), capture_output=True, text=True, timeout=300)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checksums(run_dir: Path, rank: int) -> dict[int, str]:
    found = {}
    for line in (run_dir / "logs" / f"rank{rank}.log").read_text().splitlines():
        if " checksum step " in line:
            step, value = line.split(" checksum step ")[1].split()
            found[int(step)] = value
    return found


def assert_same_rng(a: Path, b: Path) -> None:
    """Every rank's saved python, numpy and torch RNG states are the same in two checkpoints: a resumed run's
    global RNGs continue as the straight run's do (the DataLoader draws its seed from its own generator)."""
    import numpy as np

    files = sorted(path.name for path in a.glob("random_states_*.pkl"))
    assert files and files == sorted(path.name for path in b.glob("random_states_*.pkl"))
    for name in files:
        first, second = (torch.load(folder / name, weights_only=False) for folder in (a, b))
        assert first["random_state"] == second["random_state"], name
        assert all(
            np.array_equal(x, y) for x, y in zip(first["numpy_random_seed"], second["numpy_random_seed"])
        )
        assert torch.equal(first["torch_manual_seed"], second["torch_manual_seed"]), name


def assert_same_state(
    a: Path, b: Path, exact: bool = True, atol: float = 0.0, layouts_differ: bool = False
) -> None:
    """Weights, EMA and AdamW moments of two checkpoints: bit-identical, or within atol. Parameters whose
    `layouts_differ`: the runs differ in process layout, so parameters without a true gradient
    (tests/equivalence.py) are left out of the weight and EMA comparison."""

    def same(x, y):
        return torch.equal(x, y) if exact else torch.allclose(x, y, atol=atol, rtol=0)

    for name in (ckpt.MODEL_WEIGHTS, ckpt.EMA_WEIGHTS):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys()
        differing = [
            key for key in x if (has_true_gradient(key) or not layouts_differ) and not same(x[key], y[key])
        ]
        assert not differing, f"{name}: {differing[:3]} differ"
    x, y = (torch.load(c / "optimizer.bin", weights_only=False)["state"] for c in (a, b))
    assert x.keys() == y.keys()
    for key in x:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert same(x[key][field], y[key][field]), f"optimizer state {key}.{field} differs"


# --- one process, in-process -------------------------------------------------------------------------------


def test_a_resumed_ema_warmup_continues_its_ramp_exactly(workspace, tmp_path):
    """The warm-up's position is the number of EMA updates, restored from the checkpoint's applied steps."""
    common = ["--plan", workspace["plan1"], "--latents", workspace["latents"], *QUIET, "--no-tensorboard"]
    common += ["--checkpoint-every", 2, "--ema-warmup"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_in_process([*common, "--max-steps", 4, "--output-dir", straight]) == 0
    assert run_in_process([*common, "--max-steps", 2, "--output-dir", resumed]) == 0
    assert run_in_process([*common, "--max-steps", 4, "--output-dir", resumed, "--resume", "auto"]) == 0
    final = "checkpoints/step_00000004"
    assert_same_state(straight / final, resumed / final)
    ema = load_file(str(straight / final / ckpt.EMA_WEIGHTS))
    weights = load_file(str(straight / final / ckpt.MODEL_WEIGHTS))
    # 4 updates with warm-up: the EMA follows the weights closely, where 0.9999 would barely have moved
    worst = max((ema[k] - weights[k]).abs().max().item() for k in ema)
    start = {
        k: v for k, v in load_file(str(straight / "checkpoints/step_00000002" / ckpt.MODEL_WEIGHTS)).items()
    }
    moved = max((weights[k] - start[k]).abs().max().item() for k in weights)
    assert worst < moved


@pytest.mark.launched  # the killed run is a real subprocess
def test_exact_resume_one_process_and_a_killed_checkpoint_is_never_loaded(workspace, tmp_path):
    common = [
        "--plan",
        workspace["plan1"],
        "--latents",
        workspace["latents"],
        *QUIET,
        "--no-tensorboard",
        "--max-steps",
        4,
        "--checkpoint-every",
        2,
    ]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert run_in_process([*common, "--output-dir", straight]) == 0

    # The same run, killed (os._exit) after writing step 4's files and before its COMPLETE marker.
    killed = subprocess.run(
        [sys.executable, "-m", "dit_accel.train", *map(str, common), "--output-dir", str(interrupted)],
        env=_env(DIT_ACCEL_CRASH_BEFORE_COMMIT="4"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == 137, killed.stderr[-2000:]
    partial = interrupted / "checkpoints" / "step_00000004.tmp"
    assert (partial / "model.safetensors").exists() and not (partial / ckpt.COMPLETE).exists()
    assert ckpt.latest_checkpoint(interrupted).name == "step_00000002"

    assert run_in_process([*common, "--output-dir", interrupted, "--resume", "auto"]) == 0
    log_text = (interrupted / "logs" / "rank0.log").read_text()
    assert "resumed from" in log_text and "step_00000002 at step 2" in log_text
    assert_same_state(
        straight / "checkpoints" / "step_00000004", interrupted / "checkpoints" / "step_00000004"
    )
    assert_same_rng(straight / "checkpoints" / "step_00000004", interrupted / "checkpoints" / "step_00000004")
    assert not partial.exists()  # cleaned once a newer checkpoint was committed
    state = ckpt.read_train_state(interrupted / "checkpoints" / "step_00000004")
    assert (state["step"], state["applied_steps"], state["world_size"], state["global_batch"]) == (4, 4, 1, 8)
    assert (state["epoch"], state["samples_into_epoch"]) == (0, 32)

    # A resumed run that is already at --max-steps does nothing; load_for_inference reads the EMA weights.
    assert run_in_process([*common, "--output-dir", straight, "--resume", "auto"]) == 0
    model, spec, info = load_for_inference(straight)
    assert (spec.depth, spec.hidden, info["step"], info["weights"]) == (2, 32, 4, "ema")
    ema = load_file(str(straight / "checkpoints" / "step_00000004" / ckpt.EMA_WEIGHTS))
    assert all(torch.equal(p, ema[n]) for n, p in model.named_parameters())
    raw, _, raw_info = load_for_inference(straight / "checkpoints" / "step_00000004", use_ema=False)
    assert raw_info["weights"] == "model"
    assert not torch.equal(raw.proj_out_2.weight, model.proj_out_2.weight)  # EMA lags the weights


def test_nan_aborts_naming_the_step_and_the_last_good_checkpoint(workspace, tmp_path, capsys):
    common = [
        "--plan",
        workspace["plan1"],
        "--latents",
        workspace["latents"],
        *QUIET,
        "--no-tensorboard",
        "--max-steps",
        5,
        "--checkpoint-every",
        2,
    ]
    rc = run_in_process([*common, "--output-dir", tmp_path / "abort"], env={"DIT_ACCEL_INJECT_NAN": "3"})
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3
    assert "non-finite loss or gradient at step 3" in err[-1] and "step_00000002" in err[-1]
    assert [p.name for p in (tmp_path / "abort" / "checkpoints").iterdir()] == ["step_00000002"]

    # skip: the step changes nothing (AdamW counted 3 updates in 4 steps), the run goes on; bounded.
    assert (
        run_in_process(
            [*common, "--max-steps", 4, "--output-dir", tmp_path / "skip", "--nan-policy", "skip"],
            env={"DIT_ACCEL_INJECT_NAN": "3"},
        )
        == 0
    )
    final = tmp_path / "skip" / "checkpoints" / "step_00000004"
    state = ckpt.read_train_state(final)
    assert (state["step"], state["applied_steps"], state["skipped_steps"]) == (4, 3, 1)
    optimizer = torch.load(final / "optimizer.bin", weights_only=False)
    assert all(s["step"].item() == 3 for s in optimizer["state"].values())
    scheduler = json.loads((final / "lr_scheduler.json").read_text())
    assert scheduler["last_epoch"] == 3
    assert (
        run_in_process(
            [
                *common,
                "--output-dir",
                tmp_path / "bounded",
                "--nan-policy",
                "skip",
                "--max-skipped-steps",
                "0",
            ],
            env={"DIT_ACCEL_INJECT_NAN": "1"},
        )
        == 3
    )
    assert "more than --max-skipped-steps 0" in capsys.readouterr().err


def _one_line_error(capsys, argv, env=None) -> str:
    rc = run_in_process(argv, env=env)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_plan_and_data_mismatches_are_one_line_errors(workspace, tmp_path, capsys):
    base = [
        "--latents",
        workspace["latents"],
        "--output-dir",
        tmp_path / "run",
        *QUIET,
        "--no-tensorboard",
        "--max-steps",
        1,
    ]
    plan = json.loads(workspace["plan1"].read_text())

    def variant(name, **changes):
        edited = json.loads(json.dumps(plan))
        for dotted, value in changes.items():
            section, _, key = dotted.rpartition(".")
            (edited[section] if section else edited)[key] = value
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(edited))
        return path

    err = _one_line_error(capsys, ["--plan", variant("schema", schema="dit-plan/99"), *base])
    assert "schema 'dit-plan/99'" in err and "re-plan" in err
    err = _one_line_error(capsys, ["--plan", workspace["plan2"], *base])
    assert "planned for 2 processes but 1 was launched" in err and "dit-plan --gpus 1" in err
    err = _one_line_error(
        capsys,
        ["--plan", workspace["plan1"], "--data-path", workspace["images"], "--output-dir", tmp_path / "run"],
    )
    assert "precomputed latents; pass --latents" in err
    online = variant("online", **{"decision.latents": "online"})
    err = _one_line_error(
        capsys, ["--plan", online, "--data-path", workspace["images"], "--output-dir", tmp_path / "r"]
    )
    assert "pass --vae DIR" in err
    err = _one_line_error(capsys, ["--plan", variant("res", **{"model.resolution": 128}), *base])
    assert "64 px" in err and "128 px" in err
    err = _one_line_error(
        capsys, ["--plan", variant("classes", **{"inputs.num_classes": 2, "model.num_classes": 2}), *base]
    )
    assert "4 classes" in err and "--num-classes 4" in err

    # Resuming a run with another model or global batch than its checkpoints were trained with.
    assert run_in_process(["--plan", workspace["plan1"], *base, "--checkpoint-every", 1]) == 0
    capsys.readouterr()
    wider = variant("wider", **{"inputs.hidden": 64, "model.hidden": 64})
    err = _one_line_error(capsys, ["--plan", wider, *base, "--resume", "auto", "--max-steps", 2])
    assert "holds a" in err and "use the run's own plan" in err
    bigger = variant("bigger", global_batch=16, **{"decision.micro_batch": 16})
    err = _one_line_error(capsys, ["--plan", bigger, *base, "--resume", "auto", "--max-steps", 2])
    assert "global batch 8" in err and "16" in err


def test_a_step_that_waits_for_its_images_says_so_once(workspace, tmp_path):
    """A pixel run on 2000 x 1500 JPEGs decoded in the main process (--num-workers 0): each step's 8 decodes
    take far longer than the tiny network's step, so metrics.jsonl shows the time spent waiting for data.
    What holds on any box is asserted (the share is measured, between 0 and 1, and logged); the warning's
    rule is tested on given shares (`test_the_data_wait_warning_comes_once_from_the_second_window`)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(4):
        (tmp_path / "photos" / f"class_{c}").mkdir(parents=True)
        for i in range(2):  # smooth noise compresses like a photograph
            small = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
            photo = Image.fromarray(small).resize((2000, 1500), Image.BICUBIC)
            photo.save(tmp_path / "photos" / f"class_{c}" / f"{i}.jpg", quality=90)
    plan = json.loads(workspace["plan1"].read_text())
    plan["decision"]["latents"], plan["model"]["resolution"] = "pixel", 8
    (tmp_path / "pixel.json").write_text(json.dumps(plan))
    out = tmp_path / "run"
    argv = ["--plan", tmp_path / "pixel.json", "--data-path", tmp_path / "photos", "--output-dir", out]
    assert run_in_process([*argv, *QUIET, "--no-tensorboard", "--max-steps", 4, "--checkpoint-every", 4]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(0 <= line["data_wait_fraction"] <= 1 for line in lines)
    text = (out / "logs" / "rank0.log").read_text()
    assert text.count("the step waited for its batches") <= 1 and "| data wait " in text


def test_the_data_wait_warning_comes_once_from_the_second_window(caplog):
    """The rule apart from any timing: above the threshold, from the second logged window on (the first
    holds the workers' start), once per run, with the advice for what the workers do."""
    import logging
    from types import SimpleNamespace

    from dit_accel.train.steplog import DATA_WAIT_WARN_FRACTION, StepLog
    from planner.decision import Decision

    decision = Decision(8, 1, 0, precision="fp32", sharding="ddp", latents="pixel")
    log = SimpleNamespace(windows=0, warned_data_wait=False, plan=SimpleNamespace(decision=decision))
    with caplog.at_level(logging.WARNING, logger="dit_accel.train"):
        StepLog._warn_data_wait(log, 0.99, 1, 1)  # the first window: never
        StepLog._warn_data_wait(log, DATA_WAIT_WARN_FRACTION / 2, 2, 1)  # below the threshold
        StepLog._warn_data_wait(log, 0.9, 3, 1)
        StepLog._warn_data_wait(log, 0.95, 4, 1)  # said once already
    warnings = [r.getMessage() for r in caplog.records if "waited for its batches" in r.getMessage()]
    assert warnings == [
        "the step waited for its batches 90% of the time of steps 3-3 (the slowest rank): the GPUs idle that "
        "long; raise --num-workers or train on precomputed latents (`dit-accel extract-latents`) (`dit-accel "
        "doctor` times the decode against the plan: its `decode rate` row)"
    ]


@pytest.mark.parametrize(
    ("latents", "repa", "says", "never"),
    [
        ("online", "", "train on precomputed latents", "storage"),
        ("pixel", "", "train on precomputed latents", "storage"),
        (
            "precomputed",
            "dinov2-b",
            "REPA's workers decode each latent's source image",
            "precomputed latents",
        ),
        ("precomputed", "", "put the cache on local disk", "precomputed latents"),
    ],
)
def test_the_data_wait_advice_fits_what_the_workers_do(latents, repa, says, never):
    """A run already on precomputed latents was told to train on precomputed latents."""
    from dit_accel.train.steplog import data_wait_advice
    from planner.decision import Decision

    decision = Decision(8, 1, 0, precision="bf16", sharding="ddp", latents=latents, repa=repa)
    advice = data_wait_advice(decision)
    assert says in advice and never not in advice


def test_online_vae_and_pixel_modes_train(workspace, tmp_path):
    """The other two latent modes of a plan: images encoded by the VAE each step, and pixel space."""
    plan = json.loads(workspace["plan1"].read_text())
    for mode, extra in (("online", ["--vae", workspace["vae"]]), ("pixel", [])):
        edited = json.loads(json.dumps(plan))
        edited["decision"]["latents"] = mode
        if mode == "pixel":  # a pixel-space DiT at 8 px: 3 channels, same token count as 8x8 latents
            edited["model"]["resolution"] = 8
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(edited))
        out = tmp_path / mode
        images = workspace["images"]
        if mode == "pixel":
            from dit_accel.data.demo import write_demo_data

            images = write_demo_data(tmp_path / "images8", classes=4, per_class=4, resolution=8, seed=1)
        assert (
            run_in_process(
                [
                    "--plan",
                    path,
                    "--data-path",
                    images,
                    "--output-dir",
                    out,
                    *QUIET,
                    "--no-tensorboard",
                    "--max-steps",
                    2,
                    "--checkpoint-every",
                    2,
                    *extra,
                ]
            )
            == 0
        )
        losses = _losses(out)
        assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
        state = ckpt.read_train_state(out / "checkpoints" / "step_00000002")
        assert state["applied_steps"] == 2


# --- two processes with accelerate launch -----------------------------------------------------------------


@pytest.mark.launched
def test_two_processes_train_in_step_resume_exactly_and_match_one_process(workspace, tmp_path):
    straight = tmp_path / "straight"
    result = _launch(
        workspace,
        straight,
        "--max-steps",
        STEPS,
        "--checkpoint-every",
        STEPS // 2,
        "--debug-checksums",
        *WARMUP,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Identical parameters on both ranks after every optimizer step.
    rank0, rank1 = _checksums(straight, 0), _checksums(straight, 1)
    assert sorted(rank0) == list(range(1, STEPS + 1)) and rank0 == rank1
    # The loss (averaged over both ranks) falls.
    losses = _losses(straight)
    assert len(losses) == STEPS
    assert sum(losses[-6:]) / 6 < 0.7 * sum(losses[:6]) / 6, losses
    # One lr-schedule step per optimizer step with 2 processes (a prepared scheduler would take 2).
    lrs = [json.loads(line)["lr"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert lrs[:6] == pytest.approx([7.5e-4, 1.5e-3, 2.25e-3, 3e-3, 3e-3, 3e-3])
    assert list((straight / "tensorboard").rglob("events.out.tfevents.*"))
    assert "world size 2 x micro-batch 2 x accumulation 2 = global batch 8" in result.stdout

    # Stop at the half-way checkpoint, then resume with 2 processes: bit-identical to the straight run.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    half = f"step_{STEPS // 2:08d}"
    shutil.copytree(straight / "checkpoints" / half, resumed / "checkpoints" / half)
    result = _launch(
        workspace,
        resumed,
        "--max-steps",
        STEPS,
        "--checkpoint-every",
        STEPS // 2,
        "--resume",
        "auto",
        *WARMUP,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    final = f"step_{STEPS:08d}"
    assert_same_state(straight / "checkpoints" / final, resumed / "checkpoints" / final)

    # 1 process x micro 8 x accum 1 sees the same samples, noise and timesteps: the same losses and update.
    single = tmp_path / "single"
    assert (
        run_in_process(
            [
                "--plan",
                workspace["plan1"],
                "--latents",
                workspace["latents"],
                "--output-dir",
                single,
                *QUIET,
                *WARMUP,
                "--no-tensorboard",
                "--max-steps",
                STEPS // 2,
                "--checkpoint-every",
                STEPS,
            ]
        )
        == 0
    )
    assert _losses(single) == pytest.approx(losses[: STEPS // 2], rel=1e-5, abs=1e-6)
    # Same update for every parameter with a gradient; the key biases have none (tests/equivalence.py):
    # their first AdamW moment is rounding noise in both runs, many orders below any real gradient's.
    assert_same_state(
        straight / "checkpoints" / half,
        single / "checkpoints" / half,
        exact=False,
        atol=1e-5,
        layouts_differ=True,
    )
    from dit_accel.run.weights import load_for_inference

    model, _spec, _info = load_for_inference(single, use_ema=False)
    order = [name for name, param in model.named_parameters() if param.requires_grad]  # AdamW's state order
    for run in (straight, single):
        moments = torch.load(run / "checkpoints" / half / "optimizer.bin", weights_only=False)["state"]
        assert len(moments) == len(order)
        noise = max(
            moments[i]["exp_avg"].abs().max().item()
            for i, name in enumerate(order)
            if not has_true_gradient(name)
        )
        signal = max(moment["exp_avg"].abs().max().item() for moment in moments.values())
        assert noise < 1e-6 * signal, (noise, signal)


@pytest.mark.launched
def test_a_finished_rank_ends_without_the_teardown_that_frees_its_process_group(workspace, tmp_path):
    """A rank that trained and saved must exit 0, not hang or abort: freeing the gloo group joins its workers
    under the GIL (a deadlock when one still drops its last tensors), and the interpreter's teardown, which
    frees it otherwise, aborts such a worker (SIGABRT). dit_accel.distributed.accelerator.end_process_group keeps the
    group, and exit_command ends the rank with os._exit: the probe's atexit line never prints."""
    from teardown_probe import SCRIPT, teardowns

    command = launch_command(workspace, tmp_path / "run", "--max-steps", 2, "--no-tensorboard")
    at = command.index("dit_accel.train")
    command[at - 1 : at] = [SCRIPT]  # `-m dit_accel.train` -> `teardown_probe.py dit_accel.train`
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert teardowns(result.stderr) == [], result.stderr[-3000:]
    for rank in (0, 1):  # and what it wrote before os._exit is all there
        assert "done: step 2" in (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
    assert ckpt.marker_id(tmp_path / "run" / "checkpoints" / "step_00000002")


@pytest.mark.launched
def test_two_processes_agree_on_a_nan_seen_by_one_rank(workspace, tmp_path):
    run = tmp_path / "nan"
    result = _launch(
        workspace,
        run,
        "--max-steps",
        4,
        "--checkpoint-every",
        2,
        "--debug-checksums",
        env={"DIT_ACCEL_INJECT_NAN": "3:1"},
    )  # only rank 1's loss is poisoned
    assert result.returncode != 0
    assert result.stderr.count("non-finite loss or gradient at step 3") == 1  # said once, by rank 0
    assert "step_00000002" in result.stderr
    for rank in (0, 1):
        text = (run / "logs" / f"rank{rank}.log").read_text()
        assert "non-finite loss or gradient at step 3" in text
    # Both ranks stopped after step 3 without applying it: their weights still agree.
    checksums = _checksums(run, 0)
    assert checksums == _checksums(run, 1) and max(checksums) == 3
    assert checksums[3] == checksums[2]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]


# --- fine-tuning from other weights (--init-from) -----------------------------------------------------------


def _imported_original(tmp_path: Path) -> Path:
    """An original-repository DiT state dict of the plans' tiny network, through `dit-accel import-dit`."""
    from test_export import HEADS, original_state_dict

    from dit_accel.convert.imports import import_main

    torch.save(original_state_dict(num_classes=4, seed=3), tmp_path / "DiT-tiny.pt")
    assert (
        import_main(
            [
                "--checkpoint",
                str(tmp_path / "DiT-tiny.pt"),
                "--out",
                str(tmp_path / "imported"),
                "--heads",
                str(HEADS),
            ]
        )
        == 0
    )
    return tmp_path / "imported"


def test_fine_tune_from_an_imported_original_dit(workspace, tmp_path, capsys):
    from dit_accel.models.diffusers_format import read_sidecar, save_model
    from dit_accel.models.dit import build_model, timestep_freq_shift
    from dit_accel.train.config import TrainConfig
    from dit_accel.train.resume import read_init_weights
    from dit_accel.train.step import build_components
    from planner.planfile import read_plan, spec_from_plan

    imported = _imported_original(tmp_path)
    original = load_file(str(imported / "checkpoints" / "step_00000000" / ckpt.MODEL_WEIGHTS))

    # Step 0 of the new run: the imported weights, the EMA equal to them, the original's shift, a fresh AdamW.
    plan = read_plan(workspace["plan1"])
    init = read_init_weights(str(imported), spec_from_plan(plan))
    assert init.timestep_freq_shift == 0
    config = TrainConfig(
        plan=str(workspace["plan1"]),
        output_dir=str(tmp_path / "unused"),
        latents=str(workspace["latents"]),
        init_from=str(imported),
    )
    components = build_components(plan, config, device="cpu", init=init)
    assert timestep_freq_shift(components.raw_model) == 0 and not components.optimizer.state
    for name, param in components.raw_model.named_parameters():
        assert torch.equal(param, original[name]) and torch.equal(
            components.ema.shadow[name], original[name]
        ), name
    # A diffusers folder is a source too (stock diffusers' shift, 1, unless its dit_accel.json says otherwise).
    saved = save_model(build_model(spec_from_plan(plan)), tmp_path / "diffusers")
    assert read_init_weights(str(saved), spec_from_plan(plan)).timestep_freq_shift == 1

    # Train 2 steps from the import: every checkpoint carries shift 0 and names where the run began.
    run = tmp_path / "finetune"
    common = [
        "--plan",
        workspace["plan1"],
        "--latents",
        workspace["latents"],
        "--output-dir",
        run,
        *QUIET,
        "--no-tensorboard",
        "--checkpoint-every",
        1,
        "--init-from",
        imported,
    ]
    assert run_in_process([*common, "--max-steps", 2]) == 0
    assert "initialized from" in (run / "logs" / "rank0.log").read_text()
    classes = json.loads((workspace["latents"] / "manifest.json").read_text())["classes"]
    assert json.loads((run / "classes.json").read_text())["classes"] == classes
    first = run / "checkpoints" / "step_00000001"
    for checkpoint in (first, run / "checkpoints" / "step_00000002"):
        assert read_sidecar(checkpoint)["timestep_freq_shift"] == 0
        assert str(imported) in ckpt.read_train_state(checkpoint)["init_from"]
    # After one step the EMA moved (1 - decay) of the way from the imported weights to the trained ones.
    raw, spec, _ = load_for_inference(first, use_ema=False)
    ema = load_file(str(first / ckpt.EMA_WEIGHTS))
    for name, param in raw.named_parameters():
        expected = original[name] + (param - original[name]) * (1 - 0.9999)
        assert torch.allclose(ema[name], expected, atol=1e-7, rtol=0), name
    assert not torch.equal(raw.proj_out_2.weight, original["proj_out_2.weight"])  # it trained

    # load_for_inference gives the fine-tuned network with the original's shift: the same outputs as those
    # weights under shift 0, and not those of shift 1.
    tuned, _, _ = load_for_inference(run, use_ema=False)
    x, t, y = (
        torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)),
        torch.tensor([3, 900]),
        torch.tensor([0, 2]),
    )
    outputs = []
    for shift in (0, 1):
        reference = build_model(spec, timestep_freq_shift=shift, init="torch").eval()
        reference.load_state_dict(dict(tuned.state_dict()))
        with torch.no_grad():
            outputs.append(reference(x, timestep=t, class_labels=y).sample)
    with torch.no_grad():
        ours = tuned(x, timestep=t, class_labels=y).sample
    assert torch.equal(ours, outputs[0]) and not torch.allclose(ours, outputs[1], atol=1e-4)

    # A restarted job: the run's own checkpoint wins over --init-from (and keeps the shift).
    assert run_in_process([*common, "--max-steps", 3, "--resume", "auto"]) == 0
    log_text = (run / "logs" / "rank0.log").read_text()
    assert "ignored" in log_text and "step_00000002 at step 2" in log_text
    assert read_sidecar(run / "checkpoints" / "step_00000003")["timestep_freq_shift"] == 0
    assert ckpt.read_train_state(run / "checkpoints" / "step_00000003")["step"] == 3

    # Another network, or --init-from with an explicit --resume: one line each.
    wide = json.loads(workspace["plan1"].read_text())
    wide["inputs"]["hidden"] = wide["model"]["hidden"] = 64
    (tmp_path / "wide.json").write_text(json.dumps(wide))
    base = [
        "--latents",
        workspace["latents"],
        *QUIET,
        "--no-tensorboard",
        "--max-steps",
        1,
        "--init-from",
        imported,
    ]
    err = _one_line_error(
        capsys, ["--plan", tmp_path / "wide.json", "--output-dir", tmp_path / "wide", *base]
    )
    assert "hidden 32 (wanted 64)" in err and "--init-from" in err
    err = _one_line_error(
        capsys, ["--plan", workspace["plan1"], "--output-dir", tmp_path / "x", *base, "--resume", run]
    )
    assert "--init-from" in err and "--resume" in err


def test_a_plan_for_a_lazily_made_adamw_state_says_this_trainer_makes_it_first(workspace, tmp_path):
    """A plan made with --assume adamw_state=lazy (another codebase's order) trains the same, and the log says
    that this trainer makes the state before the first step, whose memory the plan then overstates."""
    plan = json.loads(workspace["plan1"].read_text())
    plan["assumptions"]["adamw_state"] = "lazy"
    lazy_plan = tmp_path / "plan.json"
    lazy_plan.write_text(json.dumps(plan))
    run = tmp_path / "run"
    argv = ["--plan", lazy_plan, "--latents", workspace["latents"], "--output-dir", run, *QUIET]
    assert run_in_process([*argv, "--no-tensorboard", "--max-steps", 1]) == 0
    log = (run / "logs" / "rank0.log").read_text()
    assert "adamw_state=lazy" in log and "makes it before the first step" in log
    eager = tmp_path / "eager"
    argv = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", eager, *QUIET]
    assert run_in_process([*argv, "--no-tensorboard", "--max-steps", 1]) == 0
    assert "adamw_state=lazy" not in (eager / "logs" / "rank0.log").read_text()


def _variant_plan(workspace, folder: Path, **decision) -> Path:
    """plan2 (2 processes) with other decisions, beside its accelerate config."""
    import shutil

    folder.mkdir(parents=True)
    plan = json.loads(workspace["plan2"].read_text())
    plan["decision"].update(decision)
    (folder / "plan.json").write_text(json.dumps(plan))
    shutil.copy(workspace["plan2"].parent / "accelerate_config.yaml", folder)
    return folder / "plan.json"


@pytest.mark.parametrize("problem", ["no cache", "no images", "dataset without labels", "no encoder"])
def test_dit_accel_train_refuses_missing_inputs_before_it_launches(workspace, tmp_path, capsys, problem):
    """What costs a glance is checked by `dit-accel train` before any process starts: one line, exit 2, no
    run folder (each once surfaced only after the ranks had started, 7-25 s, behind torch elastic's lines,
    with runs/NAME/logs/ left behind)."""
    from dit_accel.cli import main

    run = tmp_path / "run"
    common = ["train", "--output-dir", str(run), "--num-workers", "0"]
    if problem == "no cache":
        argv = ["--plan", str(workspace["plan2"]), "--latents", str(tmp_path / "absent")]
        expected = f"latent cache {tmp_path / 'absent'} does not exist"
    elif problem == "no images":
        plan = _variant_plan(workspace, tmp_path / "pixel", latents="pixel")
        argv = ["--plan", str(plan), "--data-path", str(tmp_path / "absent")]
        expected = f"--data-path {tmp_path / 'absent'} does not exist"
    elif problem == "dataset without labels":
        import datasets

        rows = {
            "image": [
                {"bytes": p.read_bytes(), "path": None}
                for p in sorted(workspace["images"].rglob("*.png"))[:4]
            ]
        }
        features = datasets.Features({"image": datasets.Image()})
        datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
        plan = _variant_plan(workspace, tmp_path / "pixel", latents="pixel")
        argv = ["--plan", str(plan), "--data-path", str(tmp_path / "saved")]
        expected = "has no column 'label' (its columns: image); pass --label-column"
    else:
        plan = _variant_plan(workspace, tmp_path / "repa", repa="dinov2-s", repa_projector_dim=16)
        argv = ["--plan", str(plan), "--latents", str(workspace["latents"])]
        argv += ["--repa-encoder", str(tmp_path / "absent.pth"), "--repa-projector-dim", "16"]
        expected = f"--repa-encoder {tmp_path / 'absent.pth'} is not a file"
    capsys.readouterr()
    assert main([*common, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dit-accel train: error: ") and expected in err[0], err
    assert not run.exists()
