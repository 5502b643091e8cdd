"""`dit-accel train ...`: run `accelerate launch` with the plan's own Accelerate config.

    dit-accel train --plan plan/plan.json --latents CACHE --output-dir runs/xl2

is exactly

    accelerate launch --config_file plan/accelerate_config.yaml -m dit_accel.train \\
        --plan plan/plan.json --latents CACHE --output-dir runs/xl2

The config is the `accelerate_config.yaml` written beside plan.json by `dit-plan`. Launcher options
(`--num-processes`, `--machine-rank`, `--main-process-ip`, `--main-process-port`) go to `accelerate launch`
(the machine rank differs per node); every other argument goes to the trainer. `--print-command` shows
the command without running it.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from dit_accel.errors import UserError, exits_cleanly

CONFIG_NAME = "accelerate_config.yaml"
LAUNCHER_OPTIONS = {  # our flag -> accelerate launch's flag
    "num_processes": "--num_processes",
    "machine_rank": "--machine_rank",
    "main_process_ip": "--main_process_ip",
    "main_process_port": "--main_process_port",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dit-accel train", description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False
    )
    parser.add_argument(
        "--plan", help="plan.json written by dit-plan; its accelerate_config.yaml must lie beside it"
    )
    parser.add_argument(
        "--accelerate-config",
        "--accelerate_config",
        dest="accelerate_config",
        help=f"another Accelerate config than PLAN_DIR/{CONFIG_NAME}",
    )
    for name in LAUNCHER_OPTIONS:
        parser.add_argument(
            f"--{name.replace('_', '-')}", f"--{name}", dest=name, help="passed to accelerate launch"
        )
    parser.add_argument(
        "--print-command",
        "--print_command",
        dest="print_command",
        action="store_true",
        help="print the accelerate launch command and exit",
    )
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def launch_command(argv: list[str]) -> list[str]:
    """The `accelerate launch` argv for `dit-accel train ARGS` (ARGS minus launcher options go to the trainer)."""
    args, trainer_args = build_parser().parse_known_args(argv)
    if not args.plan:
        raise UserError("--plan is required: pass the plan.json written by `dit-plan --out DIR`")
    plan = Path(args.plan)
    config = Path(args.accelerate_config) if args.accelerate_config else plan.parent / CONFIG_NAME
    if not plan.is_file():
        raise UserError(
            f"plan {plan} not found: make one with `dit-plan ... --out DIR` and pass DIR/plan.json"
        )
    if not config.is_file():
        raise UserError(
            f"{config} not found: dit-plan writes it beside plan.json",
            f"re-run dit-plan with --out {plan.parent}, or pass --accelerate-config FILE",
        )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    for name, flag in LAUNCHER_OPTIONS.items():
        if getattr(args, name) is not None:
            command += [flag, str(getattr(args, name))]
    return command + ["-m", "dit_accel.train", "--plan", str(plan), *trainer_args]


@exits_cleanly("dit-accel train")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        from dit_accel.train_config import build_parser as trainer_parser

        trainer_parser().print_help()
        return 0
    command = launch_command(argv)
    if build_parser().parse_known_args(argv)[0].print_command:
        print(shlex.join(["accelerate", "launch", *command[3:]]))
        return 0
    return subprocess.call(command)
