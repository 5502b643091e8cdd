"""The traced memory of one real training step, to hold the planner to account (`dit-accel verify`).

The trainer's own step (model construction, autocast, checkpointed blocks, AdamW, EMA, accumulation) runs
under torch's FakeTensorMode, so no byte is allocated, while a dispatch-level tracker counts every live
tensor storage by component (weights, grads, optimizer, ema, activations, autocast_cache, vae, temporaries,
batch) and records the peak. Two optimizer steps run so the optimizer's state exists at the second one.

Full-depth DiT-XL/2 would cost tens of thousands of Python dispatches, so by default the step is traced
at shallow depths and extrapolated per block: exact, not a fit, because every block of one kind adds the
same storages. What a tensor trace cannot see is listed in `UNSEEN` and printed beside every result.

    tracker       StorageTracker: live storages by component, the peak, the peak of each window
    driver        the trainer's step for one plan on fake tensors, and `trace_training_step`
    extrapolate   per-block extrapolation from shallow traces
    comparison    the planner's estimate of the same step, at the same moment
    report        the tables and `dit-accel verify`
"""

from dit_accel.memtrace.comparison import (
    Comparison,
    ShardedComparison,
    compare,
    compare_sharded,
    planner_estimate,
)
from dit_accel.memtrace.driver import StepParts, build_step_parts, run_traced, trace_training_step
from dit_accel.memtrace.report import format_report, format_sharded_report, main
from dit_accel.memtrace.tracker import COMPONENTS, UNSEEN, StorageTracker, TraceResult

__all__ = [
    "COMPONENTS",
    "UNSEEN",
    "Comparison",
    "ShardedComparison",
    "StepParts",
    "StorageTracker",
    "TraceResult",
    "build_step_parts",
    "compare",
    "compare_sharded",
    "format_report",
    "format_sharded_report",
    "main",
    "planner_estimate",
    "run_traced",
    "trace_training_step",
]
