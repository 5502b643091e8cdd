"""`dit-accel calibrate` without a GPU: its least squares, its search for the largest micro-batch (a fake
measure that runs out of memory above a threshold), and the calibration file it writes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dit_accel.atomic import write_json_atomically
from dit_accel.errors import UserError
from dit_accel.memtrace import calibrate as cal
from planner.hardware import CALIBRATABLE, Assumptions, gpu_preset
from planner.planfile import Plan, parse_plan
from planner.spec import model_spec

GiB, MiB = 2**30, 2**20


def test_fit_line_recovers_a_known_line_exactly():
    xs = [8, 16, 32, 48]
    intercept, slope = cal.fit_line(xs, [3 * GiB + 150 * MiB * x for x in xs])
    assert intercept == pytest.approx(3 * GiB) and slope == pytest.approx(150 * MiB)


def test_fit_line_is_least_squares_on_noisy_points():
    rng = np.random.default_rng(0)
    xs = [4, 8, 16, 24, 32]
    ys = [1e9 + 2e7 * x + rng.normal(0, 1e6) for x in xs]
    slope, intercept = np.polyfit(xs, ys, 1)
    assert cal.fit_line(xs, ys) == pytest.approx((intercept, slope))


def test_fit_line_needs_two_different_micro_batches():
    with pytest.raises(UserError, match="two different micro-batches"):
        cal.fit_line([8, 8], [1.0, 2.0])


def oom_above(threshold: int, calls: list | None = None):
    def measure(micro_batch: int) -> cal.Measurement:
        if calls is not None:
            calls.append(micro_batch)
        if micro_batch > threshold:
            raise cal.MeasureOOM(micro_batch)
        return cal.Measurement(micro_batch, 10 * micro_batch, 11 * micro_batch, 1.0)

    return measure


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(1, 2000), start=st.integers(1, 3000), growth=st.sampled_from([1.25, 2.0]))
def test_search_finds_the_largest_micro_batch_that_fits(threshold, start, growth):
    calls = []
    largest, first_oom = cal.largest_fitting(
        oom_above(threshold, calls), start=start, limit=4096, growth=growth
    )
    assert (largest, first_oom) == (threshold, threshold + 1)
    assert len(calls) == len(set(calls))  # never measures a micro-batch twice
    assert len(calls) <= 45


def test_search_stops_at_the_limit_when_nothing_runs_out_of_memory():
    calls = []
    assert cal.largest_fitting(oom_above(10**6, calls), start=8, limit=100) == (100, None)
    assert max(calls) == 100


def test_search_starts_from_what_is_already_known():
    calls = []
    assert cal.largest_fitting(oom_above(37, calls), start=40, limit=512, known_fit=32, known_oom=64) == (
        37,
        38,
    )
    assert all(32 < c < 64 for c in calls)


# --- the whole calibration on recorded measurements ---------------------------------------------------

FIXED, PER_SAMPLE = 9 * GiB, 300 * MiB
RESERVED_RATIO = 1.08
CONTEXT = 700 * MiB
SATURATED_IMAGES_PER_S, HALF_TOKENS = 900.0, 2048
TOTAL = 141 * GiB


def recorded_measure(tokens: int, calls: list):
    """What an H200 would report: a linear allocator peak, 8% fragmentation, a fixed context, saturating speed."""

    def measure(micro_batch: int) -> cal.Measurement:
        calls.append(micro_batch)
        allocated = FIXED + PER_SAMPLE * micro_batch
        reserved = int(allocated * RESERVED_RATIO)
        if reserved + CONTEXT > TOTAL:
            raise cal.MeasureOOM(micro_batch)
        n = micro_batch * tokens
        images_per_s = SATURATED_IMAGES_PER_S * n / (n + HALF_TOKENS)
        return cal.Measurement(
            micro_batch, allocated, reserved, micro_batch / images_per_s, device_used_bytes=reserved + CONTEXT
        )

    return measure


def a_plan(model: dict, micro_batch: int, precision: str, checkpointed_blocks: int = 0, **sections) -> Plan:
    """The least plan.json calibrate reads: one GPU, no accumulation, precomputed latents, EMA."""
    return parse_plan(
        {
            "schema": "dit-plan/1",
            "inputs": {"model": model["name"]},
            "model": model,
            "cluster": {"world_size": 1},
            "global_batch": micro_batch,
            "decision": {
                "micro_batch": micro_batch,
                "grad_accum": 1,
                "checkpointed_blocks": checkpointed_blocks,
                "precision": precision,
                "sharding": "ddp",
                "latents": "precomputed",
                "ema": True,
            },
            **sections,
        }
    )


def xl_plan(micro_batch=32, checkpointed_blocks=0) -> Plan:
    model = {"name": "DiT-XL/2", "resolution": 256}
    return a_plan(model, micro_batch, "bf16", checkpointed_blocks, memory={"peak_bytes": 20 * GiB})


def test_calibration_fits_searches_and_writes_what_the_planner_reads(tmp_path):
    spec = model_spec("DiT-XL/2", 256)
    calls = []
    preset = gpu_preset("h200")
    gpu = {
        "name": "NVIDIA H200",
        "total_bytes": TOTAL,
        "capability": "9.0",
        "preset": "h200",
        "_preset": preset,
    }
    result = cal.calibrate(
        xl_plan(),
        [8, 16, 32],
        steps=3,
        max_micro_batch=None,
        measure=recorded_measure(spec.tokens, calls),
        gpu=gpu,
        log=lambda line: None,
    )
    fit = result["fit"]
    assert fit["fixed_bytes"] == FIXED and fit["per_sample_bytes"] == PER_SAMPLE
    assert fit["fragmentation"] == pytest.approx(RESERVED_RATIO, rel=1e-6)
    assert fit["outside_allocator_bytes"] == CONTEXT
    assert fit["half_efficiency_tokens"] == HALF_TOKENS
    largest = max(
        mb for mb in range(1, 2000) if int((FIXED + PER_SAMPLE * mb) * RESERVED_RATIO) + CONTEXT <= TOTAL
    )
    assert result["largest_micro_batch"] == largest and result["smallest_oom_micro_batch"] == largest + 1
    images_per_s = SATURATED_IMAGES_PER_S * 32 * spec.tokens / (32 * spec.tokens + HALF_TOKENS)
    assert fit["images_per_s"] == pytest.approx(images_per_s)
    assert fit["mfu"] == pytest.approx(
        images_per_s * 3 * spec.fwd_flops_per_image / preset.matmul_peak_flops("bf16")
    )
    assert [m["micro_batch"] for m in result["measurements"]] == [8, 16, 32]  # probes are not fitted
    assert result["schema"] == "dit-calibration/1" and result["gpu"]["name"] == "NVIDIA H200"
    assert (
        result["config"]["precision"] == "bf16"
        and result["model"]["params_trainable"] == spec.params_trainable
    )
    # the planner takes the assumptions as they are
    assumptions = result["assumptions"]
    assert set(assumptions) <= set(CALIBRATABLE)
    calibrated = Assumptions().calibrated(assumptions)
    assert calibrated.cuda_context_bytes == CONTEXT and calibrated.fragmentation == pytest.approx(
        RESERVED_RATIO - 1
    )
    assert calibrated.mfu_mixed == pytest.approx(fit["planner_mfu"])
    # the planner's MFU is saturated and its step carries a fixed cost, so it sits above the plain ratio
    assert fit["mfu"] < fit["planner_mfu"] <= 1.0
    path = tmp_path / "out" / "calib.json"
    write_json_atomically(path, result)
    assert json.loads(path.read_text())["largest_micro_batch"] == largest
    assert [p.name for p in path.parent.iterdir()] == ["calib.json"]

    # The round trip: dit-plan reading the file predicts the images/s measured at that micro-batch.
    from planner.cli import main as dit_plan

    flags = ["--gpu", "h200", "--gpus", "1", "--global-batch", "32", "--max-micro-batch", "32"]
    flags += ["--sharding", "ddp", "--checkpointing", "0", "--precision", "bf16", "--latents", "precomputed"]
    assert dit_plan([*flags, "--calibration", str(path), "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert (plan["decision"]["micro_batch"], plan["decision"]["grad_accum"]) == (32, 1)
    assert plan["throughput"]["est_images_per_s"] == pytest.approx(images_per_s, rel=1e-6)


def test_an_out_of_memory_among_the_requested_micro_batches_bounds_the_search():
    spec = model_spec("DiT-XL/2", 256)
    calls = []
    gpu = {"name": "small GPU", "total_bytes": 20 * GiB, "capability": "8.0", "preset": None, "_preset": None}
    global TOTAL
    saved, TOTAL = TOTAL, 20 * GiB
    try:
        result = cal.calibrate(
            xl_plan(),
            [4, 8, 64],
            steps=1,
            max_micro_batch=None,
            measure=recorded_measure(spec.tokens, calls),
            gpu=gpu,
            log=lambda line: None,
        )
    finally:
        TOTAL = saved
    largest = max(
        mb for mb in range(1, 100) if int((FIXED + PER_SAMPLE * mb) * RESERVED_RATIO) + CONTEXT <= 20 * GiB
    )
    assert result["largest_micro_batch"] == largest
    assert 64 in result["out_of_memory_micro_batches"]
    assert all(mb <= 64 for mb in calls)
    assert result["fit"]["mfu"] is None and "mfu_mixed" not in result["assumptions"]


def test_fewer_than_two_fitting_micro_batches_is_a_user_error():
    gpu = {"name": "tiny", "total_bytes": 10 * GiB, "preset": None, "_preset": None}
    with pytest.raises(UserError, match="smaller ones"):
        cal.calibrate(xl_plan(), [1, 2, 4], 1, None, oom_above(1), gpu, log=lambda line: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_calibrate_says_so_in_one_line_and_exits_2(tmp_path, capsys):
    assert cal.main(["--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU" in err
    assert not (tmp_path / "c.json").exists()


def test_bad_micro_batch_lists_are_refused():
    with pytest.raises(UserError):
        cal._micro_batches("8")
    with pytest.raises(UserError):
        cal._micro_batches("8,x")
    assert cal._micro_batches("32, 8,16") == [8, 16, 32]


# --- the GPU's own code path, the CPU standing in for CUDA ----------------------------------------------

CUBLAS_OOM = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def tiny_plan(micro_batch=2) -> Plan:
    """A 2-block DiT on 4x4 latents: the real step runs in milliseconds on the CPU."""
    model = {"name": "DiT-custom", "resolution": 32, "depth": 2, "hidden": 32, "heads": 2, "patch": 2}
    return a_plan(model, micro_batch, "fp32")


@pytest.fixture
def step_on_cpu(monkeypatch):
    """`cuda_measure` runs the trainer's real step on the CPU: torch.cuda's statistics answer as a GPU whose
    peak grows by 1 MiB a sample, and every micro-step above `failing_above` raises `error`."""
    import dit_accel.memtrace as memtrace

    real_build = memtrace.build_step_parts
    state = {"micro_batch": 0, "failing_above": 10**9, "error": RuntimeError(CUBLAS_OOM), "micro_steps": 0}

    def build(plan, spec, checkpointed_blocks, micro_batch, device, **kwargs):
        assert device == "cuda"
        state["micro_batch"] = micro_batch
        parts = real_build(plan, spec, checkpointed_blocks, micro_batch, "cpu", **kwargs)
        real_micro_step = parts.micro_step

        def micro_step():
            if micro_batch > state["failing_above"]:
                raise state["error"]
            state["micro_steps"] += 1
            return real_micro_step()

        parts.micro_step = micro_step
        return parts

    allocated = lambda *args: GiB + MiB * state["micro_batch"]
    monkeypatch.setattr(memtrace, "build_step_parts", build)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocated)
    calls = iter(
        range(10**6)
    )  # cumulative counters, as torch's: 2 more retries and 1 more caught OOM a reading

    def memory_stats(*args):
        k = next(calls)
        return {"num_alloc_retries": 2 * k, "num_ooms": k, "allocated_bytes.all.current": 0}

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *args: allocated() + 2 * MiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (TOTAL - allocated() - 500 * MiB, TOTAL))
    return state


def test_out_of_memory_as_cuda_libraries_report_it():
    assert cal.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert cal.is_out_of_memory(RuntimeError(CUBLAS_OOM))
    assert cal.is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert cal.is_out_of_memory(torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors ..."))
    assert not cal.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not cal.is_out_of_memory(ValueError("CUDA error: out of memory"))


def test_a_cublas_allocation_failure_is_an_out_of_memory_point_and_the_calibration_goes_on(
    step_on_cpu, tmp_path
):
    plan = tiny_plan()
    spec = plan.spec()
    step_on_cpu["failing_above"] = 6
    out = tmp_path / "calibration.json"
    saved = []

    def save(document):
        write_json_atomically(out, document)
        saved.append(json.loads(out.read_text()))

    gpu = {"name": "CPU as a GPU", "total_bytes": TOTAL, "preset": None, "_preset": None}
    allocator = cal.allocator_settings({}, torch)
    result = cal.calibrate(
        plan,
        [2, 4, 8],
        steps=1,
        max_micro_batch=16,
        measure=cal.cuda_measure(plan, spec, 1),
        gpu=gpu,
        log=lambda line: None,
        probe=cal.cuda_measure(plan, spec, 1),
        allocator=allocator,
        save=save,
    )
    assert step_on_cpu["micro_steps"] == 6  # 2, 4 and the probe 6: a warm-up and a timed step each
    assert [m["micro_batch"] for m in result["measurements"]] == [2, 4]
    assert result["out_of_memory_micro_batches"] == [7, 8]
    assert (result["largest_micro_batch"], result["smallest_oom_micro_batch"]) == (6, 7)
    assert result["fit"]["per_sample_bytes"] == MiB and result["fit"]["outside_allocator_bytes"] == 498 * MiB
    assert result["complete"] and result["allocator"]["expandable_segments"]
    assert json.loads(out.read_text()) == result
    # Written after every micro-batch: the first point alone, not yet something the planner reads.
    from planner.calibration import check_calibration
    from planner.errors import PlanError

    first = saved[0]
    assert [m["micro_batch"] for m in first["measurements"]] == [2] and first["complete"] is False
    with pytest.raises(PlanError, match="incomplete"):
        check_calibration(first)
    # Once the requested micro-batches are done the fit is final; the search then only moves its bounds.
    fitted = next(document for document in saved if "assumptions" in document)
    assert fitted["complete"] is False and fitted["assumptions"] == result["assumptions"]
    check_calibration(fitted)
    bounds = [(d["largest_micro_batch"], d["smallest_oom_micro_batch"]) for d in saved if "fit" in d]
    assert bounds == [(4, 8), (6, 8), (6, 7), (6, 7)]


def test_an_error_that_is_not_out_of_memory_stops_the_calibration(step_on_cpu):
    plan = tiny_plan()
    step_on_cpu.update(failing_above=2, error=RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        cal.cuda_measure(plan, plan.spec(), 1)(4)
    with pytest.raises(cal.MeasureOOM):
        step_on_cpu["error"] = torch.cuda.OutOfMemoryError("CUDA out of memory")
        cal.cuda_measure(plan, plan.spec(), 1)(4)


def test_the_allocator_is_the_trainers_unless_the_user_chose_one():
    env = {}
    settings = cal.allocator_settings(env, torch)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert settings["expandable_segments"] and settings["source"].startswith("set by calibrate")
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    settings = cal.allocator_settings(env, torch)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert not settings["expandable_segments"] and settings["source"] == "the environment's"


def fake_gpu_command(monkeypatch, tmp_path, measure):
    """`main` as on a GPU: CUDA present, the measure given, the plan a file."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(
        cal, "_gpu_facts", lambda torch: {"name": "fake", "total_bytes": TOTAL, "_preset": None}
    )
    monkeypatch.setattr(cal, "cuda_measure", lambda plan, spec, steps, warmup_steps=1: measure)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(tiny_plan().to_json()))
    return plan_path


