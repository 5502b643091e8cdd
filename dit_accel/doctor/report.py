"""The doctor's verdict for people (a table, one row per check) and for scripts (JSON)."""

from __future__ import annotations

import json
import shutil
from collections import Counter

from tabulate import tabulate

from dit_accel.doctor.checks import Check, Status, exit_code
from planner.units import count

TABLE_WIDTH = 100  # at most, like dit-plan's tables; a narrower terminal (COLUMNS) narrows it
CHECK_WIDTH = 18  # the check's name, wrapped
FIXED_COLUMNS_WIDTH = CHECK_WIDTH + 8 + 10  # the check, the status (its header padded) and the borders
MIN_TEXT_WIDTH = 40  # the finding and fix never squeezed below this, however narrow the terminal


def text_width(columns: int | None = None) -> int:
    """The width of the finding-and-fix column: the table fills the terminal up to TABLE_WIDTH columns."""
    columns = min(columns or shutil.get_terminal_size((TABLE_WIDTH, 24)).columns, TABLE_WIDTH)
    return max(MIN_TEXT_WIDTH, columns - FIXED_COLUMNS_WIDTH)


VERDICTS = {
    "preflight": {
        0: "ready to launch",
        1: "warnings stop the launch (--strict)",
        2: "fix the failures before launching",
    },
    "log": {
        0: "no failure found",
        1: "a failure this doctor does not recognise",
        2: "fix the root cause first",
    },
}


def summary_line(checks: list[Check], strict: bool, mode: str = "preflight") -> str:
    counts = Counter(check.status for check in checks)
    verdict = VERDICTS[mode][exit_code(checks, strict)]
    return (
        f"{counts[Status.PASS]} passed, {count(counts[Status.WARN], 'warning')}, {counts[Status.FAIL]} "
        f"failed: {verdict}"
    )


def format_table(checks: list[Check], strict: bool = False, mode: str = "preflight") -> str:
    """One row per check, at most TABLE_WIDTH columns wide: the check, its status, and what was found with
    the fix below it (the group is in the JSON; the checks come grouped)."""
    rows = [
        (check.name, check.status.value, check.reason + (f"\nfix: {check.fix}" if check.fix else ""))
        for check in checks
    ]
    table = tabulate(
        rows,
        headers=("check", "status", "finding and fix"),
        tablefmt="simple_grid",
        maxcolwidths=[CHECK_WIDTH, None, text_width()],
    )
    return table + "\n" + summary_line(checks, strict, mode)


def format_json(checks: list[Check], strict: bool = False) -> str:
    counts = Counter(check.status.value for check in checks)
    return json.dumps(
        {
            "exit_code": exit_code(checks, strict),
            "strict": strict,
            "counts": {status.value: counts[status.value] for status in Status},
            "checks": [check.to_dict() for check in checks],
        },
        indent=2,
    )


def render(checks: list[Check], output_format: str, strict: bool = False, mode: str = "preflight") -> str:
    return format_json(checks, strict) if output_format == "json" else format_table(checks, strict, mode)
