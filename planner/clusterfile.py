"""`dit-plan --config NAME|FILE`: a cluster preset (configs/clusters/*.yaml, shipped in the package and named
by its file name: `--config h100-80g-8x`) read as the command line it stands for.

A preset is flat YAML whose keys are dit-plan's flag names (`global_batch` or `global-batch`), plus
`description:` (for people and configs/README.md) and `assume:` (a mapping of `--assume` names to values).
The file becomes flags placed before the command line's, so a flag given on the command line wins. The
cluster's shape (`gpus`, `gpus_per_node`, `nodes`) is one unit: any shape flag on the command line replaces
the file's whole shape, and the file's `gpus_per_node` still says how many GPUs one of its nodes holds.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from planner.configs import named_configs, resolve_config, shipped_folder
from planner.errors import PlanError
from planner.units import count

CLUSTERS = shipped_folder(Path(__file__).resolve().parent, "clusters")
LISTING = "dit-plan --list-configs describes them"
SHAPE_KEYS = ("gpus", "gpus_per_node", "nodes")
# flags that are about this invocation, not the cluster or the training: not allowed in a preset
NOT_IN_A_PRESET = (
    "config",
    "out",
    "format",
    "list_assumptions",
    "list_configs",
    "list_gpus",
    "plot",
    "no_chart",
    "wide",
    "version",
    "help",
)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def read_cluster_file(path: str, actions: dict) -> tuple[list[str], dict, str | None]:
    """(flags for everything but the shape, the shape {key: text}, the description) of a preset: a file,
    or a shipped preset's name.

    `actions`: the parser's actions by dest, so that a key is known exactly when dit-plan has the flag."""
    file = resolve_config(path, CLUSTERS, "cluster preset", LISTING)
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise PlanError(
            f"--config {path} is not valid YAML{line}", "write flat `flag: value` lines"
        ) from None
    if not isinstance(data, dict):
        raise PlanError(f"--config {path} holds no `flag: value` mapping", "write e.g. `gpu: a100-80g`")
    flags, shape, description = [], {}, None
    for raw_key, value in data.items():
        key = str(raw_key).strip().replace("-", "_")
        where = f"--config {path}: {raw_key}"
        if key == "description":
            description = str(value)
            continue
        if key in NOT_IN_A_PRESET or key not in actions:
            known = sorted(k for k in actions if k not in NOT_IN_A_PRESET) + ["description"]
            raise PlanError(f"{where} is not a dit-plan flag", f"use one of {', '.join(known)}")
        if key == "assume":
            if not isinstance(value, dict):
                raise PlanError(f"{where} must be a mapping", "write `assume:` then `  NAME: VALUE` lines")
            flags += [arg for name, v in value.items() for arg in ("--assume", f"{name}={_text(v, where)}")]
            continue
        action = actions[key]
        if action.nargs == 0:  # a switch: --round-global-batch, --ema/--no-ema
            if not isinstance(value, bool):
                raise PlanError(f"{where} must be true or false, got {value!r}")
            if type(action).__name__ == "BooleanOptionalAction":
                flags.append(_flag(key) if value else _flag("no_" + key))
            elif value:
                flags.append(_flag(key))
            continue
        text = _text(value, where)
        if action.choices is not None and text not in action.choices:
            raise PlanError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {text!r}")
        if key in SHAPE_KEYS:
            shape[key] = text
        else:
            flags += [_flag(key), text]
    return flags, shape, description


def _text(value, where: str) -> str:
    """A YAML scalar as the flag's text; a list of scalars as a comma list (a sweep)."""
    if isinstance(value, list) and value and all(_scalar(v) for v in value):
        return ",".join(str(v) for v in value)
    if not _scalar(value):
        raise PlanError(f"{where} must be a single value, got {value!r}")
    return str(value)


def _scalar(value) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def preset_rows() -> list[list[str]]:
    """`dit-plan --list-configs`: each shipped preset's name, cluster, GPU, global batch and description."""
    rows = []
    for name, path in named_configs(CLUSTERS).items():
        data = yaml.safe_load(path.read_text()) or {}
        data = {str(key).replace("-", "_"): value for key, value in data.items()}
        if "nodes" in data and "gpus_per_node" in data:
            shape = f"{data['nodes']} x {data['gpus_per_node']}"
        else:
            shape = (
                count(data["gpus"], "GPU")
                if isinstance(data.get("gpus"), int)
                else f"{data.get('gpus')} GPUs"
            )
        batch, resolution = data.get("global_batch", 256), data.get("resolution", 256)
        rows.append(
            [name, shape, data.get("gpu", "-"), f"{batch} @ {resolution} px", data.get("description", "")]
        )
    return rows
