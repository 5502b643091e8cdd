"""`dit-accel train ...`: run `accelerate launch` with the plan's own Accelerate config.

    dit-accel train --plan plan/plan.json --latents CACHE --output-dir runs/xl2

is exactly

    accelerate launch --config_file plan/accelerate_config.yaml -m dit_accel.train \\
        --plan plan/plan.json --latents CACHE --output-dir runs/xl2

The config is the `accelerate_config.yaml` written beside plan.json by `dit-plan`. Launcher options
(`--num-processes`, `--machine-rank`, `--main-process-ip`, `--main-process-port`) go to `accelerate launch`
(the machine rank differs per node); every other argument goes to the trainer. `--print-command` shows
the command without running it.

Unlike plain `accelerate launch`, which reports 1 for any failed rank, the wrapper exits with the rank's own
code (dit_accel.errors: 2 bad input, 3 NaN stop, 4 preempted after saving, 5 a hang): ranks write it to
DIT_ACCEL_EXIT_DIR, a folder made here. It forwards SIGTERM, SIGINT and SIGUSR1 to the launcher's process
group (the ranks too), has torch elastic forward SIGUSR1 as well, and lets Linux SIGTERM the launcher if the
wrapper itself is killed, so no rank trains on orphaned. When the ranks explain the failure, the launcher's
own traceback (ChildFailedError, SignalException) is left out: the one line a rank printed is the answer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from dit_accel.cli_args import DefaultsHelpFormatter
from dit_accel.errors import (
    EXIT_DIR_ENV,
    UserError,
    exit_code_of_ranks,
    exits_cleanly,
    read_exit_records,
)

CONFIG_NAME = "accelerate_config.yaml"
LAUNCHER_OPTIONS = {  # our flag -> accelerate launch's flag
    "num_processes": "--num_processes",
    "machine_rank": "--machine_rank",
    "main_process_ip": "--main_process_ip",
    "main_process_port": "--main_process_port",
}
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
ELASTIC_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torch elastic's default, plus SLURM's warning
LAUNCHER_TRACEBACK = b"Traceback (most recent call last):"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dit-accel train",
        description=__doc__.splitlines()[0],
        epilog="Every other flag goes to the trainer, `python -m dit_accel.train` (its flags below). Exit "
        "codes: the ranks' own (0 done, 2 bad input, 3 stopped on NaN, 4 preempted, 5 a hang), not 1 for all.",
        add_help=False,
        allow_abbrev=False,
        formatter_class=DefaultsHelpFormatter,
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
            f"--{name.replace('_', '-')}",
            f"--{name}",
            dest=name,
            help=f"passed to accelerate launch as {LAUNCHER_OPTIONS[name]} (default: the config's)",
        )
    parser.add_argument(
        "--print-command",
        "--print_command",
        dest="print_command",
        action="store_true",
        help="print the accelerate launch command and exit",
    )
    parser.add_argument(
        "-h", "--help", action="store_true", help="show this help (these flags, then the trainer's) and exit"
    )
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
    if args.num_processes is not None:
        check_process_count(plan, args.num_processes)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    for name, flag in LAUNCHER_OPTIONS.items():
        if getattr(args, name) is not None:
            command += [flag, str(getattr(args, name))]
    return command + ["-m", "dit_accel.train", "--plan", str(plan), *trainer_args]


def check_process_count(plan_path: Path, num_processes: str) -> None:
    """--num-processes must be the plan's world size: refused here, before any process starts."""
    from planner.errors import PlanError
    from planner.planfile import read_plan
    from planner.units import count

    try:
        planned = read_plan(plan_path).world_size
    except PlanError:
        return  # every rank refuses such a plan in one line itself
    if not str(num_processes).isdigit() or int(num_processes) != planned:
        raise UserError(
            f"--num-processes {num_processes} but {plan_path} is planned for {count(planned, 'process')}",
            f"drop --num-processes (the plan's config says {planned}), or re-plan with `dit-plan --gpus "
            f"{num_processes}`",
        )


def _die_with_wrapper() -> None:  # in the launcher, before exec: SIGTERM when the wrapper dies
    from dit_accel.preemption import die_with_parent

    die_with_parent()


class _LauncherStderr(threading.Thread):
    """Passes the launcher's (and its ranks') stderr through as it comes, holding back only from the last
    "Traceback" on, so the launcher's closing traceback can be dropped once the ranks explained the failure."""

    def __init__(self, source) -> None:
        super().__init__(name="launcher-stderr", daemon=True)
        self.source, self.held = source, b""

    def run(self) -> None:
        out = sys.stderr.buffer
        while chunk := os.read(self.source.fileno(), 65536):
            self.held += chunk
            start = self._last_traceback()
            if start is None:  # all of it, but a last line that may be the start of the marker
                tail = self.held[self.held.rfind(b"\n") + 1 :]
                start = len(self.held) - len(tail) if tail and LAUNCHER_TRACEBACK.startswith(tail) else None
            cut = len(self.held) if start is None else start
            out.write(self.held[:cut])
            out.flush()
            self.held = self.held[cut:]

    def _last_traceback(self) -> int | None:
        """Where the last unprefixed traceback starts (ranks' own ones carry torch's `[rankN]:` prefix)."""
        found = self.held.rfind(b"\n" + LAUNCHER_TRACEBACK)
        if found >= 0:
            return found + 1
        return 0 if self.held.startswith(LAUNCHER_TRACEBACK) else None

    def finish(self, explained: bool) -> None:
        self.join(timeout=10)
        held = self.held
        launcher_own = b"ChildFailedError" in held or b"SignalException" in held
        if held and not (explained and held.startswith(LAUNCHER_TRACEBACK) and launcher_own):
            sys.stderr.buffer.write(held)
            sys.stderr.buffer.flush()


def run_launcher(command: list[str]) -> int:
    """Run the launcher in its own process group, forwarding stop signals to it; its ranks' exit code."""
    with tempfile.TemporaryDirectory(prefix="dit-accel-exit-") as exit_dir:
        env = dict(os.environ, **{EXIT_DIR_ENV: exit_dir})
        env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", ELASTIC_SIGNALS)
        launcher = subprocess.Popen(
            command, env=env, start_new_session=True, preexec_fn=_die_with_wrapper, stderr=subprocess.PIPE
        )
        stderr = _LauncherStderr(launcher.stderr)
        stderr.start()

        def forward(signum, _frame):
            try:
                os.killpg(launcher.pid, signum)
            except ProcessLookupError:
                pass

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
        try:
            launcher_code = launcher.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        records = read_exit_records(Path(exit_dir))
        code = exit_code_of_ranks(launcher_code, records)
        stderr.finish(explained=code != launcher_code or (code == 0))
        return code


@exits_cleanly("dit-accel train")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from dit_accel.train_config import build_parser as trainer_parser

        print(build_parser().format_help())
        trainer_parser().print_help()
        return 0
    command = launch_command(argv)
    if build_parser().parse_known_args(argv)[0].print_command:
        print(shlex.join(["accelerate", "launch", *command[3:]]))
        return 0
    check_trainer_flags(command)
    return run_launcher(command)


def check_trainer_flags(command: list[str]) -> None:
    """The trainer's own flag checks, here before any process starts: a bad --lr is then one line, not one
    line per rank inside the launcher's failure report."""
    from dit_accel.train_config import parse_config

    parse_config(command[command.index("dit_accel.train") + 1 :])