def test_the_command_measures_under_expandable_segments_and_writes_the_file(monkeypatch, tmp_path, capsys):
    seen = []

    def measure(micro_batch):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        return oom_above(20)(micro_batch)

    plan_path = fake_gpu_command(monkeypatch, tmp_path, measure)
    out = tmp_path / "c.json"
    assert cal.main(["--plan", str(plan_path), "--micro-batches", "4,8", "--out", str(out)]) == 0
    assert set(seen) == {"expandable_segments:True"}
    written = json.loads(out.read_text())
    assert written["complete"] and written["largest_micro_batch"] == 20
    assert written["allocator"]["alloc_conf"] == "expandable_segments:True"
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in capsys.readouterr().out
    assert written["config"]["steps"] == 3 and written["config"]["warmup_steps"] == 1


def test_the_command_passes_its_warmup_steps_to_the_fitted_points_not_to_the_search(monkeypatch, tmp_path):
    plan_path = fake_gpu_command(monkeypatch, tmp_path, oom_above(20))
    asked = []

    def cuda_measure(plan, spec, steps, warmup_steps=1):
        asked.append((steps, warmup_steps))
        return oom_above(20)

    monkeypatch.setattr(cal, "cuda_measure", cuda_measure)
    out = tmp_path / "c.json"
    argv = ["--plan", str(plan_path), "--micro-batches", "4,8", "--steps", "6", "--warmup-steps", "3"]
    assert cal.main([*argv, "--out", str(out)]) == 0
    assert asked == [(6, 3), (1, 1)]  # the fitted points; the search's probes
    assert json.loads(out.read_text())["config"]["warmup_steps"] == 3


