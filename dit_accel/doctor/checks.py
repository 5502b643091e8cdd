"""The result of one preflight check, and how a list of them becomes an exit code.

Every check is a pure function of facts (the plan, and what a probe read from this machine), so a test
can build any failing situation from plain values without a GPU, a small disk or a broken network.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table: what was checked, the verdict, why, and what to do about it."""

    group: str  # environment | host | data | output | distributed | log
    name: str
    status: Status
    reason: str
    fix: str = ""

    def to_dict(self) -> dict:
        return {
            "group": self.group,
            "name": self.name,
            "status": self.status.value,
            "reason": self.reason,
            "fix": self.fix,
        }


def passed(group: str, name: str, reason: str) -> Check:
    return Check(group, name, Status.PASS, reason)


def warned(group: str, name: str, reason: str, fix: str) -> Check:
    return Check(group, name, Status.WARN, reason, fix)


def failed(group: str, name: str, reason: str, fix: str) -> Check:
    return Check(group, name, Status.FAIL, reason, fix)


EXIT_OK, EXIT_WARNINGS, EXIT_FAILED = 0, 1, 2


def exit_code(checks: list[Check], strict: bool = False) -> int:
    """2 on any failure; 1 on warnings when --strict asks warnings to stop a launch; else 0."""
    statuses = {check.status for check in checks}
    if Status.FAIL in statuses:
        return EXIT_FAILED
    if strict and Status.WARN in statuses:
        return EXIT_WARNINGS
    return EXIT_OK


def gib(num_bytes: float) -> str:
    """Bytes as the GiB figure nvidia-smi and /proc/meminfo users compare against."""
    if abs(num_bytes) < 2**30:
        return f"{num_bytes / 2**20:.0f} MiB"
    return f"{num_bytes / 2**30:.1f} GiB"
