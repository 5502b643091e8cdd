"""`python tests/teardown_probe.py MODULE ARGS...`: run MODULE as `python -m MODULE ARGS...` would, and say so on
stderr if the interpreter's teardown then runs. A launched command must end without it
(dit_accel.distributed.accelerator.exit_command): the teardown frees the gloo process group, whose worker threads then
can abort the rank (SIGABRT) or, freed earlier, deadlock it. Imported, `teardowns` reads the lines back."""

import atexit
import os
import runpy
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).resolve())
MARK = ": the interpreter's teardown ran"


def teardowns(stderr: str) -> list[str]:
    """The ranks ("rank R") whose interpreter ran its teardown."""
    return sorted(line.split(MARK)[0] for line in stderr.splitlines() if MARK in line)


def _say_teardown() -> None:
    print(f"rank {os.environ.get('RANK', '0')}{MARK}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    atexit.register(_say_teardown)  # atexit runs first in the teardown; os._exit skips it
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
