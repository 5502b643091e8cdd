"""`dit-accel SUBCOMMAND ...`: a thin dispatcher. Each sub-command lives in its own module with `main(argv)`,
imported only when used so that `dit-accel doctor` does not pay for importing diffusers.

Help never waits for torch: a command's module imports torch, diffusers or accelerate only once its flags
are parsed (inside the functions that use them), and the two commands whose modules import torch at their
top (`sample`, `extract-latents`) keep their flags in a light module of their own (`FLAGS`), parsed here
first, so `--help` and a bad flag are answered before the command's module is imported."""

from __future__ import annotations

import importlib
import sys

# name -> (module:function, one-line help)
COMMANDS = {
    "train": ("dit_accel.train.launch:main", "launch dit_accel.train with the plan's Accelerate config"),
    "extract-latents": ("dit_accel.data.latents:main", "encode an image folder into a latent cache"),
    "demo-data": ("dit_accel.data.demo:main", "write a small class-conditional image folder to learn on"),
    "sample": ("dit_accel.sample.command:main", "class-conditional samples (PNG grid, or an .npz for FID)"),
    "export": ("dit_accel.convert.export:main", "a checkpoint as a diffusers DiTPipeline folder"),
    "import-dit": (
        "dit_accel.convert.imports:import_main",
        "an original DiT .pt checkpoint as a dit-accel checkpoint",
    ),
    "import-sit": (
        "dit_accel.convert.imports:import_sit_main",
        "a SiT .pt checkpoint as a dit-accel flow checkpoint",
    ),
    "import-repa": (
        "dit_accel.convert.imports:import_repa_main",
        "a REPA .pt checkpoint as a dit-accel flow checkpoint",
    ),
    "import-lightningdit": (
        "dit_accel.convert.imports:import_lightningdit_main",
        "a LightningDiT .pt checkpoint as a dit-accel flow checkpoint",
    ),
    "verify": ("dit_accel.memtrace.report:main", "trace one real training step and compare it with the plan"),
    "calibrate": (
        "dit_accel.memtrace.calibrate:main",
        "measure the plan on a CUDA GPU and write a calibration file",
    ),
    "doctor": ("dit_accel.doctor:main", "preflight checks before a launch, or read a failed run's log"),
    "evaluate": ("dit_accel.evaluate.command:main", "FID, sFID, IS, precision and recall of a sample .npz"),
}

# command -> the light module:function that builds its parser, where the command's own module is heavy
FLAGS = {
    "extract-latents": "dit_accel.data.latents_args:build_parser",
    "sample": "dit_accel.sample.args:build_parser",
}


def _function(target: str):
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def check_flags(name: str, argv: list[str]) -> int | None:
    """The command's flags parsed by its light parser: an exit code once `--help` is shown (0) or a flag
    is refused (2, one line); None when the command should run."""
    from dit_accel.errors import USER_ERRORS

    parser = _function(FLAGS[name])()
    try:
        parser.parse_args(argv)
    except SystemExit as done:  # --help: printed, nothing to run
        return int(done.code or 0)
    except USER_ERRORS as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return None


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dit-accel COMMAND [ARGS...] | --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Run `dit-accel COMMAND --help` for a command's options. Plans are made by `dit-plan`."]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (the wheel's metadata, not a constant that can drift from it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("dit-accel")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"dit-accel {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"dit-accel: error: unknown command {name!r}; commands are {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    if name in FLAGS and (code := check_flags(name, rest)) is not None:
        return code
    return _function(COMMANDS[name][0])(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
