"""Undecodable and 16-bit images in a real training run (pixel plan, in-process): a truncated JPEG stops
the run in one line, or with --skip-bad-images is skipped, logged once per rank and counted, up to a bound."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from test_train_e2e import QUIET, _make_plan, run_in_process


@pytest.fixture(scope="module")
def pixel_run(tmp_path_factory):
    """A pixel-space plan at 8 px and demo images with one truncated JPEG (not the first of its class)."""
    from dit_accel.data.demo import write_demo_data

    root = tmp_path_factory.mktemp("bad_images")
    plan = json.loads(_make_plan(root / "plan", gpus=1, micro_batch=8, grad_accum=1).read_text())
    plan["decision"]["latents"], plan["model"]["resolution"] = "pixel", 8
    (root / "pixel.json").write_text(json.dumps(plan))
    images = write_demo_data(root / "images", classes=4, per_class=4, resolution=8, seed=1)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "whole.jpg", quality=95)
    whole = (root / "whole.jpg").read_bytes()
    bad = sorted(images.iterdir())[1] / "zz_truncated.jpg"  # label 1; sorts last in its class
    bad.write_bytes(whole[: len(whole) // 2])
    return {"plan": root / "pixel.json", "images": images, "bad": bad}


def _train(pixel_run, out, *extra):
    argv = ["--plan", pixel_run["plan"], "--data-path", pixel_run["images"], "--output-dir", out, *QUIET]
    return run_in_process([*argv, "--no-tensorboard", "--checkpoint-every", 100, *extra])


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_truncated_jpeg_stops_the_run_in_one_line(pixel_run, tmp_path, capsys):
    assert _train(pixel_run, tmp_path / "run", "--max-steps", 2, "--num-workers", 1) == 2  # via a worker
    line = _one_line(capsys)
    assert line.startswith(f"dit_accel.train: error: cannot decode image {pixel_run['bad']}: ")
    assert "--skip-bad-images" in line


def test_skip_bad_images_logs_each_once_per_rank_and_counts(pixel_run, tmp_path):
    """17 images, global batch 8: 6 steps read every image three times, through a DataLoader worker."""
    out = tmp_path / "run"
    assert _train(pixel_run, out, "--max-steps", 6, "--skip-bad-images", "--num-workers", 1) == 0
    log = (out / "logs" / "rank0.log").read_text()
    skipped = [line for line in log.splitlines() if "skipped undecodable image" in line]
    assert len(skipped) == 1, skipped
    assert str(pixel_run["bad"]) in skipped[0] and "1 on rank 0 so far, at most 100" in skipped[0]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_more_bad_images_than_the_bound_stop_the_run(pixel_run, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        _train(pixel_run, out, "--max-steps", 4, "--skip-bad-images", "--max-bad-images", 0) == 2
    )  # in-process
    line = _one_line(capsys)
    assert "1 images on rank 0 could not be decoded, more than --max-bad-images 0" in line
    assert str(pixel_run["bad"]) in line and "--full" in line
