"""The trainer's settings from its command line (`parse_config`): the recipe of --config, the flags, and on
--resume the run's own record, where every flag the command line (and its recipe) does not name keeps the
value RUN/train_config.json holds, checked against its field's type; what was taken is logged, and a
refusal can tell a value the user typed from the run's own history (`inherited_from`)."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

from dit_accel.cli_args import shown_default
from dit_accel.errors import UserError
from dit_accel.run.checkpoint import TRAIN_CONFIG
from dit_accel.train.config import TrainConfig, _flag, build_parser


def parse_config(argv: list[str]) -> TrainConfig:
    """The command line, after the recipe of `--config FILE` when there is one (the command line wins); with
    --resume, every flag neither names takes the value the run recorded (`inherit_recorded`)."""
    from dit_accel.train.recipe import recipe_argv

    argv = list(argv)
    namespace = build_parser().parse_args(argv)
    if namespace.config:
        fields = [field.name for field in dataclasses.fields(TrainConfig)]
        argv = [*recipe_argv(namespace.config, fields), *argv]
        namespace = build_parser().parse_args(argv)
    values = vars(namespace)
    values.pop("config")
    values["betas"] = tuple(values["betas"])
    config = TrainConfig(**values)
    inherit_recorded(config, argv)
    config.check()
    return config


# Never taken from the record: where the run is and how it starts are what this command line says.
NOT_INHERITED = ("plan", "output_dir", "resume", "init_from", "init_from_ema")
DATA_SOURCES = ("data_path", "latents")  # one choice: either given, neither is inherited
_inherited_notes: list[str] = []  # what inherit_recorded took, logged by resume.choose_start
_inherited_from: dict[str, Path] = {}  # field -> the record inherit_recorded took it from (`inherited_from`)


def inherited_from(name: str) -> Path | None:
    """The run's record a field's value came from on this resume, None when the command line (or the
    defaults) gave it: a refusal names what the user typed, or the run's own history."""
    return _inherited_from.get(name)


def given_fields(argv: list[str]) -> set[str]:
    """The TrainConfig fields `argv` names, whatever their values (the default's too)."""
    return set(vars(build_parser(given_only=True).parse_args(argv))) - {"config"}


def recorded_settings(config: TrainConfig) -> tuple[dict, Path] | None:
    """The settings the run being resumed recorded: RUN/train_config.json (its latest start), else, for
    `--resume PATH` from another folder, PATH's own (a run or checkpoint folder holds one)."""
    candidates = [Path(config.output_dir) / TRAIN_CONFIG]
    if config.resume not in ("auto", "latest"):
        candidates.append(Path(config.resume) / TRAIN_CONFIG)
    for path in candidates:
        if path.is_file():
            try:
                recorded = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                raise UserError(
                    f"cannot read the run's recorded settings {path}: {error}",
                    "restore the file, or delete it to resume with the defaults",
                ) from None
            if not isinstance(recorded, dict):
                raise UserError(
                    f"the run's recorded settings {path} are not a JSON object of flags",
                    "restore the file, or delete it to resume with the defaults",
                )
            return recorded, path
    return None


def inherit_recorded(config: TrainConfig, argv: list[str]) -> list[str]:
    """A resumed run continues as it was: every field the command line (and its recipe) does not name takes
    the run's recorded value, so `--resume auto` alone keeps the run's --lr, --log-every, --seed, ...; a
    flag given says what changes (resume.apply_recipe_changes logs it). Returns the inherited fields whose
    values differ from the defaults, as flags, also noted for the run's log."""
    _inherited_from.clear()  # this command line's, not an earlier one's in the same process
    found = recorded_settings(config) if config.resume else None
    if found is None:
        return []
    recorded, path = found
    given = given_fields(argv)
    skip = {*NOT_INHERITED, *given, *(DATA_SOURCES if given & set(DATA_SOURCES) else ())}
    defaults = TrainConfig()
    taken = []
    for spec in dataclasses.fields(TrainConfig):
        if spec.name in skip or spec.name not in recorded:
            continue
        value = recorded_value(spec.name, recorded[spec.name], path)
        setattr(config, spec.name, value)
        _inherited_from[spec.name] = path
        if value != getattr(defaults, spec.name):
            flag = _flag(spec.name)
            taken.append(
                (f"--{flag}" if value else f"--no-{flag}")
                if isinstance(value, bool)
                else f"--{flag} {shown_default(value)}"
            )
    if taken:
        _inherited_notes.append(
            f"flags not given take the run's recorded values ({path}): {', '.join(taken)}"
        )
    return taken


def recorded_value(name: str, value, path: Path):
    """A recorded setting as the field's type, or one line naming the field: a train_config.json edited by
    hand (or from elsewhere) must not reach the trainer as a TypeError deep in the step."""
    import typing

    hint = typing.get_type_hints(TrainConfig)[name]
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None and type(None) in kinds:
        return None
    if hint == tuple[float, float]:
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
            return tuple(float(v) for v in value)
        kinds = ("a list of two numbers",)
    elif (bool in kinds and isinstance(value, bool)) or (str in kinds and isinstance(value, str)):
        return value
    elif int in kinds and number and isinstance(value, int) or float in kinds and number:
        return float(value) if float in kinds else value
    names = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str"}
    raise UserError(
        f"the run's recorded settings {path} give {name} = {json.dumps(value)}, which is not "
        f"{' or '.join(names.get(kind, str(kind)) for kind in kinds)}",
        f"correct or delete {name} in that file, or pass --{_flag(name)} on the command line",
    )


def inherited_notes() -> list[str]:
    """What `inherit_recorded` took since the last call, for the run's log."""
    notes, _inherited_notes[:] = list(_inherited_notes), []
    return notes
