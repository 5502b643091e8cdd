"""`dit-plan --calibration FILE`: a file written by the real `dit_accel.memtrace.calibrate` writer from recorded
measurements of an H200 replaces the planner's assumed overheads, fragmentation and MFU; mismatched files are
refused or partly used, as planner/calibration.py documents."""

from __future__ import annotations

import json

import pytest

from planner.cli import main as dit_plan
from planner.hardware import Assumptions, gpu_preset
from planner.planfile import parse_plan
from planner.spec import model_spec

GiB, MiB = 2**30, 2**20
FIXED, PER_SAMPLE, RESERVED_RATIO, CONTEXT = 9 * GiB, 300 * MiB, 1.08, 700 * MiB
SATURATED_IMAGES_PER_S, HALF_TOKENS = 900.0, 2048
H200_BYTES = 141 * GiB


def recorded_h200(tokens: int):
    """What an H200 would report for DiT-XL/2 @256 bf16: a linear allocator peak, 8% fragmentation, a fixed
    context outside the allocator, a saturating speed."""
    from dit_accel.memtrace import calibrate as cal

    def measure(micro_batch: int):
        allocated = FIXED + PER_SAMPLE * micro_batch
        reserved = int(allocated * RESERVED_RATIO)
        if reserved + CONTEXT > H200_BYTES:
            raise cal.MeasureOOM(micro_batch)
        n = micro_batch * tokens
        step_seconds = micro_batch / (SATURATED_IMAGES_PER_S * n / (n + HALF_TOKENS))
        return cal.Measurement(
            micro_batch, allocated, reserved, step_seconds, device_used_bytes=reserved + CONTEXT
        )

    return measure


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    from dit_accel.atomic import write_json_atomically
    from dit_accel.memtrace import calibrate as cal

    spec = model_spec("DiT-XL/2", 256)
    plan = {
        "schema": "dit-plan/1",
        "model": {"name": "DiT-XL/2", "resolution": 256},
        "cluster": {"world_size": 1},
        "global_batch": 32,
        "decision": {
            "micro_batch": 32,
            "grad_accum": 1,
            "checkpointed_blocks": 0,
            "precision": "bf16",
            "sharding": "ddp",
            "latents": "precomputed",
            "ema": True,
        },
        "memory": {"peak_bytes": 20 * GiB},
    }
    gpu = {
        "name": "NVIDIA H200",
        "total_bytes": H200_BYTES,
        "capability": "9.0",
        "preset": "h200",
        "_preset": gpu_preset("h200"),
    }
    result = cal.calibrate(
        parse_plan(plan),
        [8, 16, 32],
        steps=3,
        max_micro_batch=None,
        measure=recorded_h200(spec.tokens),
        gpu=gpu,
        log=lambda line: None,
    )
    path = tmp_path_factory.mktemp("calibration") / "h200.json"
    write_json_atomically(path, result)
    return path


def plan_with(tmp_path, capsys, *flags, name="plan"):
    out = tmp_path / name
    code = dit_plan(["--gpus", "8", "--global-batch", "256", *flags, "--out", str(out)])
    captured = capsys.readouterr()
    plan = json.loads((out / "plan.json").read_text()) if code == 0 else None
    return code, plan, captured


def test_measured_figures_replace_the_assumed_ones_and_are_recorded(tmp_path, capsys, calibration_file):
    written = json.loads(calibration_file.read_text())
    code, plan, captured = plan_with(
        tmp_path, capsys, "--gpu", "h200", "--calibration", str(calibration_file)
    )
    assert code == 0
    assumed = plan["assumptions"]
    # device used less reserved is the context: the cuBLAS workspaces are reserved memory, so the planner keeps
    # its own figure for them inside the allocator's share
    workspace = Assumptions().cublas_workspace_bytes
    assert assumed["cuda_context_bytes"] == CONTEXT and assumed["cublas_workspace_bytes"] == workspace
    assert assumed["fragmentation"] == pytest.approx(RESERVED_RATIO - 1)
    assert assumed["mfu_mixed"] == pytest.approx(written["fit"]["planner_mfu"]) != Assumptions().mfu_mixed
    assert assumed["half_efficiency_tokens"] == HALF_TOKENS
    assert plan["throughput"]["assumed_mfu"] == pytest.approx(written["fit"]["planner_mfu"])
    # the overhead at the peak is the measured context + NCCL (assumed); the allocator's reserve beyond the
    # tensors is the measured fragmentation, in place of the allocator model, and the cuBLAS workspaces
    memory = plan["memory"]
    assert memory["overhead"] == CONTEXT + Assumptions().nccl_buffer_bytes
    allocated = memory["peak_bytes"] - memory["overhead"] - memory["allocator"]
    assert memory["allocator"] == pytest.approx((RESERVED_RATIO - 1) * allocated + workspace, abs=2)
    assert memory["reserved_peak_bytes"] == allocated + memory["allocator"]
    record = plan["calibration"]
    assert record["file"] == str(calibration_file) and record["gpu"] == "NVIDIA H200"
    assert record["created"] == written["created"] and record["not_applied"] == {}
    assert plan["inputs"]["calibration"] == str(calibration_file)
    assert f"calibrated with {calibration_file} (NVIDIA H200, {written['created']})" in captured.out
    assert (
        f"Measured figures: calibrated with {calibration_file}" in (tmp_path / "plan" / "plan.md").read_text()
    )
    uncalibrated = plan_with(tmp_path, capsys, "--gpu", "h200", name="plain")[1]
    assert uncalibrated["calibration"] is None
    assert uncalibrated["memory"]["overhead"] != memory["overhead"]
    assert uncalibrated["memory"]["allocator"] != memory["allocator"]


