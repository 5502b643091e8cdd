"""The doctor's verdict for people (a table, one row per check) and for scripts (JSON)."""

from __future__ import annotations

import json
from collections import Counter

from tabulate import tabulate

from dit_accel.doctor.checks import Check, Status, exit_code

REASON_WIDTH = 70
FIX_WIDTH = 50


VERDICTS = {
    "preflight": {0: "ready to launch", 1: "warnings stop the launch (--strict)", 2: "fix the failures before launching"},
    "log": {0: "no failure found", 1: "a failure this doctor does not recognise", 2: "fix the root cause first"},
}


def summary_line(checks: list[Check], strict: bool, mode: str = "preflight") -> str:
    counts = Counter(check.status for check in checks)
    verdict = VERDICTS[mode][exit_code(checks, strict)]
    return (f"{counts[Status.PASS]} passed, {counts[Status.WARN]} warning(s), {counts[Status.FAIL]} failed: "
            f"{verdict}")


def format_table(checks: list[Check], strict: bool = False, mode: str = "preflight") -> str:
    rows = [(check.group, check.name, check.status.value, check.reason, check.fix or "-") for check in checks]
    table = tabulate(rows, headers=("group", "check", "status", "reason", "fix"), tablefmt="simple_grid",
                     maxcolwidths=[None, 20, None, REASON_WIDTH, FIX_WIDTH])
    return table + "\n" + summary_line(checks, strict, mode)


def format_json(checks: list[Check], strict: bool = False) -> str:
    counts = Counter(check.status.value for check in checks)
    return json.dumps({"exit_code": exit_code(checks, strict), "strict": strict,
                       "counts": {status.value: counts[status.value] for status in Status},
                       "checks": [check.to_dict() for check in checks]}, indent=2)


def render(checks: list[Check], output_format: str, strict: bool = False, mode: str = "preflight") -> str:
    return format_json(checks, strict) if output_format == "json" else format_table(checks, strict, mode)
