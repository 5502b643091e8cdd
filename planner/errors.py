"""The errors a user should ever see: one sentence naming the problem, and the fix as its own field."""

from __future__ import annotations


class OneLineError(Exception):
    """A problem the user must fix, never a bug: printed as one line (`problem; fix`), exit code 2.

    `fix` is what to do about it, kept apart so that a table (`dit-accel doctor`) can show it in its own
    column; older call sites still pass one sentence holding both, and then `fix` is None.
    """

    def __init__(self, problem: str, fix: str | None = None):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class PlanError(OneLineError, ValueError):
    """Bad input to the planner, an impossible request, or a plan.json that is not one."""