def test_assume_still_overrides_a_calibrated_figure(tmp_path, capsys, calibration_file):
    code, plan, _ = plan_with(
        tmp_path,
        capsys,
        "--gpu",
        "h200",
        "--calibration",
        str(calibration_file),
        "--assume",
        "fragmentation=0.2",
    )
    assert code == 0
    assert (
        plan["assumptions"]["fragmentation"] == 0.2 and plan["assumptions"]["cuda_context_bytes"] == CONTEXT
    )


def _rewritten(tmp_path, calibration_file, change) -> str:
    data = json.loads(calibration_file.read_text())
    change(data)
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "case, flags, fragment",
    [
        ("schema", ["--gpu", "h200"], "schema 'dit-calibration/0'"),
        ("gpu", ["--gpu", "a100-80g"], "measured on NVIDIA H200 (h200), but the plan is for --gpu a100-80g"),
        ("figure", ["--gpu", "h200"], "fragmentation"),
        ("unknown", ["--gpu", "h200"], "vae_params"),
        ("missing", ["--gpu", "h200"], "cannot read it"),
        ("not json", ["--gpu", "h200"], "is not JSON"),
    ],
)
def test_a_file_that_cannot_describe_the_plan_is_refused_in_one_line(
    tmp_path, capsys, calibration_file, case, flags, fragment
):
    edits = {
        "schema": lambda d: d.update(schema="dit-calibration/0"),
        "figure": lambda d: d["assumptions"].update(fragmentation=1.5),
        "unknown": lambda d: d["assumptions"].update(vae_params=1),
    }
    if case in edits:
        path = _rewritten(tmp_path, calibration_file, edits[case])
    elif case == "missing":
        path = str(tmp_path / "nowhere.json")
    elif case == "not json":
        path = str(tmp_path / "broken.json")
        (tmp_path / "broken.json").write_text("{ not json")
    else:
        path = str(calibration_file)
    code, _, captured = plan_with(tmp_path, capsys, *flags, "--calibration", path)
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in captured.err
    assert not (tmp_path / "plan").exists()


def test_another_model_uses_the_memory_figures_but_not_the_mfu(tmp_path, capsys, calibration_file):
    code, plan, captured = plan_with(
        tmp_path, capsys, "--gpu", "h200", "--model", "DiT-L/2", "--calibration", str(calibration_file)
    )
    assert code == 0
    assert plan["assumptions"]["cuda_context_bytes"] == CONTEXT
    assert plan["assumptions"]["mfu_mixed"] == Assumptions().mfu_mixed
    assert set(plan["calibration"]["not_applied"]) == {"mfu_mixed", "half_efficiency_tokens"}
    assert any("measured DiT-XL/2 @ 256 px, not DiT-L/2 @ 256 px" in w for w in plan["warnings"])
    assert "not used: mfu_mixed, half_efficiency_tokens" in captured.out


def test_vram_alone_or_another_precision_drop_the_throughput_figures_with_a_warning(
    tmp_path, capsys, calibration_file
):
    code, plan, _ = plan_with(tmp_path, capsys, "--vram", "141GiB", "--calibration", str(calibration_file))
    assert code == 0 and plan["assumptions"]["mfu_mixed"] == Assumptions().mfu_mixed
    assert plan["assumptions"]["fragmentation"] == pytest.approx(RESERVED_RATIO - 1)
    assert any("without --gpu" in w and "--gpu h200" in w for w in plan["warnings"])
    code, plan, _ = plan_with(
        tmp_path,
        capsys,
        "--gpu",
        "h200",
        "--precision",
        "fp32",
        "--calibration",
        str(calibration_file),
        name="fp32",
    )
    assert code == 0 and plan["assumptions"]["mfu_fp32"] == Assumptions().mfu_fp32
    assert plan["assumptions"]["half_efficiency_tokens"] == HALF_TOKENS
    assert any("measured bf16, the plan trains fp32" in w for w in plan["warnings"])
    code, plan, _ = plan_with(
        tmp_path,
        capsys,
        "--gpu",
        "h200",
        "--precision",
        "fp16",
        "--calibration",
        str(calibration_file),
        name="fp16",
    )
    assert code == 0 and plan["assumptions"]["mfu_mixed"] != Assumptions().mfu_mixed  # same tensor-core rate


def test_a_sweep_uses_the_calibration_for_every_row_and_refuses_a_bad_file_once(
    tmp_path, capsys, calibration_file
):
    assert (
        dit_plan(
            [
                "--gpus",
                "8,16",
                "--gpu",
                "h200",
                "--global-batch",
                "256",
                "--format",
                "json",
                "--calibration",
                str(calibration_file),
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and all("micro_batch" in row for row in rows)
    bad = _rewritten(tmp_path, calibration_file, lambda d: d.update(schema="other"))
    assert dit_plan(["--gpus", "8,16", "--gpu", "h200", "--calibration", bad]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""
