"""Command-line values checked where they are parsed: a bad one is one line (exit 2), not a later traceback.

`OneLineParser` turns argparse's usage-and-exit into a UserError; the `type=` functions below refuse NaN,
infinities, negative counts and ports outside 1..65535 with a message that argparse prefixes with the flag.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dit_accel.errors import UserError

MAX_SEED = 2**31 - 1  # seed + rank must stay a valid seed for torch, numpy and Python alike


def shown_default(value) -> str:
    """A default as a user would type it: on/off for switches, `0.9 0.999` for a pair."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return str(value)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help line ends with its default, unless the line already says what the default is
    (flags without one, None or '', say nothing)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.dest == "help"
            or default in (None, "", argparse.SUPPRESS)
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default: {shown_default(default).replace('%', '%%')})"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one UserError line naming the flag, with `--help` as the fix, and whose
    help shows every flag's default (`DefaultsHelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UserError(self.suggested(message), f"see `{self.prog} --help`")

    def suggested(self, message: str) -> str:
        """`message` with the nearest known flag for each unknown one (`with_flag_suggestions`)."""
        from planner.errors import with_flag_suggestions

        return with_flag_suggestions(message, self._option_string_actions)


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_float(text: str) -> float:
    return _number(text, float)


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def seed_int(text: str) -> int:
    value = _number(text, int)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_SEED}, got {text}")
    return value


def refuse_file(path, flag: str) -> None:
    """A folder argument that names an existing file: one line before anything is read or written."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder", f"pass a folder as {flag}")


def port(text: str) -> int:
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535 (0: any free port), got {text}")
    return value
