"""The README's CPU tour, run as written: every command of its marked blocks, in order, in a fresh folder,
through the installed console scripts, with only the sizes shrunk (steps, images) so that it takes a minute.

The commands are read from README.md itself, so the tour a newcomer follows and the one tested cannot drift
apart: a block marked `<!-- cpu-tour -->` is run line by line (`\\` continuations joined). Each shrinking
is a literal replacement that must match, so a README edit that removes one fails here instead of quietly
running the full-size tour.
"""

import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- cpu-tour -->"

# (README text, tiny replacement): each must occur in the tour.
SHRINK = [
    ("--max-steps 600", "--max-steps 4"),
    ("--max-steps 800", "--max-steps 6"),
    ("--max-steps 100", "--max-steps 3"),
    ("--per-class 8", "--per-class 1"),
    ("--num-samples 256 --batch-size 64", "--num-samples 8 --batch-size 8 --steps 3"),
    ("--steps 25", "--steps 3"),
    ("num_inference_steps=25", "num_inference_steps=2"),
]
# demo-data writes 64 images per class by default; the tiny tour needs 8
DEMO_DATA = ("dit-accel demo-data ", "dit-accel demo-data --per-class 8 ")


def tour_commands(readme: str) -> list[str]:
    """The shell commands of the README's marked blocks, continuation lines joined."""
    blocks = re.findall(re.escape(MARKER) + r"\s*```bash\n(.*?)```", readme, flags=re.S)
    assert blocks, f"README.md has no ```bash block after {MARKER}"
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def shrink(commands: list[str]) -> list[str]:
    text = "\n".join(commands)
    for old, new in [*SHRINK, DEMO_DATA]:
        assert old in text, f"the README's tour no longer contains {old!r}: update SHRINK in this test"
        text = text.replace(old, new)
    return text.splitlines()


@pytest.mark.launched
def test_the_readme_cpu_tour_runs_as_written(tmp_path):
    commands = shrink(tour_commands((ROOT / "README.md").read_text()))
    scripts = Path(sys.executable).parent  # dit-plan, dit-accel, accelerate of this environment
    env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    run = partial(subprocess.run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    said = {}  # command -> what it printed
    for command in commands:
        result = run(["bash", "-c", command])
        assert result.returncode == 0, f"$ {command}\n{result.stdout}\n{result.stderr}"
        said[command] = result.stdout + result.stderr

    def output_of(prefix: str) -> str:
        return next(text for command, text in said.items() if command.startswith(prefix))

    # What each step promised, seen in its output and files.
    assert "0 failed: ready to launch" in output_of("dit-accel doctor")
    resumed = output_of("accelerate launch")  # the resume, spelled out: the recipe's lr inherited
    assert "resumed from" in resumed and "at step 4" in resumed and "lr 0.001" in resumed, resumed
    grid = Image.open(tmp_path / "grid.png")
    assert grid.height >= 4 * 16  # one row per class
    assert Image.open(tmp_path / "pipeline.png").size == (64, 64)
    plumbing = json.loads((tmp_path / "plumbing.json").read_text())  # the FID path, offline, labelled
    assert plumbing["num_samples"] == 8 and "NOT an FID" in plumbing["plumbing_check"]
    assert "-- PLUMBING CHECK, not an FID" in output_of(
        "dit-accel sample --checkpoint runs/demo --num-samples"
    )
    assert (
        json.loads((tmp_path / "pipeline" / "model_index.json").read_text())["id2label"]["2"] == "red_circle"
    )

    # The tour's run (flow, pixel space) has no DiTPipeline form: said at once, in one line, before any VAE.
    refused = run(["dit-accel", "export", "--checkpoint", "runs/demo", "--out", "pixel-pipeline"])
    assert refused.returncode == 2 and "flow model" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "pixel-pipeline").exists()
