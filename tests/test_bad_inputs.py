"""Every bad value a user can type gets one stderr line naming the flag, exit 2, no traceback, no file.

One table, each row run through the real entry point in this process (`dit-plan`, `dit-accel COMMAND`, and
`python -m dit_accel.train` for the trainer, which `dit-accel train` launches). The folder the command would
write into is compared before and after: a refused command must leave it exactly as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TINY = ["--model", "DiT-S/2", "--depth", "2", "--hidden", "32", "--heads", "2", "--resolution", "64"]
TINY += ["--num-classes", "4", "--vram", "8G", "--precision", "fp32", "--gpus", "1", "--global-batch", "8"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The real files the bad inputs point at: a plan, a plan with a zero batch, a file, broken .pt files."""
    from planner.cli import main as dit_plan

    root = tmp_path_factory.mktemp("inputs")
    assert dit_plan([*TINY, "--sharding", "ddp", "--out", str(root / "plan")]) == 0
    plan = json.loads((root / "plan" / "plan.json").read_text())
    for name, value in (("zero", 0), ("negative", -8)):
        bad = dict(plan, global_batch=value, decision=dict(plan["decision"], micro_batch=value))
        (root / f"plan_{name}.json").write_text(json.dumps(bad))
    (root / "file.txt").write_text("not a folder\n")
    (root / "text.pt").write_text("this is not a checkpoint\n")
    (root / "empty.pt").write_bytes(b"")
    (root / "junk.pt").write_text("junk\n")  # the unpickler's KeyError, once a traceback
    (root / "page.pt").write_text("<!DOCTYPE html><html><body>404</body></html>\n")  # a failed download
    import torch

    torch.save({"x_embedder.proj.weight": torch.zeros(8, 4, 2, 2)}, root / "whole.pt")
    data = (root / "whole.pt").read_bytes()
    (root / "truncated.pt").write_bytes(data[: len(data) // 2])
    (root / "images" / "a").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (64, 64)).save(root / "images" / "a" / "0.png")  # a valid folder: later checks run
    return {
        "plan": str(root / "plan" / "plan.json"),
        "plan_zero": str(root / "plan_zero.json"),
        "plan_negative": str(root / "plan_negative.json"),
        "file": str(root / "file.txt"),
        "text_pt": str(root / "text.pt"),
        "truncated_pt": str(root / "truncated.pt"),
        "empty_pt": str(root / "empty.pt"),
        "junk_pt": str(root / "junk.pt"),
        "page_pt": str(root / "page.pt"),
        "whole_pt": str(root / "whole.pt"),
        "images": str(root / "images"),
        "png": str(root / "images" / "a" / "0.png"),  # an existing grid to be refused, not overwritten
    }


def _trainer(argv):
    from dit_accel.train.loop import main

    return main(argv)


def _dit_accel(argv):
    from dit_accel.cli import main

    return main(argv)


def _dit_plan(argv):
    from planner.cli import main

    return main(argv)


TRAIN = ["--plan", "{plan}", "--output-dir", "{out}", "--data-path", "{images}"]
SAMPLE = ["sample", "--checkpoint", "{out}", "--out", "{out}/grid.png"]
EXTRACT = ["extract-latents", "--data-path", "{images}", "--vae", "{out}/vae", "--out", "{out}/cache"]

# (name, entry point, argv, the flag the line must name)
CASES = [
    ("lr nan", _trainer, [*TRAIN, "--lr", "nan"], "--lr"),
    ("lr inf", _trainer, [*TRAIN, "--lr", "inf"], "--lr"),
    ("lr negative", _trainer, [*TRAIN, "--lr", "-1e-4"], "--lr"),
    ("betas above 1", _trainer, [*TRAIN, "--betas", "2", "0.999"], "--betas"),
    ("betas nan", _trainer, [*TRAIN, "--betas", "0.9", "nan"], "--betas"),
    ("weight decay negative", _trainer, [*TRAIN, "--weight-decay", "-1"], "--weight-decay"),
    ("weight decay inf", _trainer, [*TRAIN, "--weight-decay", "inf"], "--weight-decay"),
    ("seed negative", _trainer, [*TRAIN, "--seed", "-1"], "--seed"),
    ("seed huge", _trainer, [*TRAIN, "--seed", str(2**70)], "--seed"),
    ("grad clip nan", _trainer, [*TRAIN, "--grad-clip", "nan"], "--grad-clip"),
    ("grad clip zero", _trainer, [*TRAIN, "--grad-clip", "0"], "--grad-clip"),
    ("ema decay nan", _trainer, [*TRAIN, "--ema-decay", "nan"], "--ema-decay"),
    ("class dropout 1", _trainer, [*TRAIN, "--class-dropout", "1"], "--class-dropout"),
    ("max steps 0", _trainer, [*TRAIN, "--max-steps", "0"], "--max-steps"),
    ("lr not a number", _trainer, [*TRAIN, "--lr", "fast"], "--lr"),
    ("num workers -1", _trainer, [*TRAIN, "--num-workers", "-1"], "--num-workers"),
    (
        "output dir is a file",
        _trainer,
        ["--plan", "{plan}", "--output-dir", "{file}", "--data-path", "{images}"],
        "--output-dir",
    ),
    (
        "output dir under a file",
        _trainer,
        ["--plan", "{plan}", "--output-dir", "{file}/run", "--data-path", "{images}"],
        "--output-dir",
    ),
    ("warmup steps -1", _trainer, [*TRAIN, "--warmup-steps", "-1"], "--warmup-steps"),
    ("max skipped steps -1", _trainer, [*TRAIN, "--max-skipped-steps", "-1"], "--max-skipped-steps"),
    ("max bad images -1", _trainer, [*TRAIN, "--max-bad-images", "-1"], "--max-bad-images"),
    ("keep last 0", _trainer, [*TRAIN, "--keep-last", "0"], "--keep-last"),
    (
        "skip bad images with latents",
        _trainer,
        ["--plan", "{plan}", "--output-dir", "{out}", "--latents", "{images}", "--skip-bad-images"],
        "--skip-bad-images",
    ),
    (
        "sample num samples 0",
        _dit_accel,
        [*SAMPLE[:-2], "--npz", "{out}/s.npz", "--num-samples", "0"],
        "--num-samples",
    ),
    ("sample per class 0", _dit_accel, [*SAMPLE, "--per-class", "0"], "--per-class"),
    (
        "calibrate max micro batch 0",
        _dit_accel,
        ["calibrate", "--plan", "{plan}", "--max-micro-batch", "0"],
        "--max-micro-batch",
    ),
    (
        "doctor keep last 0",
        _dit_accel,
        ["doctor", "--plan", "{plan}", "--data-path", "{images}", "--keep-last", "0"],
        "--keep-last",
    ),
    (
        "data path is a file",
        _trainer,
        ["--plan", "{plan}", "--output-dir", "{out}", "--data-path", "{file}"],
        "--data-path",
    ),
    (
        "plan with a zero batch",
        _trainer,
        ["--plan", "{plan_zero}", "--output-dir", "{out}", "--data-path", "{images}"],
        "batch",
    ),
    (
        "plan with a negative batch",
        _trainer,
        ["--plan", "{plan_negative}", "--output-dir", "{out}", "--data-path", "{images}"],
        "batch",
    ),
    (
        "import-dit a text file",
        _dit_accel,
        ["import-dit", "--checkpoint", "{text_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-dit a truncated file",
        _dit_accel,
        ["import-dit", "--checkpoint", "{truncated_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-dit an empty file",
        _dit_accel,
        ["import-dit", "--checkpoint", "{empty_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-dit junk bytes",
        _dit_accel,
        ["import-dit", "--checkpoint", "{junk_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-dit an HTML page",
        _dit_accel,
        ["import-dit", "--checkpoint", "{page_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-sit an empty file",
        _dit_accel,
        ["import-sit", "--checkpoint", "{empty_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-sit junk bytes",
        _dit_accel,
        ["import-sit", "--checkpoint", "{junk_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-sit an HTML page",
        _dit_accel,
        ["import-sit", "--checkpoint", "{page_pt}", "--out", "{out}/run"],
        "--checkpoint",
    ),
    (
        "import-dit heads 0",
        _dit_accel,
        ["import-dit", "--checkpoint", "{whole_pt}", "--out", "{out}/run", "--heads", "0"],
        "--heads",
    ),
    (
        "doctor port 99999",
        _dit_accel,
        ["doctor", "--plan", "{plan}", "--data-path", "{images}", "--main-process-port", "99999"],
        "--main-process-port",
    ),
    (
        "doctor port -1",
        _dit_accel,
        ["doctor", "--plan", "{plan}", "--data-path", "{images}", "--main-process-port", "-1"],
        "--main-process-port",
    ),
    (
        "doctor num workers -1",
        _dit_accel,
        ["doctor", "--plan", "{plan}", "--data-path", "{images}", "--num-workers", "-1"],
        "--num-workers",
    ),
    ("doctor log is a folder", _dit_accel, ["doctor", "--log", "{images}"], "--log"),
    ("extract num workers -1", _dit_accel, [*EXTRACT, "--num-workers", "-1"], "--num-workers"),
    ("extract resolution 0", _dit_accel, [*EXTRACT, "--resolution", "0"], "--resolution"),
    ("extract batch size 0", _dit_accel, [*EXTRACT, "--batch-size", "0"], "--batch-size"),
    ("extract shard size -5", _dit_accel, [*EXTRACT, "--shard-size", "-5"], "--shard-size"),
    (
        "extract out is a file",
        _dit_accel,
        ["extract-latents", "--data-path", "{images}", "--vae", "{out}/vae", "--out", "{file}"],
        "--out",
    ),
    (
        "extract vae is a file",
        _dit_accel,
        ["extract-latents", "--data-path", "{images}", "--vae", "{file}", "--out", "{out}/cache"],
        "--vae",
    ),
    (
        "extract data path is a file",
        _dit_accel,
        ["extract-latents", "--data-path", "{file}", "--vae", "{out}/vae", "--out", "{out}/cache"],
        "--data-path",
    ),
    ("sample cfg nan", _dit_accel, [*SAMPLE, "--cfg-scale", "nan"], "--cfg-scale"),
    ("sample cfg inf", _dit_accel, [*SAMPLE, "--cfg-scale", "inf"], "--cfg-scale"),
    ("sample steps 0", _dit_accel, [*SAMPLE, "--steps", "0"], "--steps"),
    ("sample seed -1", _dit_accel, [*SAMPLE, "--seed", "-1"], "--seed"),
    ("sample batch size 0", _dit_accel, [*SAMPLE, "--batch-size", "0"], "--batch-size"),
    ("demo classes 0", _dit_accel, ["demo-data", "{out}/demo", "--classes", "0"], "--classes"),
    ("demo per class -1", _dit_accel, ["demo-data", "{out}/demo", "--per-class", "-1"], "--per-class"),
    ("demo resolution 0", _dit_accel, ["demo-data", "{out}/demo", "--resolution", "0"], "--resolution"),
    ("demo seed huge", _dit_accel, ["demo-data", "{out}/demo", "--seed", str(2**70)], "--seed"),
    ("demo out is a file", _dit_accel, ["demo-data", "{file}"], "file.txt"),
    ("verify micro batch 0", _dit_accel, ["verify", "{plan}", "--micro-batch", "0"], "--micro-batch"),
    (
        "export out is a file",
        _dit_accel,
        ["export", "--checkpoint", "{out}", "--out", "{file}"],
        "--out",
    ),
    ("calibrate steps 0", _dit_accel, ["calibrate", "--plan", "{plan}", "--steps", "0"], "--steps"),
    # dit-accel train checks the trainer's flags before it starts the launcher: one line, not one per rank
    ("wrapper lr nan", _dit_accel, ["train", *TRAIN, "--lr", "nan"], "--lr"),
    ("wrapper seed -1", _dit_accel, ["train", *TRAIN, "--seed", "-1"], "--seed"),
    ("dit-plan gpus 0", _dit_plan, [*TINY[:-4], "--gpus", "0", "--out", "{out}/p"], "--gpus"),
    ("dit-plan port 99999", _dit_plan, [*TINY, "--main-process-port", "99999", "--out", "{out}/p"], "port"),
    ("dit-plan nodes -1", _dit_plan, [*TINY, "--nodes", "-1", "--out", "{out}/p"], "--nodes"),
    ("dit-plan out is a file", _dit_plan, [*TINY, "--out", "{file}"], "--out"),
    # a typo'd flag names the nearest known one (a typo'd --model always did)
    (
        "dit-plan typo",
        _dit_plan,
        [*TINY, "--global-bacth", "8", "--out", "{out}/p"],
        "did you mean --global-batch",
    ),
    ("trainer typo", _trainer, [*TRAIN, "--max-stpes", "3"], "did you mean --max-steps for --max-stpes?"),
    ("sample typo", _dit_accel, [*SAMPLE, "--cfg-sacle", "2"], "did you mean --cfg-scale"),
    (
        "sample out exists",
        _dit_accel,
        ["sample", "--checkpoint", "{out}", "--out", "{png}"],
        "already exists",
    ),
    (
        "doctor typo",
        _dit_accel,
        ["doctor", "--plan", "{plan}", "--dat-path", "{images}"],
        "did you mean --data-path",
    ),
]


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.mark.parametrize(("entry", "argv", "flag"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_exit_2_and_writes_nothing(entry, argv, flag, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    paths = dict(inputs, out=str(out))
    inputs_root = Path(inputs["file"]).parent
    before = _tree(inputs_root)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # anything written to a default relative path would show up here
    try:
        code = entry([a.format(**paths) for a in argv])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert flag in lines[0], lines[0]
    assert "Traceback" not in err
    assert not out.exists(), f"wrote {sorted(_tree(out))}"
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    assert _tree(inputs_root) == before
