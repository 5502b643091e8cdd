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

A stop signal (the trainer's --preempt-signals) that ends the run before the ranks could say so themselves
(the wrapper or the launcher still starting, ranks still importing, or killed after the launcher's grace
period) is still a preemption: the wrapper exits 4, with one line, so that the job is requeued.
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
    EXIT_HUNG,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_USER,
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
        "--plan",
        help="plan.json written by dit-plan; its accelerate_config.yaml must lie beside it (required)",
    )
    parser.add_argument(
        "--accelerate-config",
        "--accelerate_config",
        dest="accelerate_config",
        help=f"another Accelerate config than PLAN_DIR/{CONFIG_NAME} (default: none: the plan's)",
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
    if (
        planned_processes(plan) == 1
    ):  # one process: accelerate's own launcher ends a failed rank in a traceback
        command.append("--quiet")  # (chained to the rank's stderr tail) that --quiet leaves out
    return command + ["-m", "dit_accel.train", "--plan", str(plan), *trainer_args]


def planned_processes(plan_path: Path) -> int | None:
    """The plan's world size, or None for a plan the ranks will refuse in one line themselves."""
    from planner.errors import PlanError
    from planner.planfile import read_plan

    try:
        return read_plan(plan_path).world_size
    except PlanError:
        return None


def check_process_count(plan_path: Path, num_processes: str) -> None:
    """--num-processes must be the plan's world size: refused here, before any process starts."""
    from planner.units import count

    planned = planned_processes(plan_path)
    if planned is None:
        return
    if not str(num_processes).isdigit() or int(num_processes) != planned:
        raise UserError(
            f"--num-processes {num_processes} but {plan_path} is planned for {count(planned, 'process')}",
            f"drop --num-processes (the plan's config says {planned}), or re-plan with `dit-plan --gpus "
            f"{num_processes}`",
        )


def _die_with_wrapper() -> None:  # in the launcher, before exec: SIGTERM when the wrapper dies
    from dit_accel.run.preemption import die_with_parent

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


class _Received:
    """The stop signals the wrapper got, from its start on: forwarded to the launcher once it runs."""

    def __init__(self) -> None:
        self.signums: list[int] = []  # every one, for the exit code
        self._pending: list[int] = []  # those before the launcher ran, forwarded once it does
        self._launcher: subprocess.Popen | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in FORWARDED_SIGNALS}

    def _handle(self, signum, _frame) -> None:
        self.signums.append(signum)
        if self._launcher is None:
            self._pending.append(signum)
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        try:
            os.killpg(self._launcher.pid, signum)
        except ProcessLookupError:
            pass

    def started(self, launcher: subprocess.Popen) -> None:
        self._launcher = launcher
        while self._pending:
            self._forward(self._pending.pop(0))

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def stop(self, stop_signals) -> int:
        """The first of the trainer's stop signals received (0: none)."""
        return next((signum for signum in self.signums if signum in set(stop_signals)), 0)


def _preempted_line(signum: int) -> str:
    return (
        f"dit-accel train: preempted by {signal.Signals(signum).name} before the ranks could save (they were "
        f"starting, or outlived the launcher's grace period): nothing new is saved; exit {EXIT_PREEMPTED} "
        "(requeue and resume with --resume auto)"
    )


def run_launcher(command: list[str], received: _Received, stop_signals=()) -> int:
    """Run the launcher in its own process group, forwarding stop signals to it; its ranks' exit code, or
    4 when one of `stop_signals` ended the run before a rank said why."""
    if received.stop(stop_signals):  # stopped before anything started: nothing to start
        print(_preempted_line(received.stop(stop_signals)), file=sys.stderr)
        return EXIT_PREEMPTED
    with tempfile.TemporaryDirectory(prefix="dit-accel-exit-") as exit_dir:
        env = dict(os.environ, **{EXIT_DIR_ENV: exit_dir})
        env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", ELASTIC_SIGNALS)
        launcher = subprocess.Popen(
            command, env=env, start_new_session=True, preexec_fn=_die_with_wrapper, stderr=subprocess.PIPE
        )
        received.started(launcher)  # signals from now on go to its process group
        stderr = _LauncherStderr(launcher.stderr)
        stderr.start()
        launcher_code = launcher.wait()
        code = exit_code_of_ranks(launcher_code, read_exit_records(Path(exit_dir)))
        stopped = received.stop(stop_signals)
        if stopped and code not in (0, EXIT_USER, EXIT_STOPPED, EXIT_PREEMPTED, EXIT_HUNG):
            stderr.finish(explained=True)  # the launcher's SignalException is not the story
            print(_preempted_line(stopped), file=sys.stderr)
            return EXIT_PREEMPTED
        stderr.finish(explained=code != launcher_code or (code == 0))
        return code


@exits_cleanly("dit-accel train")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from dit_accel.train.config import build_parser as trainer_parser

        print(build_parser().format_help())
        trainer_parser().print_help()
        return 0
    received = _Received()  # from here on a stop signal is a preemption, also before the launcher runs
    try:
        command = launch_command(argv)
        if build_parser().parse_known_args(argv)[0].print_command:
            print(shlex.join(["accelerate", "launch", *command[3:]]))
            return 0
        config = check_trainer_flags(command)
        check_inputs_before_launch(config)
        from dit_accel.train.config import parse_signals

        return run_launcher(command, received, parse_signals(config.preempt_signals))
    finally:
        received.restore()


def check_inputs_before_launch(config) -> None:
    """The inputs' cheap checks (`train.data.check_inputs`), here before any process starts: a missing
    --data-path or encoder is one line at once, not one after the ranks' start-up and torch elastic's
    lines, and no run folder is left behind."""
    from dit_accel.train.data import check_inputs
    from planner.errors import PlanError
    from planner.planfile import read_plan

    try:
        plan = read_plan(config.plan)
    except PlanError:  # the ranks refuse it in one line themselves, as for the process count
        return
    check_inputs(plan, config)


def check_trainer_flags(command: list[str]):
    """The trainer's own flag checks, here before any process starts: a bad --lr is then one line, not one
    line per rank inside the launcher's failure report. Returns the trainer's config."""
    from dit_accel.train.flags import parse_config

    return parse_config(command[command.index("dit_accel.train") + 1 :])
