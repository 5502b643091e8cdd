"""Faults a test injects into a real run, read once from the environment at start; no branch in the loop.

    DIT_ACCEL_INJECT_NAN="STEP" or "STEP:RANK"    the model's output (so the loss and the gradients) of that
                                                  optimizer step's first micro-step is NaN, on every rank or
                                                  on RANK only
    DIT_ACCEL_CRASH_BEFORE_COMMIT="STEP"          the main process dies like a killed one (os._exit(137))
                                                  after writing that step's checkpoint, before committing it

Each fault is installed where it acts (a forward hook on the model, the checkpointer's pre-commit hook), so the
training loop reads the same with and without them. Steps are 1-based optimizer steps, as the logs count them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

INJECT_NAN_ENV = "DIT_ACCEL_INJECT_NAN"
CRASH_BEFORE_COMMIT_ENV = "DIT_ACCEL_CRASH_BEFORE_COMMIT"
ENV_NAMES = (INJECT_NAN_ENV, CRASH_BEFORE_COMMIT_ENV)


@dataclass(frozen=True)
class Faults:
    nan_step: int | None = None  # on this rank
    crash_before_commit_step: int | None = None

    @classmethod
    def from_environment(cls, rank: int, env: dict | None = None) -> Faults:
        env = os.environ if env is None else env
        nan_step = None
        if env.get(INJECT_NAN_ENV):
            step, _, only_rank = env[INJECT_NAN_ENV].partition(":")
            nan_step = int(step) if not only_rank or int(only_rank) == rank else None
        crash = int(env.get(CRASH_BEFORE_COMMIT_ENV) or 0) or None
        return cls(nan_step=nan_step, crash_before_commit_step=crash)

    def install(self, model: nn.Module, start_step: int, grad_accum: int) -> None:
        """Poison the first micro-step of `nan_step`: a hook on the top-level forward, which runs once per
        micro-step (checkpointed blocks recompute inside it, not through it)."""
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
        from dit_accel.runlog import flush_logs, log

        log.warning(f"{CRASH_BEFORE_COMMIT_ENV}: killing the process before committing {tmp_dir}")
        flush_logs()
        os._exit(137)
