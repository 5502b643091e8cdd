"""One plain log per rank in RUN/logs/, the main process also printing to the terminal between progress-bar
lines: the logger every part of a run writes to, and its flush before a rank exits."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("dit_accel.train")


def setup_logging(run_dir: Path, rank: int, is_main: bool) -> Path:
    """One plain log per rank in RUN/logs/; the main process also prints to the terminal."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank{rank}.log"
    for handler in list(log.handlers):  # a second run in the same process (tests) starts clean
        handler.close()
        log.removeHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
    log.addHandler(file_handler)
    if is_main:
        log.addHandler(_TqdmHandler())
    return path


class _TqdmHandler(logging.Handler):
    """Terminal lines that do not tear the progress bar."""

    def emit(self, record):
        from tqdm import tqdm

        if getattr(record, "file_only", False):
            return
        tqdm.write(
            ("WARNING: " if record.levelno >= logging.WARNING else "") + record.getMessage(), file=sys.stdout
        )


def flush_logs() -> None:
    for handler in log.handlers:
        handler.flush()
