"""The one error type a user should ever see from the planner: a sentence naming the problem and the fix."""


class PlanError(ValueError):
    """Bad input or an impossible request. The CLI prints `str(error)` on one line and exits 2."""
