"""`dit-accel sample` on a briefly trained tiny DiT (real trainer, real latent cache, tiny AutoencoderKL).

One module-scoped run is shared: demo images -> latent cache (its manifest records the VAE) -> dit-plan ->
the trainer for a few steps. The grid, the evaluation batch (format, balance, resume after SIGKILL, 1 vs 2
real processes under `accelerate launch`) are all checked against it.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from ports import launch_port
from teardown_probe import SCRIPT, teardowns

from dit_accel.images import make_grid
from dit_accel.sample import command as sample
from dit_accel.sample.generate import balanced_labels, sample_generators, sample_latents, sample_seed

RESOLUTION, CLASSES = 64, 4
# A few hundred steps of sampling work in total per test; few steps keep it fast, enough to be non-trivial.
NPZ_ARGS = ["--num-samples", "10", "--batch-size", "3", "--steps", "4", "--cfg-scale", "2.0", "--no-ema"]


@contextlib.contextmanager
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; reset them around each in-process run."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real run folder: 6 trainer steps of a 2-block DiT on latents of demo images (tiny VAE)."""
    from dit_accel.data.demo import demo_vae, write_demo_data
    from dit_accel.data.latents import ExtractConfig, extract_latents
    from dit_accel.train.loop import main as train
    from planner.cli import main as dit_plan

    root = tmp_path_factory.mktemp("sample_run")
    demo_vae(RESOLUTION).save_pretrained(root / "vae")
    write_demo_data(root / "images", classes=CLASSES, per_class=4, resolution=RESOLUTION, seed=0)
    extract_latents(
        ExtractConfig(
            data_path=str(root / "images"),
            vae=str(root / "vae"),
            resolution=RESOLUTION,
            out=str(root / "latents"),
            batch_size=16,
            shard_size=64,
            num_workers=0,
        )
    )
    assert (
        dit_plan(
            [
                "--model",
                "DiT-S/2",
                "--depth",
                "2",
                "--hidden",
                "32",
                "--heads",
                "2",
                "--resolution",
                str(RESOLUTION),
                "--num-classes",
                str(CLASSES),
                "--vram",
                "8G",
                "--precision",
                "fp32",
                "--gpus",
                "1",
                "--global-batch",
                "8",
                "--out",
                str(root / "plan"),
            ]
        )
        == 0
    )
    with fresh_accelerate_state():
        assert (
            train(
                [
                    "--plan",
                    str(root / "plan" / "plan.json"),
                    "--latents",
                    str(root / "latents"),
                    "--output-dir",
                    str(root / "run"),
                    "--max-steps",
                    "6",
                    "--checkpoint-every",
                    "6",
                    "--num-workers",
                    "0",
                    "--no-progress-bar",
                    "--no-tensorboard",
                    "--lr",
                    "3e-3",
                ]
            )
            == 0
        )
    return root


def sample_main(argv) -> int:
    with fresh_accelerate_state():
        return sample.main([str(a) for a in argv])


def read_png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


# --- pure parts ------------------------------------------------------------------------------------------------


def test_labels_are_balanced_and_fixed_by_the_seed():
    labels = balanced_labels(1003, 10, seed=0)
    counts = np.bincount(labels, minlength=10)
    assert counts.sum() == 1003 and counts.max() - counts.min() == 1
    assert list(np.flatnonzero(counts == 101)) == [0, 1, 2]  # the remainder goes to the first classes
    assert np.array_equal(labels, balanced_labels(1003, 10, seed=0))
    assert not np.array_equal(labels, balanced_labels(1003, 10, seed=1))
    assert labels[:20].tolist() != sorted(labels[:20].tolist())  # shuffled, not class by class
    # Distinct (seed, index) pairs give distinct generators; the same pair the same noise.
    seeds = {sample_seed(s, i) for s in range(3) for i in range(1000)}
    assert len(seeds) == 3000
    a, b = sample_generators(0, [5, 5])
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))


