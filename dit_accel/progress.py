"""Progress for a terminal and for a log file alike: one helper, `progress_bar`, used by training,
extract-latents and sampling.

On a terminal it is tqdm. When the output is not a terminal (a SLURM log, `| tee`, a CI job) tqdm's
carriage-return redraws pile up into a single line of many kilobytes, so there the same calls print a plain
line instead (also when only the log lines on stdout are piped: a bar between them would be torn): at the
start, each time another `every_percent` of the total is done, when `every_s` seconds have passed since the
last line, and at the end.
"""

from __future__ import annotations

import sys
import time

EVERY_PERCENT = 10
EVERY_S = 30.0


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(
    iterable=None,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    initial: int = 0,
    disable: bool = False,
    leave: bool = True,
    file=None,
    every_percent: float = EVERY_PERCENT,
    every_s: float = EVERY_S,
):
    """tqdm on a terminal, `PlainProgress` elsewhere; both take the calls the project makes (iterate,
    `update`, `set_postfix`, `close`, `leave`)."""
    file = sys.stderr if file is None else file
    # a bar only when the log lines share its terminal: with stdout piped (`| tee run.log`) they reached the
    # screen after the bar's redraw, glued to its end ("loss=0.0368step 800/800")
    if is_terminal(file) and is_terminal(sys.stdout):
        from tqdm import tqdm

        return tqdm(
            iterable,
            total=total,
            desc=desc,
            unit=unit,
            initial=initial,
            disable=disable,
            leave=leave,
            file=file,
            dynamic_ncols=True,
        )
    return PlainProgress(iterable, total, desc, unit, initial, disable, leave, file, every_percent, every_s)


class PlainProgress:
    """Whole lines, e.g. `encoding: 512/1024 img (50%), 12.3 s, 41.6 img/s, loss=0.1`, never a redraw."""

    def __init__(self, iterable, total, desc, unit, initial, disable, leave, file, every_percent, every_s):
        self.iterable, self.desc, self.unit, self.file = iterable, desc, unit, file
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n, self.start_n = total, initial, initial
        self.disable, self.leave = disable, leave
        self.every_percent, self.every_s = every_percent, every_s
        self.postfix = ""
        self.started = self.last_print_s = time.monotonic()
        self.next_percent = 0.0
        self.closed = False
        self.printed_n = None
        self._maybe_print(force=True)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __len__(self) -> int:
        return self.total or 0

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_print()

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.leave and self.printed_n != self.n:
            self._maybe_print(force=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        parts = [f"{done} {self.unit}{percent}", f"{elapsed:.1f} s", f"{rate:.3g} {self.unit}/s"]
        if self.postfix:
            parts.append(self.postfix)
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    def _maybe_print(self, force: bool = False) -> None:
        if self.disable:
            return
        now = time.monotonic()
        percent = 100 * self.n / self.total if self.total else 0.0
        due = (
            force or now - self.last_print_s >= self.every_s or (self.total and percent >= self.next_percent)
        )
        if not due:
            return
        print(self.line(), file=self.file, flush=True)
        self.printed_n, self.last_print_s = self.n, now
        if self.total and self.every_percent > 0:  # the next multiple of every_percent above this point
            self.next_percent = (percent // self.every_percent + 1) * self.every_percent
