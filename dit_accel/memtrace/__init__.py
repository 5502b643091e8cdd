"""The traced memory of one real training step, to hold the planner to account (`dit-accel verify`).

The trainer's own step (model construction, autocast, checkpointed blocks, AdamW, EMA, accumulation) runs
under torch's FakeTensorMode, so no byte is allocated, while a dispatch-level tracker counts every live
tensor storage by component (weights, grads, optimizer, ema, activations, autocast_cache, vae, temporaries,
batch) and records the peak. AdamW's state is made before the first step, as the trainer makes it; two
optimizer steps run so the second finds the cache the first left, as every later step does.

Full-depth DiT-XL/2 would cost tens of thousands of Python dispatches, so by default the step is traced
at shallow depths and extrapolated per block: exact, not a fit, because every block of one kind adds the
same storages. What a tensor trace cannot see is listed in `UNSEEN` and printed beside every result.

    tracker       StorageTracker: live storages by component, the peak, the peak of each window
    driver        the trainer's step for one plan on fake tensors, and `trace_training_step`
    extrapolate   per-block extrapolation from shallow traces
    comparison    the planner's estimate of the same step, at the same moment
    report        the tables and `dit-accel verify`
    calibrate     `dit-accel calibrate`: the planned step measured on a real GPU, as a calibration file

Imports: the trainer's parts (`train.step`, `train.optim`, `train.config`), `repa`, `distributed` and the
planner; nothing imports memtrace but the CLI.
"""

import importlib

# Each public name and the submodule that defines it, imported on first use (PEP 562): `dit-accel verify
# --help` and the comparison need no torch, the tracer does.
_HOMES = {
    "Comparison": "comparison",
    "ShardedComparison": "comparison",
    "compare": "comparison",
    "compare_sharded": "comparison",
    "planner_estimate": "comparison",
    "StepParts": "driver",
    "build_step_parts": "driver",
    "run_traced": "driver",
    "trace_events": "driver",
    "trace_training_step": "driver",
    "format_report": "report",
    "format_sharded_report": "report",
    "main": "report",
    "COMPONENTS": "tracker",
    "UNSEEN": "tracker",
    "StorageTracker": "tracker",
    "TraceResult": "tracker",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