def test_eval_batch_assembles_in_global_order_and_refuses_foreign_shards(tmp_path):
    job = sample.EvalBatch(tmp_path / "s.npz", num_samples=7, batch_size=3, classes=(2, 5), seed=0)
    assert [job.batches_for_rank(r, 2) for r in range(2)] == [[0, 2], [1]]
    job.check_or_write_settings({"cfg_scale": 1.5}, write=True)
    made = []
    for batch in (2, 0, 1):  # any order of completion
        indices = job.indices(batch)
        images = np.full((len(indices), 4, 4, 3), batch, dtype=np.uint8)
        job.save_shard(batch, images, job.labels[indices.start : indices.stop])
        assert job.shard_is_done(batch)
    made = np.concatenate([np.full((len(job.indices(b)), 4, 4, 3), b, np.uint8) for b in range(3)])
    (job.shard_dir / "batch_000009.npz.partial.tmp").write_bytes(b"half a file")  # a killed writer's leftover
    with pytest.raises(sample.UserError, match="cfg_scale differ"):
        job.check_or_write_settings({"cfg_scale": 4.0}, write=False)
    job.assemble()
    with np.load(tmp_path / "s.npz") as result:
        assert result.files == ["arr_0", "arr_1"]
        assert np.array_equal(result["arr_0"], made) and result["arr_0"].dtype == np.uint8
        assert np.array_equal(result["arr_1"], job.labels) and set(result["arr_1"].tolist()) == {2, 5}
    assert not job.shard_dir.exists()


def test_grid_tiles_images_row_by_row():
    images = np.arange(5, dtype=np.uint8).reshape(5, 1, 1, 1).repeat(2, 1).repeat(2, 2).repeat(3, 3)
    grid = make_grid(images, columns=2, padding=1, fill=255)
    assert grid.shape == (3 * 3 + 1, 2 * 3 + 1, 3)
    assert grid[1, 1, 0] == 0 and grid[1, 4, 0] == 1 and grid[4, 1, 0] == 2 and grid[7, 1, 0] == 4
    assert grid[7, 4, 0] == 255  # the empty cell


# --- the grid ----------------------------------------------------------------------------------------------------


def test_grid_and_singles_are_written_and_deterministic(run, tmp_path, capsys):
    common = [
        "--checkpoint",
        run / "run",
        "--classes",
        "0,2,3",
        "--per-class",
        "2",
        "--steps",
        "6",
        "--no-ema",
        "--batch-size",
        "4",
    ]  # no --vae: the run's latent cache names it
    assert sample_main([*common, "--seed", "1", "--out", tmp_path / "a" / "grid.png"]) == 0
    captured = capsys.readouterr()
    assert "ddpm 6 steps, cfg 4.0, model weights" in captured.out
    assert "grid of 6" in captured.err and "2/2" in captured.err  # progress: 6 samples in 2 batches
    assert "sampling" in captured.err  # and each batch's denoising steps
    singles = sorted((tmp_path / "a" / "grid_images").iterdir())
    assert [p.name for p in singles] == [
        "000000_class0.png",
        "000001_class0.png",
        "000002_class2.png",
        "000003_class2.png",
        "000004_class3.png",
        "000005_class3.png",
    ]
    images = np.stack([read_png(p) for p in singles])
    assert images.shape == (6, RESOLUTION, RESOLUTION, 3)
    grid = read_png(tmp_path / "a" / "grid.png")
    plain = make_grid(images, columns=2)  # one row per class ...
    margin = grid.shape[1] - plain.shape[1]
    assert grid.shape[0] == plain.shape[0] and margin > 0 and np.array_equal(grid[:, margin:], plain)
    # ... each named on the left by its class (the run's classes.json): ink in every row's band, none between
    names = json.loads((run / "run" / "classes.json").read_text())["classes"]
    assert len(names) == 4
    ink = (grid[:, :margin] < 128).any(axis=(1, 2))
    bands = [range(2 + row * (RESOLUTION + 2), 2 + row * (RESOLUTION + 2) + RESOLUTION) for row in range(3)]
    assert all(ink[list(band)].any() for band in bands) and not ink[:2].any()
    unlabeled = tmp_path / "plain" / "grid.png"
    assert sample_main([*common, "--seed", "1", "--no-row-labels", "--out", unlabeled]) == 0
    assert np.array_equal(read_png(unlabeled), plain)
    assert len({img.tobytes() for img in images}) == 6
    umask = os.umask(0)
    os.umask(umask)
    for path in (tmp_path / "a" / "grid.png", singles[0]):  # atomic writes still honour the umask
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "a" / "grid_images").stat().st_mode & 0o777 == 0o777 & ~umask

    assert sample_main([*common, "--seed", "1", "--out", tmp_path / "b" / "grid.png"]) == 0
    assert np.array_equal(read_png(tmp_path / "b" / "grid.png"), grid)
    assert sample_main([*common, "--seed", "2", "--out", tmp_path / "c" / "grid.png"]) == 0
    assert not np.array_equal(read_png(tmp_path / "c" / "grid.png"), grid)

    # Sample i depends on (seed, i) only: alone, in another batch size, it is the same picture.
    source = sample.load_source(run / "run", use_ema=False)
    decoder = sample.load_decoder(source.spec, sample.default_vae_path(source), "cpu")
    settings = sample.SampleSettings(cfg_scale=4.0, steps=6, seed=1)
    alone = sample.sample_images(source.model, source.spec, decoder, [2], [3], settings)
    assert np.abs(alone[0].astype(int) - images[3].astype(int)).max() <= 1


