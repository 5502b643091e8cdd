"""The config files dit-accel ships, by name: cluster presets (`dit-plan --config h100-80g-8x`) and training
recipes (`dit-accel train --config dit-xl2-256`).

The repository keeps one copy of each, in configs/clusters/ and configs/recipes/; pyproject.toml maps those
folders into the wheel as planner/clusters/ and dit_accel/recipes/, so an installed package finds them
beside its code and a checkout finds them in configs/.
"""

from __future__ import annotations

from pathlib import Path

from planner.errors import PlanError

SOURCE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"  # a checkout's configs/
SUFFIXES = (".yaml", ".yml")


def shipped_folder(package_dir: Path, kind: str) -> Path:
    """The folder of one kind of config: `<package>/<kind>` in an installed package, else configs/<kind>."""
    installed = Path(package_dir) / kind
    return installed if installed.is_dir() else SOURCE_CONFIGS / kind


def named_configs(folder: Path) -> dict[str, Path]:
    """Name (the file name without .yaml) -> file; a name before its variants (h200-4x8, h200-4x8-512)."""
    found = [p for p in Path(folder).glob("*") if p.suffix in SUFFIXES] if Path(folder).is_dir() else []
    files = sorted(found, key=lambda p: p.stem.split("-"))
    return {path.stem: path for path in files}


def resolve_config(text: str, folder: Path, what: str, listing: str | None = None) -> Path:
    """A `--config` value as a file: a path that exists, else a shipped config's name. Anything else is one
    line naming the shipped ones (`what`: "cluster preset"; `listing`: the command that describes them)."""
    path = Path(text)
    if path.is_file():
        return path
    named = named_configs(folder)
    name = path.name.removesuffix(path.suffix) if path.suffix in SUFFIXES else path.name
    if name in named and str(path.parent) == ".":
        return named[name]
    known = ", ".join(named) or "none"
    if name in named:  # a path into a checkout's configs/ that is not here: the same file ships by name
        raise PlanError(
            f"--config {text}: no such file", f"the shipped {what} of that name is --config {name}"
        )
    if str(path.parent) != "." or path.suffix in SUFFIXES:
        problem = f"--config {text}: no such file"
    else:
        problem = f"--config {text}: no {what} of that name"
    raise PlanError(
        problem, f"give a file, or a shipped {what}: {known}" + (f" ({listing})" if listing else "")
    )
