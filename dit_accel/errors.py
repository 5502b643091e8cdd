"""User-facing failures and the trainer's exit codes: one line naming the problem and the fix, no traceback.

Exit codes (the same from `python -m dit_accel.train` and `dit-accel train`; plain `accelerate launch` turns
every failure into 1):

    0  done                              3  stopped itself on a non-finite loss or gradient (NaN/Inf)
    2  bad input: the one line says why  4  preempted (a signal) after saving that step: requeue it
    5  a rank stopped making progress for --collective-timeout-s (a hang): ended, nothing saved
    1  anything else: a traceback, or a rank whose peer died in a collective (the peer's line says why)

Under a launcher a rank's code would be lost (torch elastic reports 1 for any failed worker), so each rank
writes it, with its one line, to DIT_ACCEL_EXIT_DIR/exit_rankR.json when `dit-accel train` sets that
variable, and the wrapper exits with it (`exit_code_of_ranks`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

from planner.errors import OneLineError, PlanError

EXIT_DONE, EXIT_USER, EXIT_STOPPED, EXIT_PREEMPTED, EXIT_HUNG = 0, 2, 3, 4, 5
EXIT_DIR_ENV = "DIT_ACCEL_EXIT_DIR"


class UserError(OneLineError):
    """Raised for bad input or a state the user must fix; never for a bug in dit-accel."""


USER_ERRORS = (UserError, PlanError)


def first_line(error: BaseException) -> str:
    """An exception's first line, or its type where it says nothing."""
    lines = str(error).splitlines()
    return lines[0] if lines and lines[0].strip() else type(error).__name__


class TrainingStopped(Exception):
    """The run refused to go on (a non-finite step under --nan-policy abort): EXIT_STOPPED; the message says
    how to resume."""


class Preempted(Exception):
    """A rank was asked to stop (dit_accel.run.preemption) and its step is saved: EXIT_PREEMPTED; the message says
    how to go on."""


def exits_cleanly(prog: str):
    """Wrap a `main(argv) -> int` so a UserError/PlanError prints one line to stderr and exits 2."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except USER_ERRORS as error:
                print(f"{prog}: error: {error}", file=sys.stderr)
                return EXIT_USER

        return run

    return wrap


def write_exit_record(code: int, message: str = "", env: dict | None = None) -> None:
    """This rank's exit code and one line, for the `dit-accel train` wrapper; nothing without the wrapper."""
    env = os.environ if env is None else env
    folder = env.get(EXIT_DIR_ENV)
    if not folder:
        return
    rank = int(env.get("RANK", "0") or 0)
    path = Path(folder) / f"exit_rank{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps({"rank": rank, "code": int(code), "message": message}))
        os.replace(tmp, path)
    except OSError:
        pass


def read_exit_records(folder: Path) -> dict[int, dict]:
    records = {}
    for path in sorted(Path(folder).glob("exit_rank*.json")):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return records


def exit_code_of_ranks(launcher_code: int, records: dict[int, dict]) -> int:
    """The run's exit code: the launcher's when it succeeded or no rank explained its failure; otherwise the
    most telling rank code (bad input, then a hang, NaN, preemption), never 0 for a failed launch."""
    if launcher_code == 0:
        return 0
    codes = {record["code"] for record in records.values()}
    for code in (EXIT_USER, EXIT_HUNG, EXIT_STOPPED, EXIT_PREEMPTED):
        if code in codes:
            return code
    return launcher_code


def exit_command(main) -> None:
    """`sys.exit(main())` for a command's `__main__`, except in a process that made a process group: there it
    flushes what the process wrote and ends with os._exit, so that no teardown frees the group
    (dit_accel.distributed.accelerator.end_process_group says why). Imports no torch: `--help` stays light."""
    try:
        code = main()
    except SystemExit as leaving:
        code = leaving.code
    dist = sys.modules.get("torch.distributed")
    kept = getattr(sys.modules.get("dit_accel.distributed.accelerator"), "_kept_groups", [])
    if dist is not None and dist.is_available() and dist.is_initialized():  # an error path that kept it
        kept.extend(dist.distributed_c10d._world.pg_map)
    if not kept:
        sys.exit(code)
    if isinstance(code, str):  # what sys.exit does with a message
        print(code, file=sys.stderr)
        code = 1
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
