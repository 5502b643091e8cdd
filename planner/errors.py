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


def with_flag_suggestions(message: str, option_strings) -> str:
    """argparse's "unrecognized arguments: --global-bacth 256" with, for each unknown flag, the nearest known
    one ("did you mean --global-batch?"), as a typo'd --model already gets."""
    import difflib

    if not message.startswith("unrecognized arguments:"):
        return message
    known = [option for option in option_strings if option.startswith("--")]
    hints = []
    for word in message.split(":", 1)[1].split():
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.75)
            if close:
                hints.append(f"did you mean {close[0]} for {word}?")
    return f"{message} ({'; '.join(hints)})" if hints else message