def test_the_command_leaves_no_file_when_too_few_micro_batches_fit(monkeypatch, tmp_path, capsys):
    plan_path = fake_gpu_command(monkeypatch, tmp_path, oom_above(1))
    out = tmp_path / "c.json"
    assert cal.main(["--plan", str(plan_path), "--micro-batches", "1,2,4", "--out", str(out)]) == 2
    assert "smaller ones" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    ("precision", "matmul", "tf32"),
    [("fp32", "ieee-fp32", False), ("fp32", "tf32", True), ("bf16", "bf16", True)],
)
def test_the_command_times_the_step_with_tf32_as_the_trainer_runs_the_plan(
    monkeypatch, tmp_path, capsys, precision, matmul, tf32
):
    """torch leaves TF32 matmuls off by default; the trainer turns them on unless the plan is IEEE fp32, and
    calibrate must time that step, not torch's default one."""
    plan_path = fake_gpu_command(monkeypatch, tmp_path, oom_above(20))
    data = tiny_plan().to_json()
    data["decision"]["precision"], data["throughput"] = precision, {"matmul": matmul}
    assert parse_plan(data).matmul == matmul
    plan_path.write_text(json.dumps(data))
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    try:
        out = tmp_path / "c.json"
        assert cal.main(["--plan", str(plan_path), "--micro-batches", "4,8", "--out", str(out)]) == 0
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert json.loads(out.read_text())["config"]["matmul"] == matmul
    assert (
        f"TF32 matmuls and convolutions: {'on' if tf32 else 'off'} ({matmul} plan)" in capsys.readouterr().out
    )


