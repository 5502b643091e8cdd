"""configs/recipes/*.yaml: every recipe parses into a TrainConfig that passes its checks against a tiny plan,
flags on the command line override the file, and a bad file is one line (exit 2)."""

from pathlib import Path

import pytest

from dit_accel.errors import UserError
from dit_accel.train.config import TrainConfig
from dit_accel.train.flags import parse_config
from dit_accel.train.recipe import read_recipe

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "recipes"
FIELDS = [name for name in TrainConfig.__dataclass_fields__]


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    from test_train_e2e import _make_plan

    return _make_plan(tmp_path_factory.mktemp("recipe_plan"), gpus=1, micro_batch=8, grad_accum=1)


def _config(tiny_plan, tmp_path, *argv) -> TrainConfig:
    required = [
        "--plan",
        str(tiny_plan),
        "--latents",
        str(tmp_path / "latents"),
        "--output-dir",
        str(tmp_path / "run"),
    ]
    return parse_config([*required, *map(str, argv)])


def test_every_recipe_is_listed_here_and_has_a_description():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == [
        "demo-cpu.yaml",
        "dit-xl2-256.yaml",
        "dit-xl2-512.yaml",
        "finetune-from-import.yaml",
        "lightningdit-xl1-64ep.yaml",
        "lightningdit-xl1-800ep.yaml",
        "repa-sit-xl2-256.yaml",
        "sit-xl2-256.yaml",
    ]
    import yaml

    for path in RECIPES.glob("*.yaml"):
        description = yaml.safe_load(path.read_text())["description"]
        assert isinstance(description, str) and 20 < len(description) < 200, path.name


def test_the_lightningdit_recipes_are_the_released_settings(tiny_plan, tmp_path):
    for name, steps in (("lightningdit-xl1-64ep.yaml", 80_000), ("lightningdit-xl1-800ep.yaml", 1_000_000)):
        config = _config(tiny_plan, tmp_path, "--config", RECIPES / name)
        assert (config.lr, config.betas, config.weight_decay, config.warmup_steps) == (
            2e-4,
            (0.9, 0.95),
            0.0,
            0,
        )
        assert (config.objective, config.flow_path, config.time_sampling, config.cosine_loss_weight) == (
            "flow",
            "linear",
            "lognormal",
            1.0,
        )
        assert (config.max_steps, config.ema_decay, config.class_dropout, config.hflip) == (
            steps,
            0.9999,
            0.1,
            True,
        )
        assert config.grad_clip is None
        # 64 and 800 epochs of ImageNet-1k (1,281,167 images) at global batch 1024
        assert round(steps * 1024 / 1_281_167) == (64 if "64ep" in name else 799)


def test_the_paper_recipes_are_the_dit_recipe(tiny_plan, tmp_path):
    for name, steps in (("dit-xl2-256.yaml", 400_000), ("dit-xl2-512.yaml", 3_000_000)):
        config = _config(tiny_plan, tmp_path, "--config", RECIPES / name)
        config.check()
        assert (config.lr, config.weight_decay, config.betas, config.warmup_steps) == (
            1e-4,
            0.0,
            (0.9, 0.999),
            0,
        )
        assert (config.ema_decay, config.ema_warmup, config.class_dropout) == (0.9999, False, 0.1)
        assert config.max_steps == steps and config.checkpoint_every == 50_000 and config.hflip is True
        assert config.grad_clip is None and config.scale_lr is False and config.resume == "auto"


def test_the_sit_and_repa_recipes_are_the_papers(tiny_plan, tmp_path):
    """SiT: DiT's optimiser and EMA under the linear flow objective; REPA: SiT's plus the alignment (block 8,
    coeff 0.5, width 2048), clipping at 1.0 and no flips (its released train.py and dataset)."""
    for name in ("sit-xl2-256.yaml", "repa-sit-xl2-256.yaml"):
        config = _config(tiny_plan, tmp_path, "--config", RECIPES / name)
        config.check()
        assert (config.objective, config.flow_path, config.time_sampling) == ("flow", "linear", "uniform")
        assert (config.lr, config.weight_decay, config.betas, config.warmup_steps) == (
            1e-4,
            0.0,
            (0.9, 0.999),
            0,
        )
        assert (config.ema_decay, config.class_dropout, config.max_steps) == (0.9999, 0.1, 400_000)
    sit = _config(tiny_plan, tmp_path, "--config", RECIPES / "sit-xl2-256.yaml")
    assert sit.grad_clip is None and sit.hflip is True and not sit.repa_encoder
    repa = _config(tiny_plan, tmp_path, "--config", RECIPES / "repa-sit-xl2-256.yaml")
    assert (repa.repa_depth, repa.repa_coeff, repa.repa_projector_dim) == (8, 0.5, 2048)
    assert repa.grad_clip == 1.0 and repa.hflip is False
    assert not repa.repa_encoder  # a local file, given on the command line


