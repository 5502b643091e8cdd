"""`--config NAME|FILE`: a training recipe, a flat YAML file whose keys are the trainer's flag names; a
shipped recipe (configs/recipes/, inside the package when installed) by its name: `--config dit-xl2-256`.

    description: DiT-XL/2 at 256 px, the paper's recipe      # shown by configs/README.md, not a flag
    lr: 1.0e-4
    ema-decay: 0.9999
    scale_lr: false

The recipe becomes command-line words placed before the real ones (`--lr 0.0001 --ema-decay 0.9999
--no-scale-lr`), so each value goes through the same parser and checks as a typed flag, and a flag given
on the command line overrides the recipe's (argparse keeps the last). An unknown key is one line, exit 2.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from dit_accel.errors import UserError
from planner.configs import named_configs, resolve_config, shipped_folder
from planner.errors import PlanError

DESCRIPTION_KEY = "description"
RECIPES = shipped_folder(Path(__file__).resolve().parents[1], "recipes")  # dit_accel/recipes in a wheel


def shipped_recipes() -> dict[str, Path]:
    """The recipes that come with dit-accel, by name."""
    return named_configs(RECIPES)


def recipe_file(text: str | Path) -> Path:
    """A --config value as a recipe file: a path that exists, else a shipped recipe's name."""
    try:
        return resolve_config(str(text), RECIPES, "recipe")
    except PlanError as error:
        raise UserError(error.problem, error.fix) from None


def read_recipe(path: str | Path, fields: Collection[str]) -> dict:
    """The recipe's keys (as field names, `-` -> `_`) and values, its description left out; `fields` are
    the names a key may have (TrainConfig's fields)."""
    import yaml

    path = recipe_file(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise UserError(
            f"--config {path}: cannot read it ({error.strerror})", "pass a recipe YAML file"
        ) from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise UserError(f"--config {path} is not valid YAML{line}", "fix the file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            f"--config {path} must be a mapping of flag names to values",
            "see the shipped recipes, e.g. dit-xl2-256",
        )
    values = {}
    for key, value in data.items():
        name = str(key).strip().lstrip("-").replace("-", "_")
        if name == DESCRIPTION_KEY:
            continue
        if name not in fields:
            raise UserError(
                f"--config {path}: unknown key {key!r}",
                "use the trainer's flag names (python -m dit_accel.train --help), e.g. lr, ema-decay",
            )
        if isinstance(value, (dict, list)) and name != "betas":
            raise UserError(f"--config {path}: {key} must be a single value, got {value!r}", "fix the file")
        values[name] = value
    return values


def recipe_argv(path: str | Path, fields: Collection[str]) -> list[str]:
    """The recipe as the command-line words that say the same."""
    words = []
    for name, value in read_recipe(path, fields).items():
        flag = f"--{name.replace('_', '-')}"
        if value is None:  # "unset": the flag's own default
            continue
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return words
