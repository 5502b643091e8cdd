"""One run per run folder: RUN/run.lock, held by the main process from before anything is written to exit.

Two jobs writing one run folder (a requeued job next to the one still running, a copy-pasted command) would
interleave checkpoints, rotate each other's away and mix two timelines in one metrics.jsonl. The lock file is
created with O_CREAT|O_EXCL, so of two starters exactly one wins; it names the host, pid and start time, and
a background thread refreshes its mtime every HEARTBEAT_S seconds while the run lives.

A lock that is left behind (the holder was killed, so no exit handler ran) is taken over, with a message:
- when its pid is no longer alive, but only where that pid can be checked: the same host name, the same
  running kernel (boot id) and the same PID namespace. Containers with host networking (or `--uts=host`,
  k8s `hostNetwork` pods) share the host name but not the PID namespace, and there a live run's pid looks
  dead;
- otherwise (another host, another PID namespace, or a lock that does not say which), when its heartbeat
  is older than STALE_AFTER_S (its run cannot be alive: a live holder refreshes it every minute). A fresher
  one is refused; the message says how to remove it by hand.
"""

from __future__ import annotations

import errno
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
        **_pid_scope(),
    }


def _pid_scope() -> dict:
    """Where a pid means this process: the running kernel (boot id) and the PID namespace (Linux; empty
    elsewhere, and then a pid is never taken as proof)."""
    try:
        return {
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pid_ns": os.readlink("/proc/self/ns/pid"),
        }
    except OSError:
        return {}


def _pid_checkable(found: dict) -> bool:
    """Whether the lock's pid can be looked up from here: this host, kernel and PID namespace."""
    scope = _pid_scope()
    return (
        bool(scope)
        and found.get("host") == socket.gethostname()
        and all(found.get(key) == value for key, value in scope.items())
    )


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
    except OSError as error:  # a read-only mount, a folder of another user's
        if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise UserError(
            f"{path.parent} cannot be written ({os.strerror(error.errno)}): a run folder holds its lock, logs "
            "and checkpoints",
            f"copy the run folder somewhere writable and pass that as --output-dir (cp -r {path.parent} NEW)",
        ) from None
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
    if _pid_checkable(found):
        pid = int(found.get("pid", -1))
        return None if pid > 0 and _pid_alive(pid) else f"pid {pid} on this host is no longer running"
    # A pid of another host or PID namespace proves nothing here: the heartbeat does.
    if age_s > STALE_AFTER_S:
        return f"its heartbeat stopped {age_s / 60:.0f} minutes ago"
    return None


def acquire(run_dir: str | Path) -> tuple[RunLock, str | None]:
    """Take RUN/run.lock or raise UserError; the second value says what stale lock was taken over."""
    path = Path(run_dir) / LOCK_NAME
    holder = _me()
    note = None
    for _attempt in range(3):
        if path.exists() and not path.is_file():  # a folder of that name: never a lock, never moved aside
            raise UserError(
                f"{path} is not a run lock file but a {'folder' if path.is_dir() else 'special file'}",
                f"remove it (rm -r {path}) and start again; dit-accel keeps the run lock in that file",
            )
        if _create(path, holder):
            lock = RunLock(path, holder)
            _held.append(lock)
            return lock, note
        found = _read(path)
        reason = _stale_reason(path, found)
        if reason is None:
            who = _holder(found, path) if found else "a lock being written just now"
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


def _holder(found: dict, path: Path) -> str:
    """`pid N on HOST[ in another PID namespace or boot], started T, heartbeat S s ago`, for a refusal."""
    elsewhere = (
        " in another PID namespace or boot (a container?)"
        if found.get("host") == socket.gethostname() and not _pid_checkable(found)
        else ""
    )
    try:
        beat = f", heartbeat {time.time() - path.stat().st_mtime:.0f} s ago"
    except OSError:
        beat = ""
    return f"pid {found.get('pid')} on {found.get('host')}{elsewhere}, started {found.get('started')}{beat}"


def release_all() -> None:
    """Release every lock this process holds (the trainer's exit path)."""
    while _held:
        _held.pop().release()
