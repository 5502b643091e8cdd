"""What a run tells its user every few steps: the log line (to the per-rank logs of `run.logs`), metrics.jsonl
and the trackers, and the GPU memory it measured against the plan's estimate.

metrics.jsonl holds one timeline: a run that resumes from an older checkpoint (a rollback), or from one
behind steps a killed run had logged, puts back the checkpoint's own copy of the file and moves every other
line to metrics.abandoned.jsonl (`rewind_metrics`); TensorBoard is told to hide the old events from the first
resumed step on (its `purge_step`, `trackers.start_trackers`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn

from dit_accel.distributed.fsdp import full_tensor
from dit_accel.run.logs import log
from planner.planfile import Plan

log.addHandler(logging.NullHandler())  # before setup_logging: silent, not Python's stderr fallback


def measured_peak_bytes(device: torch.device) -> tuple[int, int] | None:
    """(max allocated, max reserved) bytes on this rank's GPU since the start, or None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def parameter_checksum(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in name order: equal on all ranks iff the weights are. Sharded
    parameters are gathered first (a collective: every rank calls this)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(full_tensor(param.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def weights_layout(plan: Plan, world_size: int) -> str:
    """How the weights sit on the ranks, for the run's first line: sharded (FSDP2), replicated (DDP), or one
    process's own."""
    if plan.sharding.uses_fsdp:
        return f"sharded {plan.decision.sharding} (FSDP2, reshard after forward: {plan.sharding.reshard_after_forward})"
    return "replicated (DDP)" if world_size > 1 else "one process"


def tracker_config(config, plan: Plan) -> dict:
    """The run's settings as TensorBoard hparams, which take scalars only."""
    scalars = (int, float, str, bool)
    values = {k: v for k, v in config.to_json().items() if isinstance(v, scalars)}
    values.update({f"plan_{k}": v for k, v in plan.to_json()["decision"].items() if isinstance(v, scalars)})
    values["global_batch"] = plan.global_batch
    return values


ABANDONED_METRICS = "metrics.abandoned.jsonl"


def rewind_metrics(run_dir: Path, checkpoint: Path | None) -> int:
    """RUN/metrics.jsonl made the timeline this run continues: the copy in its `checkpoint` (none for a run
    from step 0; for a checkpoint without a copy, the lines up to its step); every other line is appended
    to RUN/metrics.abandoned.jsonl. Returns how many lines were moved there. Main process only."""
    from dit_accel.atomic import write_bytes_atomically
    from dit_accel.run.checkpoint import METRICS, read_train_state

    path = run_dir / METRICS
    current = path.read_text().splitlines(keepends=True) if path.is_file() else []
    if checkpoint is None:
        kept = []
    elif (checkpoint / METRICS).is_file():
        kept = (checkpoint / METRICS).read_text().splitlines(keepends=True)
    else:  # written before checkpoints held a copy
        last = read_train_state(checkpoint)["step"]
        kept = [line for line in current if _logged_step(line) <= last]
    keep = set(kept)
    moved = [line for line in current if line not in keep]
    if moved:
        with (run_dir / ABANDONED_METRICS).open("a") as handle:
            handle.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
    if kept != current:
        write_bytes_atomically(path, "".join(kept).encode())
    return len(moved)


def _logged_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # an unreadable line belongs to no timeline


def memory_over_plan(plan: Plan, allocated_bytes: int, reserved_bytes: int) -> str | None:
    """What the measured peaks exceed of the plan's, in words, or None. `max_memory_allocated` counts cuBLAS's
    workspaces (PyTorch allocates them through its caching allocator), which the plan counts in its allocator
    share, not among its tensors: the allocated peak is held to the tensors plus them."""
    from planner.hardware import Assumptions

    memory = plan.memory
    if memory is None:
        return None
    workspaces = int(plan.assumptions.get("cublas_workspace_bytes", Assumptions().cublas_workspace_bytes))
    allowed = memory.tensor_bytes + workspaces
    if allocated_bytes > allowed:
        return (
            f"measured peak {gib(allocated_bytes)} allocated exceeds the plan's {gib(memory.tensor_bytes)} of "
            f"tensors and {gib(workspaces)} of cuBLAS workspaces (its {gib(memory.peak_bytes)} peak less "
            f"overheads)"
        )
    if memory.reserved_peak_bytes and reserved_bytes > memory.reserved_peak_bytes:
        return (
            f"measured peak {gib(reserved_bytes)} reserved exceeds the plan's {gib(memory.reserved_peak_bytes)} "
            f"(the caching allocator holds more than planned; {gib(memory.peak_bytes)} with the overhead)"
        )
    return None


def plan_notes(plan: Plan) -> list[str]:
    """What the run should know about its plan before the first step: a plan made for another codebase's order
    of AdamW's state (--assume adamw_state=lazy) overstates this trainer's memory, which makes it first."""
    if plan.assumptions.get("adamw_state") != "lazy":
        return []
    return [
        "the plan assumed AdamW's state made inside the first optimizer step (--assume adamw_state=lazy, "
        "another codebase's order); this trainer makes it before the first step, so it reserves at most the "
        "plan's figure (less with online latents): plan without that assumption for this run's own"
    ]


DATA_WAIT_WARN_FRACTION = 0.1  # waiting for batches this share of a window's time: the GPUs idle, say so


def data_wait_advice(decision) -> str:
    """What to do about a step that waits for its batches, by what its workers do: decode images (online,
    pixel, REPA's source images beside a cache) or only read a latent cache."""
    decode_rate = "(`dit-accel doctor` times the decode against the plan: its `decode rate` row)"
    if decision.latents != "precomputed":
        return (
            f"raise --num-workers or train on precomputed latents (`dit-accel extract-latents`) {decode_rate}"
        )
    if decision.repa:
        return f"raise --num-workers: REPA's workers decode each latent's source image {decode_rate}"
    return (
        "the workers only read the latent cache, so its storage is the bottleneck: put the cache on local "
        "disk (or where the page cache holds it), or raise --num-workers"
    )


class StepLog:
    """Every `log_every` steps: the mean loss since the last line, images/s, the share of the time the step
    waited for its batches (the slowest rank's: every rank waits for it at the all-reduce), and the GPU's
    measured peak memory beside the plan's, to the terminal, the rank logs, metrics.jsonl (main process) and
    the trackers.

    The step reads a loss and a gradient norm back from the GPU each step, so the GPU has no queued work left
    while the loop waits in `next(batches)`: that wait is idle GPU time. One warning, the first window after
    the first (whose wait includes the workers' start) in which it passes DATA_WAIT_WARN_FRACTION.

    The measured peaks are held to the plan's (`memory_over_plan`): max_memory_allocated to its tensors and
    cuBLAS's workspaces, max_memory_reserved to its reserved peak; one warning, the first time either is over.
    """

    def __init__(
        self,
        run_dir: Path,
        plan: Plan,
        accelerator,
        device: torch.device,
        max_steps: int,
        resumed_from: Path | None = None,
    ):
        self.metrics_path = run_dir / "metrics.jsonl"
        self.plan, self.accelerator, self.device, self.max_steps = plan, accelerator, device, max_steps
        self.warned_memory = self.warned_data_wait = False
        self.windows = 0
        if accelerator.is_main_process:  # one timeline in metrics.jsonl: the one this run continues
            moved = rewind_metrics(run_dir, resumed_from)
            if moved:
                log.info(
                    f"metrics.jsonl holds this run's timeline: {moved} lines of another (an abandoned branch, "
                    f"or steps logged after {resumed_from.name if resumed_from else 'step 0'} by a killed run) "
                    f"moved to {ABANDONED_METRICS}"
                )
        self._start_window()

    def _start_window(self) -> None:
        self.window_start, self.window_steps, self.window_losses = time.perf_counter(), 0, []
        self.window_wait_s = 0.0

    @contextlib.contextmanager
    def waiting_for_data(self):
        """Around `next(batches)`: its time counts as waiting for data."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.window_wait_s += time.perf_counter() - started

    def record(self, result) -> None:
        """One optimizer step's result (`step.StepResult`)."""
        self.window_steps += 1
        if result.applied:
            self.window_losses.append(result.loss)

    def write(self, step: int, result, skipped_steps: int) -> float:
        """The log line for the window ending at `step`; returns its mean loss."""
        elapsed = time.perf_counter() - self.window_start
        # Every applied step's loss since the last line, each the mean over all ranks' samples.
        loss = sum(self.window_losses) / len(self.window_losses) if self.window_losses else math.nan
        metrics = {
            "step": step,
            "loss": loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "images_per_s": self.plan.global_batch * self.window_steps / elapsed,
            "step_time_s": elapsed / self.window_steps,
            "data_wait_fraction": self._max_over_ranks([self.window_wait_s / elapsed])[0],
            "skipped_steps": skipped_steps,
        }
        memory_text = self._memory(metrics)
        log.info(
            f"step {step}/{self.max_steps} | loss {loss:.4f} | lr {result.lr:.3g} | grad norm "
            f"{result.grad_norm:.3g} | {metrics['images_per_s']:.1f} img/s | {metrics['step_time_s']:.3f} "
            f"s/step | data wait {metrics['data_wait_fraction']:.0%} | {memory_text}"
        )
        if (
            self.device.type == "cuda"
        ):  # "the GPUs idle" means nothing on a CPU, whose workers its cores bound
            self._warn_data_wait(metrics["data_wait_fraction"], step, self.window_steps)
        if self.accelerator.log_with:
            self.accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        if self.accelerator.is_main_process:
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
        self._start_window()
        return loss

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's largest over the ranks (one all-reduce; none in one process)."""
        if self.accelerator.num_processes == 1:
            return values
        tensor = torch.tensor(values, device=self.device, dtype=torch.float64)
        return self.accelerator.reduce(tensor, reduction="max").tolist()

    def _warn_data_wait(self, fraction: float, step: int, steps: int) -> None:
        self.windows += 1
        if self.windows > 1 and fraction > DATA_WAIT_WARN_FRACTION and not self.warned_data_wait:
            self.warned_data_wait = True
            log.warning(
                f"the step waited for its batches {fraction:.0%} of the time of steps {step - steps + 1}-{step} "
                f"(the slowest rank): the GPUs idle that long; {data_wait_advice(self.plan.decision)}"
            )

    def _memory(self, metrics: dict) -> str:
        """The measured peak (max over ranks) beside the plan's, into `metrics`; warns once when over."""
        memory = self.plan.memory
        plan_peak = memory.peak_bytes if memory else None
        plan_tensors = memory.tensor_bytes if memory else None
        peak = measured_peak_bytes(self.device)
        text = "peak GPU memory n/a on CPU"
        if peak is not None:
            allocated, reserved = (int(v) for v in self._max_over_ranks(list(peak)))
            metrics.update(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved)
            text = f"peak GPU memory {gib(allocated)} allocated, {gib(reserved)} reserved"
            over = None if self.warned_memory else memory_over_plan(self.plan, allocated, reserved)
            if over:
                self.warned_memory = True
                log.warning(f"{over}: report it with `dit-accel verify`; the run goes on")
        if plan_peak:
            text += (
                f" (plan: {gib(plan_peak)})"
                if peak is None
                else f" (plan: {gib(plan_tensors)} of tensors, {gib(plan_peak)} with overheads)"
            )
        return text
