"""Stopping a rank cleanly when a cluster asks it to, and never outliving the process that started it.

A preempting scheduler (SLURM's `--signal`, Kubernetes, a user's `kill`) sends SIGTERM or SIGUSR1 to the
launcher or to any rank. The handler here only raises a flag: Python runs it between bytecodes, so it never
interrupts a collective or a checkpoint being written. The flag travels in the step's existing all-reduce
(`step.check_step`), every rank learns at the same optimizer-step boundary that some rank was asked to stop,
and the loop saves that step and exits with `errors.EXIT_PREEMPTED`.

`die_with_parent` sets Linux's parent-death signal: a rank whose launcher is SIGKILLed gets SIGTERM, and so
saves and stops like a preempted one instead of training on, orphaned, holding its GPU.

`WorkerShield` keeps a rank's DataLoader workers out of it: the signal reaches them too (SLURM signals every
process of the step, `dit-accel train` the launcher's process group), and torch's worker handler dies of a
SIGTERM that its rank did not send, which fails the rank ("DataLoader worker ... killed by signal") before it
can save. The rank decides when its workers end; a signal sent to a worker alone is passed on to its rank.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

from dit_accel.errors import EXIT_PREEMPTED

_PR_SET_PDEATHSIG = 1


class StopRequest:
    """The signal this rank was asked to stop by: set by the handler, read once per step by the loop.

    `install` replaces the handlers for the run's lifetime and `close` puts the old ones back and runs
    `closing` (the watchdog's stop), so a run in a test's own process leaves nothing behind. `in_loop` tells
    an error in the loop (one rank's bad sample: each rank says its own) from one in set-up (every rank
    finds the same, rank 0 says it)."""

    def __init__(self) -> None:
        self.signum = 0
        self.in_loop = False
        self.closing: list = []
        self._previous: dict = {}

    def install(self, signals: tuple[signal.Signals, ...]) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if not self.signum:  # the first signal names the stop; a second one changes nothing
            self.signum = signum

    def close(self) -> None:
        for action in self.closing:
            action()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class WorkerShield:
    """A DataLoader `worker_init_fn`: the worker takes the stop `signals` only from its own rank.

    The signals are blocked in the worker and a thread waits for them (`sigwaitinfo` tells the sender): one
    from the rank (the DataLoader ending a stuck worker with SIGTERM) ends the worker as torch's own handler
    would; any other (a scheduler's or a user's) is meant for the run, so it is passed on to the rank, which
    stops the run at its next step, saved, as if it had been sent the signal itself (a signal to the whole
    process group reaches the rank anyway: the first one names the stop). Before, a signal to a worker alone
    was dropped and the run trained to its end without a word. Picklable, for spawned workers too."""

    def __init__(self, signals) -> None:
        self.signals = tuple(int(sig) for sig in signals)
        self.rank_pid = os.getpid()

    def __call__(self, _worker_id: int) -> None:
        if not self.signals or not hasattr(signal, "sigwaitinfo"):
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)  # threads started later inherit the mask
        threading.Thread(target=self._wait, name="stop-signal-shield", daemon=True).start()

    def _wait(self) -> None:
        while True:
            info = signal.sigwaitinfo(self.signals)
            if info.si_pid == self.rank_pid:
                os._exit(0)
            try:
                os.kill(self.rank_pid, info.si_signo)
            except OSError:  # the rank is gone: nothing left to stop
                os._exit(0)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(int(signum)).name
    except ValueError:
        return f"signal {signum}"


def preempted_message(signum: int, step: int, checkpoint, saved: bool = True) -> str:
    """The line a preempted run ends with: the step it saved, or (stopped while starting, `saved` False) that
    nothing new was trained since `checkpoint` (None: none yet) and `step` is the last one done."""
    then = f"exit {EXIT_PREEMPTED} (requeue and resume with --resume auto)"
    if saved:
        return f"preempted by {signal_name(signum)} at step {step}: saved checkpoint {checkpoint}; {then}"
    since = f"resumes from {checkpoint}" if checkpoint else "no checkpoint yet"
    return (
        f"preempted by {signal_name(signum)} while starting, before step {step + 1}: nothing new to save "
        f"({since}); {then}"
    )


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent (the launcher) dies; no-op elsewhere.

    Called first thing in a rank, while SIGTERM still has its default action: a launcher that is already gone
    (died before prctl took effect) is seen by the parent pid changing, and then the rank stops itself."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died between getppid and prctl: nobody will signal us
        os.kill(os.getpid(), sig)
