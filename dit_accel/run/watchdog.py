"""A rank's heartbeat, and the end of a rank that stopped making progress (stuck in or before a collective).

The loop only stores two integers per micro-step (`Watchdog.at`), and a forward hook a third (`watch`: the
micro-step's forward is done); a daemon thread writes them, when they change, to RUN/logs/heartbeat_rankR.json,
and ends the rank once nothing moved for `--collective-timeout-s`. Reading every rank's heartbeat names the
rank that is behind: the one the others wait for in a collective. The forward mark matters most without
accumulation: DDP's all-reduce runs inside the backward of the step's only micro-step, so a rank stuck in
its forward and the ones waiting for it in that backward are at the same micro-step; only the forward mark
tells them apart.
The process group's own timeout (distributed.make_accelerator) is a later backstop for a thread that never
gets to run. Ranks on other nodes are seen when the run folder is shared, as it must be for checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from dit_accel.errors import EXIT_HUNG, write_exit_record


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"heartbeat_rank{rank}.json"


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world_size: int, grad_accum: int, timeout_s: float):
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.grad_accum, self.timeout_s = grad_accum, float(timeout_s)
        self.position = (0, 0, 0)  # (optimizer step being taken, micro-steps of it done, its forward done)
        self.since = 0.0  # when the position last changed; 0 until the loop starts
        self._written = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dit-accel-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def at(self, step: int, micro_steps_done: int) -> None:
        """Called by the loop; the thread does the writing."""
        self.position, self.since = (step, micro_steps_done, 0), time.time()

    def watch(self, model) -> None:
        """Mark each micro-step's forward as done (a hook on the top-level module, which runs once per
        micro-step): a rank past it is in the backward, where DDP's gradient all-reduce waits."""

        def forward_done(_module, _args, output):
            step, micro_steps_done, _ = self.position
            self.position, self.since = (step, micro_steps_done, 1), time.time()
            return output

        model.register_forward_hook(forward_done)

    def _watch(self) -> None:
        poll_s = max(0.05, min(1.0, self.timeout_s / 10))
        while not self._stopped.wait(poll_s):
            if not self.since:
                continue
            self._write()
            stuck_s = time.time() - self.since
            if stuck_s > self.timeout_s and not self._stopped.is_set():
                self._end(stuck_s)

    def _write(self) -> None:
        step, micro_steps_done, forward_done = self.position
        record = {
            "rank": self.rank,
            "step": step,
            "micro_steps_done": micro_steps_done,
            "forward_done": forward_done,
        }
        if record == self._written:
            return
        path = heartbeat_path(self.run_dir, self.rank)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(dict(record, time=self.since)))
            os.replace(tmp, path)
            self._written = record
        except OSError:
            pass  # a heartbeat is a diagnosis; never a reason to stop training

    def others(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                found[rank] = json.loads(heartbeat_path(self.run_dir, rank).read_text())
            except (OSError, ValueError):
                pass
        return found

    def diagnosis(self, stuck_s: float) -> str:
        """`rank R stuck at step N for S s ...; other ranks are at step M`, naming the rank that is behind."""
        others = self.others()
        positions = {self.rank: self.position}
        positions.update(
            {
                rank: (beat["step"], beat["micro_steps_done"], beat.get("forward_done", 0))
                for rank, beat in others.items()
            }
        )
        behind = min(positions.values())
        laggards = sorted(rank for rank, position in positions.items() if position == behind)
        now = time.time()
        if len(laggards) < len(positions):  # some ranks wait in a collective for the ones behind
            waiting = sorted(set(positions) - set(laggards))
            lag = laggards[0]
            lag_s = stuck_s if lag == self.rank else now - others[lag]["time"]
            ahead = sorted({positions[rank][0] for rank in waiting})
            micro = min(behind[1] + 1, self.grad_accum)
            where = "backward" if behind[2] else "forward"
            return (
                f"rank {lag} stuck at step {behind[0]} for {lag_s:.0f} s before a collective (micro-step "
                f"{micro} of {self.grad_accum}, in its {where}); other ranks are at step "
                f"{', '.join(map(str, ahead))}, waiting for it in the collective "
                f"(rank{'s' * (len(waiting) > 1)} {', '.join(map(str, waiting))})"
            )
        steps = sorted({beat["step"] for beat in others.values()}) or ["unknown (no heartbeat)"]
        return (
            f"rank {self.rank} stuck at step {self.position[0]} for {stuck_s:.0f} s in a collective; other "
            f"ranks are at step {', '.join(map(str, steps))}"
        )

    def _end(self, stuck_s: float) -> None:
        message = (
            f"{self.diagnosis(stuck_s)}; ended after --collective-timeout-s {self.timeout_s:g}; exit "
            f"{EXIT_HUNG} (check that rank's node and log; resume with --resume auto)"
        )
        print(f"dit_accel.train: [rank {self.rank}] {message}", file=sys.stderr, flush=True)
        try:
            from dit_accel.run.logs import flush_logs, log

            log.error(message, extra={"file_only": True})
            flush_logs()
        finally:
            write_exit_record(EXIT_HUNG, message)
            from dit_accel.run.lock import release_all

            release_all()  # os._exit runs no exit path: the run lock would be left behind
            os._exit(EXIT_HUNG)
