"""`dit-plan --calibration FILE`: measured figures from `dit-accel calibrate` in place of assumed ones.

The file (schema "dit-calibration/1", docs/planner-accuracy.md) records real steps of one plan on one GPU and
the planner constants they measured (`assumptions`, a subset of `planner.hardware.CALIBRATABLE`). What a
mismatch between the file and the plan being made means, and what is done about it:

  another schema, unreadable, or a value out of range    refused: one line, exit 2
  another GPU than --gpu (both known presets)            refused: every figure in it is that GPU's
  no --gpu (only --vram)                                  memory figures used; MFU and half-efficiency not
                                                          (they need the measured GPU's peak rate): warning
  another model (name, resolution or sizes)               memory figures used; MFU and half-efficiency not
                                                          (they depend on the model's matrix shapes): warning
  another precision                                       memory figures used; the MFU only where both are
                                                          mixed (bf16/fp16) or both fp32: warning
  GPU memory far from --vram (over 10%)                   used, with a warning (a MIG slice or a mistake?)

Memory figures are the CUDA context (device used less reserved: cuBLAS's workspaces are reserved memory),
NCCL buffers and the caching allocator's fragmentation: properties of the GPU, driver and allocator, close
enough across models to beat a guess.
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.errors import PlanError
from planner.hardware import CALIBRATABLE, Assumptions

SCHEMA = "dit-calibration/1"
THROUGHPUT_FIGURES = ("mfu_mixed", "mfu_fp32", "half_efficiency_tokens")
REQUIRED = ("gpu", "model", "config", "assumptions")


def load_calibration(path: str | Path) -> dict:
    """The parsed file, checked for its schema and the sections the planner reads."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise PlanError(
            f"--calibration {path}: cannot read it ({error.strerror or error}): "
            f"give the file `dit-accel calibrate --out` wrote"
        ) from None
    try:
        data = json.loads(text)
    except ValueError:
        raise PlanError(
            f"--calibration {path} is not JSON: give the file `dit-accel calibrate --out` wrote"
        ) from None
    return check_calibration(data, str(path))


def check_calibration(data, where: str = "the calibration") -> dict:
    """`data` if it is a calibration the planner can read: the schema and the sections it uses."""
    path = where
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise PlanError(
            f"--calibration {path} has schema {found!r}, not {SCHEMA!r}: re-run `dit-accel calibrate` "
            f"with this version"
        )
    missing = [key for key in REQUIRED if not isinstance(data.get(key), dict)]
    if missing:
        raise PlanError(
            f"--calibration {path} lacks {', '.join(missing)}: it is incomplete",
            "re-run `dit-accel calibrate`",
        )
    unknown = sorted(set(data["assumptions"]) - set(CALIBRATABLE))
    if unknown:
        raise PlanError(
            f"--calibration {path} sets {', '.join(unknown)}, which are not measurable figures "
            f"({', '.join(CALIBRATABLE)}): re-run `dit-accel calibrate`"
        )
    return data


def _same_model(measured: dict, spec) -> bool:
    sizes = ("depth", "hidden", "heads", "patch")
    return (
        measured.get("resolution") == spec.resolution
        and all(measured.get(key) == getattr(spec, key) for key in sizes if key in measured)
        and (measured.get("name") == spec.name or all(key in measured for key in sizes))
    )


def apply_calibration(
    data: dict,
    source: str | None,
    assumptions: Assumptions,
    spec,
    precision: str,
    gpu_preset_name: str | None,
    vram_bytes: int,
) -> tuple[Assumptions, dict, list[str]]:
    """(assumptions with the measured figures that apply to this plan, the record for plan.json, warnings).

    Raises PlanError where the file cannot describe this plan (see the module docstring)."""
    where = source or "the calibration"
    gpu = data["gpu"]
    measured_preset = gpu.get("preset")
    gpu_name = gpu.get("name") or measured_preset or "an unnamed GPU"
    if gpu_preset_name and measured_preset and measured_preset != gpu_preset_name:
        raise PlanError(
            f"--calibration {where} was measured on {gpu_name} ({measured_preset}), but the plan is for "
            f"--gpu {gpu_preset_name}: calibrate on {gpu_preset_name}, or plan with --gpu {measured_preset}"
        )
    figures = dict(data["assumptions"])
    skipped: dict[str, str] = {}
    warnings = []

    def skip(names, why):
        for name in names:
            if name in figures:
                skipped[name] = why
                figures.pop(name)

    if gpu_preset_name is None:
        hint = f"--gpu {measured_preset}" if measured_preset else "the --gpu it was measured on"
        skip(THROUGHPUT_FIGURES, f"no --gpu: pass {hint}")
    elif measured_preset is None:
        skip(THROUGHPUT_FIGURES, f"{gpu_name} matched no GPU preset")
    model = data["model"]
    if not _same_model(model, spec):
        measured_model = f"{model.get('name', '?')} @ {model.get('resolution', '?')} px"
        skip(THROUGHPUT_FIGURES, f"measured on {measured_model}")
        warnings.append(
            f"--calibration {where} measured {measured_model}, not {spec.name} @ {spec.resolution} px: "
            f"its memory overheads are used, its MFU and small-batch efficiency are not"
        )
    measured_precision = data["config"].get("precision")
    if measured_precision != precision:
        both_mixed = {measured_precision, precision} <= {"bf16", "fp16"}
        if not both_mixed:
            skip(("mfu_mixed", "mfu_fp32"), f"measured in {measured_precision}")
        warnings.append(
            f"--calibration {where} measured {measured_precision}, the plan trains {precision}"
            + ("" if both_mixed else ": its MFU does not apply to this precision")
        )
    total = gpu.get("total_bytes")
    if isinstance(total, int) and total > 0 and abs(total - vram_bytes) > 0.1 * vram_bytes:
        warnings.append(
            f"--calibration {where} ran on a GPU of {total / 2**30:.1f} GiB, the plan is for "
            f"{vram_bytes / 2**30:.1f} GiB per GPU"
        )
    if skipped and gpu_preset_name is None:
        warnings.append(
            f"--calibration {where}: MFU and small-batch efficiency not used without --gpu "
            f"({skipped[next(iter(skipped))]})"
        )
    try:
        calibrated = assumptions.calibrated(figures)
    except PlanError as error:
        raise PlanError(f"--calibration {where}: {error}") from None
    record = {
        "file": source,
        "gpu": gpu_name,
        "preset": measured_preset,
        "created": data.get("created"),
        "model": model.get("name"),
        "resolution": model.get("resolution"),
        "precision": measured_precision,
        "applied": figures,
        "not_applied": skipped,
    }
    return calibrated, record, warnings


def describe(record: dict) -> str:
    """One line for the terminal and plan.md: which file, GPU and date, and what it changed."""
    applied = (
        ", ".join(f"{name} {_value(name, value)}" for name, value in record["applied"].items()) or "nothing"
    )
    line = (
        f"calibrated with {record['file'] or 'a calibration'} ({record['gpu']}, {record['created'] or 'undated'}): "
        f"{applied}"
    )
    if record["not_applied"]:
        line += f"; not used: {', '.join(record['not_applied'])}"
    return line


def _value(name: str, value) -> str:
    if name.endswith("_bytes"):
        return f"{value / 2**20:.0f} MiB"
    if name.startswith("mfu") or name == "fragmentation":
        return f"{value:.3f}"
    return f"{value:g}" if isinstance(value, float) else str(value)