def test_a_vram_cap_that_is_no_size_or_not_below_the_card_is_refused_in_one_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert cal.main(["--plan", str(plan), "--vram", "80", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--vram '80' has no unit" in err  # before any CUDA question
    with pytest.raises(UserError, match="not below this GPU's 140.0 GiB"):
        cal.cap_allocator(None, 141 * GiB, 140 * GiB)


def test_a_plan_from_before_the_matmul_mode_trains_fp32_with_tf32_and_mixed_at_its_precision():
    model = {"name": "DiT-custom", "resolution": 32, "depth": 2, "hidden": 32, "heads": 2, "patch": 2}
    assert tiny_plan().matmul == "tf32" and a_plan(model, 2, "bf16").matmul == "bf16"


def test_warmup_steps_are_run_untimed_before_the_timed_ones(step_on_cpu, monkeypatch):
    """--warmup-steps 3: three steps start the clock but are not timed (a slow 5 s one among them), then the
    two timed steps (0.2 s, 0.4 s) give the point; the optimizer stepped five times."""
    clock = iter([0.0, 1.0, 6.0, 10.0, 10.2, 20.0, 20.4])
    monkeypatch.setattr(cal, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    plan = tiny_plan()
    point = cal.cuda_measure(plan, plan.spec(), 2, warmup_steps=3)(2)
    assert point.step_seconds == pytest.approx(0.3)
    assert (point.alloc_retries, point.caught_ooms) == (2, 1)  # the counters' change over the point
    assert step_on_cpu["micro_steps"] == 5 * point.grad_accum
    assert next(clock, None) is None  # every clock reading used: no step more, none less


def test_a_points_step_time_is_the_median_of_its_timed_steps_not_the_slower_of_two(step_on_cpu, monkeypatch):
    """With --steps 2 the upper of the two was taken: on the H200 the first point of each process ran slow."""
    clock = iter([0.0, 10.0, 10.2, 20.0, 20.4])  # the warm-up's start (untimed), then 0.2 s and 0.4 s steps
    monkeypatch.setattr(cal, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    plan = tiny_plan()
    point = cal.cuda_measure(plan, plan.spec(), 2)(2)
    assert point.step_seconds == pytest.approx(0.3)
