"""The doctor's verdict for people (a table, one row per check) and for scripts (JSON)."""

from __future__ import annotations

import json
import shutil
from collections import Counter

from tabulate import tabulate

from dit_accel.doctor.checks import Check, Status, exit_code

FIXED_COLUMNS_WIDTH = 62  # group, check (wrapped at 20), status and the grid's borders
MIN_TEXT_WIDTH = 50  # reason + fix never squeezed below this, however narrow the terminal


def text_widths(columns: int | None = None) -> tuple[int, int]:
    """Reason and fix column widths that fill the terminal (COLUMNS, else 160 when not a terminal), 3:2."""
    columns = columns or shutil.get_terminal_size((160, 24)).columns
    text = max(MIN_TEXT_WIDTH, columns - FIXED_COLUMNS_WIDTH)
    return text * 3 // 5, text - text * 3 // 5


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
        f"{counts[Status.PASS]} passed, {counts[Status.WARN]} warning(s), {counts[Status.FAIL]} failed: "
        f"{verdict}"
    )


def format_table(checks: list[Check], strict: bool = False, mode: str = "preflight") -> str:
    rows = [(check.group, check.name, check.status.value, check.reason, check.fix or "-") for check in checks]
    reason_width, fix_width = text_widths()
    table = tabulate(
        rows,
        headers=("group", "check", "status", "reason", "fix"),
        tablefmt="simple_grid",
        maxcolwidths=[None, 20, None, reason_width, fix_width],
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