def test_guidance_modes_and_samplers_differ_and_bad_input_is_one_line(run, tmp_path, capsys):
    source = sample.load_source(run / "run", use_ema=False)
    labels, indices = [1, 3], [0, 1]
    run_with = lambda **kw: sample_latents(
        source.model, source.spec, labels, indices, sample.SampleSettings(**{"steps": 5, **kw})
    )
    guided_all, guided_first3 = run_with(guidance="all"), run_with(guidance="first3")
    assert torch.equal(guided_all, run_with(guidance="all"))
    assert not torch.allclose(guided_all, guided_first3)
    assert not torch.allclose(run_with(sampler="ddim"), run_with(sampler="ddim", cfg_scale=1.0))
    assert not torch.allclose(run_with(sampler="ddim"), guided_all)

    for argv, message in [
        (["--out", tmp_path / "g.jpg"], "must name a .png file"),
        (
            ["--out", tmp_path / "g.png", "--classes", "1,9"],
            "--classes [9] out of range: this model has classes 0..3",
        ),
        (["--out", tmp_path / "g.png", "--npz", tmp_path / "s.npz"], "pass exactly one of --out"),
        (["--out", tmp_path / "g.png", "--num-samples", "5"], "--num-samples is for the evaluation batch"),
        (["--out", tmp_path / "g.png", "--vae", tmp_path / "missing"], "--vae"),
        # a flow sampler's flag on this ddpm model, even at its default value: refused, not ignored
        (
            ["--out", tmp_path / "g.png", "--sampler", "ddim", "--ode-solver", "heun"],
            "--ode-solver is read by",
        ),
        (
            ["--out", tmp_path / "g.png", "--cfg-interval", "0,1"],
            "--cfg-interval is read by --sampler ode or sde",
        ),
    ]:
        assert sample_main(["--checkpoint", run / "run", "--steps", "2", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert sample_main(["--checkpoint", tmp_path / "nothing", "--out", tmp_path / "g.png"]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- the evaluation batch ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_npz(run, tmp_path_factory):
    """Made in this process with one thread, as the launched processes (OMP_NUM_THREADS=1) make theirs: a
    different thread count splits the matmul reductions differently and can move a pixel by one level."""
    out = tmp_path_factory.mktemp("npz_reference") / "samples.npz"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert sample_main(["--checkpoint", run / "run", *NPZ_ARGS, "--npz", out]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_npz_is_the_fid_evaluator_format_with_balanced_labels(run, reference_npz, tmp_path):
    with np.load(reference_npz) as result:
        images, labels = result["arr_0"], result["arr_1"]
    assert images.shape == (10, RESOLUTION, RESOLUTION, 3) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [3, 3, 2, 2]
    assert labels.tolist() == balanced_labels(10, CLASSES, seed=0).tolist()
    assert not (reference_npz.parent / "samples.npz.parts").exists()
    assert len({img.tobytes() for img in images}) == 10

    # Sample i of the batch is the picture the grid path makes for (seed, i, label): one seeding rule. Bit
    # for bit only in the same layout: samples 6-8 were one batch of 3 (--batch-size 3) on one thread, and
    # so they are here.
    source = sample.load_source(run / "run", use_ema=False)
    decoder = sample.load_decoder(source.spec, sample.default_vae_path(source), "cpu")
    settings = sample.SampleSettings(cfg_scale=2.0, steps=4, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = sample.sample_images(
            source.model, source.spec, decoder, labels[6:9].tolist(), range(6, 9), settings
        )
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(again, images[6:9])

    # A finished batch is never overwritten.
    assert sample_main(["--checkpoint", run / "run", *NPZ_ARGS, "--npz", reference_npz]) == 2


@pytest.mark.launched
def test_npz_resumes_after_sigkill_without_redoing_finished_batches(run, reference_npz, tmp_path):
    out = tmp_path / "samples.npz"
    parts = tmp_path / "samples.npz.parts"
    argv = [
        sys.executable,
        "-m",
        "dit_accel.sample",
        "--checkpoint",
        str(run / "run"),
        *NPZ_ARGS,
        "--batch-size",
        "1",
        "--npz",
        str(out),
    ]  # 10 batches: time to kill it between two of them
    process = subprocess.Popen(argv, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(parts.glob("batch_*.npz")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-2000:]
    finished = {p.name: p.stat().st_mtime_ns for p in parts.glob("batch_*.npz")}
    assert 1 <= len(finished) < 10 and not out.exists()

    # Batch size 1 cuts the work differently from the reference (3): shards of another layout are refused.
    assert sample_main(["--checkpoint", run / "run", *NPZ_ARGS, "--npz", out]) == 2
    rerun = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{10 - len(finished)} batches made, {len(finished)} already done" in rerun.stdout
    with np.load(out) as resumed, np.load(reference_npz) as reference:
        assert np.array_equal(resumed["arr_1"], reference["arr_1"])
        # Batch size changes the floating-point reduction order only: at most one grey level apart.
        assert np.abs(resumed["arr_0"].astype(int) - reference["arr_0"].astype(int)).max() <= 1


@pytest.mark.launched
def test_two_processes_make_the_same_array_as_one(run, reference_npz, tmp_path):
    out = tmp_path / "samples.npz"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        launch_port(),
        SCRIPT,  # `-m dit_accel.sample`, then the threads left (tests/teardown_probe.py)
        "dit_accel.sample",
        "--checkpoint",
        str(run / "run"),
        *NPZ_ARGS,
        "--npz",
        str(out),
    ]
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: 2 batches made" in result.stdout and "rank 1: 2 batches made" in result.stdout
    assert teardowns(result.stderr) == []  # ended by exit_command, the process group never freed
    with np.load(out) as two, np.load(reference_npz) as one:
        assert np.array_equal(two["arr_0"], one["arr_0"]) and np.array_equal(two["arr_1"], one["arr_1"])


def test_the_run_records_its_vae_and_class_names(run):
    from dit_accel.class_names import run_class_names

    source = sample.load_source(run / "run")
    assert Path(sample.default_vae_path(source)).resolve() == (run / "vae").resolve()
    assert run_class_names(source) == json.loads((run / "latents" / "classes.json").read_text())["classes"]
    assert source.info["weights"] == "ema" and source.info["step"] == 6
