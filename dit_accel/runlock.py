"""One run per run folder: RUN/run.lock, held by the main process from before anything is written to exit.

Two jobs writing one run folder (a requeued job next to the one still running, a copy-pasted command) would
interleave checkpoints, rotate each other's away and mix two timelines in one metrics.jsonl. The lock file is
created with O_CREAT|O_EXCL, so of two starters exactly one wins; it names the host, pid and start time, and
a background thread refreshes its mtime every HEARTBEAT_S seconds while the run lives.

A lock that is left behind (the holder was killed, so no exit handler ran) is taken over, with a message:
- on this host, when its pid is no longer alive;
- from another host, when its heartbeat is older than STALE_AFTER_S (its run cannot be alive there: a live
  holder refreshes it every minute). A fresher one is refused; the message says how to remove it by hand.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from dit_accel.errors import UserError

LOCK_NAME = "run.lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0  # ten missed heartbeats


class RunLock:
    """A held lock: its file, what it says, and the heartbeat thread that keeps it fresh."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # a folder removed under a live run: nothing to refresh

    def release(self) -> None:
        self._stop.set()
        if _read(self.path) == self.holder:  # never remove a lock another run took over
            self.path.unlink(missing_ok=True)


_held: list[RunLock] = []


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "nonce": os.urandom(8).hex(),
    }


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _create(path: Path, holder: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(holder) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _stale_reason(path: Path, found: dict | None) -> str | None:
    """Why a lock left behind may be taken over, or None while its run may still be alive."""
    try:
        age_s = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "gone"
    if found is None:  # unreadable: a holder killed between create and write, or garbage
        return f"unreadable, last touched {age_s:.0f} s ago" if age_s > HEARTBEAT_S else None
    if found.get("host") == socket.gethostname():
        pid = int(found.get("pid", -1))
        return None if pid > 0 and _pid_alive(pid) else f"pid {pid} on this host is no longer running"
    if age_s > STALE_AFTER_S:
        return f"its heartbeat stopped {age_s / 60:.0f} minutes ago"
    return None


def acquire(run_dir: str | Path) -> tuple[RunLock, str | None]:
    """Take RUN/run.lock or raise UserError; the second value says what stale lock was taken over."""
    path = Path(run_dir) / LOCK_NAME
    holder = _me()
    note = None
    for _attempt in range(3):
        if _create(path, holder):
            lock = RunLock(path, holder)
            _held.append(lock)
            return lock, note
        found = _read(path)
        reason = _stale_reason(path, found)
        if reason is None:
            who = (
                f"pid {found.get('pid')} on {found.get('host')}, started {found.get('started')}"
                if found
                else "a lock being written just now"
            )
            raise UserError(
                f"{run_dir} is in use by another run ({who}; lock {path})",
                "wait for it to end or use another --output-dir; if no run is using it, delete the lock file",
            )
        # Move the stale lock aside under a private name, then check it is the one judged stale: two
        # starters racing for the same stale lock must not both win.
        aside = path.with_name(f".{LOCK_NAME}.{holder['nonce']}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _read(aside) != found:  # another starter's fresh lock: put it back untouched
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            continue
        aside.unlink(missing_ok=True)
        note = f"took over a stale run lock {path} ({found or 'unreadable'}): {reason}"
    raise UserError(f"could not take the run lock {path}", "another run is starting in the same folder")


def release_all() -> None:
    """Release every lock this process holds (the trainer's exit path)."""
    while _held:
        _held.pop().release()