def test_the_finetune_recipe_starts_from_an_import_and_flags_override(tiny_plan, tmp_path):
    recipe = RECIPES / "finetune-from-import.yaml"
    config = _config(tiny_plan, tmp_path, "--config", recipe)
    assert config.init_from == "runs/imported" and config.lr == 1e-5 and config.max_steps == 20_000
    # before or after --config, a flag wins over the file
    for argv in (
        ("--config", recipe, "--lr", "3e-5", "--init-from", "mine"),
        ("--lr", "3e-5", "--init-from", "mine", "--config", recipe),
    ):
        config = _config(tiny_plan, tmp_path, *argv)
        assert (config.lr, config.init_from, config.ema_decay) == (3e-5, "mine", 0.9999)
    config = _config(
        tiny_plan, tmp_path, "--config", RECIPES / "dit-xl2-256.yaml", "--no-hflip", "--max-steps", "10"
    )
    assert config.hflip is False and config.max_steps == 10


def test_keys_take_either_spelling_and_bad_files_are_one_line(tiny_plan, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "description: mine\nema_decay: 0.99\nclass-dropout: 0.2\nscale_lr: true\nbetas: [0.8, 0.9]\n"
    )
    config = _config(tiny_plan, tmp_path, "--config", recipe)
    assert (config.ema_decay, config.class_dropout, config.scale_lr, config.betas) == (
        0.99,
        0.2,
        True,
        (0.8, 0.9),
    )
    assert read_recipe(recipe, FIELDS) == {
        "ema_decay": 0.99,
        "class_dropout": 0.2,
        "scale_lr": True,
        "betas": [0.8, 0.9],
    }
    bad = {
        "learning-rate: 1e-4\n": "unknown key 'learning-rate'",
        "lr: [1, 2]\n": "must be a single value",
        "lr: fast\n": "--lr",
        "lr: 1e-4\n  x: [\n": "not valid YAML",
        "- lr\n": "mapping of flag names",
        "ema-decay: 2.0\n": "--ema-decay must be in [0, 1)",
    }
    for text, expected in bad.items():
        recipe.write_text(text)
        with pytest.raises(UserError, match=None) as caught:
            _config(tiny_plan, tmp_path, "--config", recipe)
        assert expected in str(caught.value) and "\n" not in str(caught.value), text
    with pytest.raises(UserError, match="missing.yaml: no such file"):
        _config(tiny_plan, tmp_path, "--config", tmp_path / "missing.yaml")


def test_a_shipped_recipe_resolves_by_name_from_any_folder(tiny_plan, tmp_path, monkeypatch):
    from dit_accel.train.launch import check_trainer_flags, launch_command
    from dit_accel.train.recipe import recipe_file, shipped_recipes

    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert sorted(shipped_recipes()) == sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert recipe_file("dit-xl2-256").read_text() == (RECIPES / "dit-xl2-256.yaml").read_text()
    assert _config(tiny_plan, tmp_path, "--config", "dit-xl2-512").max_steps == 3_000_000
    with pytest.raises(UserError) as caught:
        _config(tiny_plan, tmp_path, "--config", "dit-xl2-1024")
    message = str(caught.value)
    assert "--config dit-xl2-1024: no recipe of that name" in message and "\n" not in message
    assert all(name in message for name in shipped_recipes())
    # `dit-accel train --config NAME` checks the recipe by name before it launches anything
    args = ["--plan", str(tiny_plan), "--latents", str(tmp_path), "--output-dir", str(tmp_path / "run")]
    command = launch_command([*args, "--config", "dit-xl2-256"])
    check_trainer_flags(command)
    assert command[-2:] == ["--config", "dit-xl2-256"]
    with pytest.raises(UserError, match="no recipe of that name"):
        check_trainer_flags(launch_command([*args, "--config", "dit-xl2-1024"]))


def test_the_trainer_command_exits_2_on_an_unknown_key(tiny_plan, tmp_path, capsys):
    from dit_accel.train.launch import launch_command
    from dit_accel.train.loop import main

    recipe = tmp_path / "typo.yaml"
    recipe.write_text("description: a typo\nema-decy: 0.9\n")
    args = ["--plan", str(tiny_plan), "--latents", str(tmp_path), "--output-dir", str(tmp_path / "run")]
    assert main([*args, "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown key 'ema-decy'" in err and not (tmp_path / "run").exists()
    # `dit-accel train --config FILE` hands the recipe to the trainer unchanged
    command = launch_command(["--plan", str(tiny_plan), "--config", str(recipe), "--lr", "1e-3"])
    assert command[-4:] == ["--config", str(recipe), "--lr", "1e-3"]


@pytest.mark.launched
def test_the_repa_cpu_block_of_the_recipes_doc_runs_as_written(tmp_path):
    """docs/recipes.md, "REPA on a CPU": every command of the marked block, through the console scripts, in a
    fresh folder; the run's checkpoint holds the trained projector beside the network."""
    import os
    import re
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "recipes.md").read_text()
    (block,) = re.findall(r"<!-- cpu-repa -->\s*```bash\n(.*?)```", text, flags=re.S)
    commands = [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert [c.split()[:2] for c in commands] == [
        ["dit-accel", "demo-data"],
        ["dit-plan", "--model"],
        ["dit-accel", "doctor"],
        ["dit-accel", "train"],
    ]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
    weights = load_file(
        next((tmp_path / "runs" / "repa" / "checkpoints" / "step_00000020").rglob("model.safetensors"))
    )
    assert any(key.startswith("repa_projector") for key in weights)
    log = (tmp_path / "runs" / "repa" / "logs" / "rank0.log").read_text()
    assert "is no published DINOv2 backbone" in log
