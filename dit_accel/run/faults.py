"""Faults a test injects into a real run, read once from the environment at start; no branch in the loop.

    DIT_ACCEL_INJECT_NAN="STEP" or "STEP:RANK"    the model's output (so the loss and the gradients) of that
                                                  optimizer step's first micro-step is NaN, on every rank or
                                                  on RANK only
    DIT_ACCEL_CRASH_BEFORE_COMMIT="STEP"          the main process dies like a killed one (os._exit(137))
                                                  after writing that step's checkpoint, before committing it
    DIT_ACCEL_SLEEP_BEFORE_COLLECTIVE="STEP:RANK:SECONDS"
                                                  RANK sleeps SECONDS in the first micro-step's forward of
                                                  STEP, so the other ranks wait for it in that step's
                                                  gradient all-reduce: a hang, for the watchdog

Each fault is installed where it acts (a forward hook on the model, the checkpointer's pre-commit hook), so the
training loop reads the same with and without them. Steps are 1-based optimizer steps, as the logs count them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

INJECT_NAN_ENV = "DIT_ACCEL_INJECT_NAN"
CRASH_BEFORE_COMMIT_ENV = "DIT_ACCEL_CRASH_BEFORE_COMMIT"
SLEEP_BEFORE_COLLECTIVE_ENV = "DIT_ACCEL_SLEEP_BEFORE_COLLECTIVE"
ENV_NAMES = (INJECT_NAN_ENV, CRASH_BEFORE_COMMIT_ENV, SLEEP_BEFORE_COLLECTIVE_ENV)


@dataclass(frozen=True)
class Faults:
    nan_step: int | None = None  # on this rank
    crash_before_commit_step: int | None = None
    sleep_step: int | None = None  # on this rank
    sleep_s: float = 0.0

    @classmethod
    def from_environment(cls, rank: int, env: dict | None = None) -> Faults:
        env = os.environ if env is None else env
        nan_step = None
        if env.get(INJECT_NAN_ENV):
            step, _, only_rank = env[INJECT_NAN_ENV].partition(":")
            nan_step = int(step) if not only_rank or int(only_rank) == rank else None
        crash = int(env.get(CRASH_BEFORE_COMMIT_ENV) or 0) or None
        sleep_step, sleep_s = None, 0.0
        if env.get(SLEEP_BEFORE_COLLECTIVE_ENV):
            step, sleeper, seconds = env[SLEEP_BEFORE_COLLECTIVE_ENV].split(":")
            if int(sleeper) == rank:
                sleep_step, sleep_s = int(step), float(seconds)
        return cls(nan_step=nan_step, crash_before_commit_step=crash, sleep_step=sleep_step, sleep_s=sleep_s)

    def install(self, model: nn.Module, start_step: int, grad_accum: int) -> None:
        """Poison the first micro-step of `nan_step`: a hook on the top-level forward, which runs once per
        micro-step (checkpointed blocks recompute inside it, not through it); sleep in that of `sleep_step`."""
        if self.sleep_step is not None and self.sleep_step > start_step:
            sleeping_call, seen = (self.sleep_step - start_step - 1) * grad_accum + 1, [0]

            def sleep(_module, _args, output):
                seen[0] += 1
                if seen[0] == sleeping_call:
                    time.sleep(self.sleep_s)
                return output

            model.register_forward_hook(sleep)
        if self.nan_step is None or self.nan_step <= start_step:
            return
        poisoned_call = (self.nan_step - start_step - 1) * grad_accum + 1
        calls = [0]

        def poison(_module, _args, output):  # the trainer calls the model with return_dict=False: a tuple
            calls[0] += 1
            return (output[0] * math.nan, *output[1:]) if calls[0] == poisoned_call else output

        model.register_forward_hook(poison)

    def before_commit(self, tmp_dir: Path, step: int) -> None:
        """The checkpointer calls this on the main process between writing a checkpoint and committing it."""
        if step != self.crash_before_commit_step:
            return
        from dit_accel.run.logs import flush_logs, log

        log.warning(f"{CRASH_BEFORE_COMMIT_ENV}: killing the process before committing {tmp_dir}")
        flush_logs()
        os._exit(137)
