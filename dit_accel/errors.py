"""User-facing failures: one line naming the problem and the fix, exit code 2, no traceback."""

from __future__ import annotations

import functools
import sys

from planner.errors import OneLineError, PlanError


class UserError(OneLineError):
    """Raised for bad input or a state the user must fix; never for a bug in dit-accel."""


USER_ERRORS = (UserError, PlanError)


def exits_cleanly(prog: str):
    """Wrap a `main(argv) -> int` so a UserError/PlanError prints one line to stderr and exits 2."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except USER_ERRORS as error:
                print(f"{prog}: error: {error}", file=sys.stderr)
                return 2

        return run

    return wrap
