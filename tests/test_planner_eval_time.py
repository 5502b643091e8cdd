"""dit-plan --eval-every: the trainer's FID evaluations' sampling time, added to the time to train.

Held to the arithmetic by hand: steps x model calls x guidance forwards of the spec's FLOPs per image, for
every sample of floor(steps / every) evaluations, at the cluster's peak x the pinned MFU."""

import json

import pytest

from planner.hardware import gpu_preset
from planner.plan import make_plan
from planner.spec import model_spec

CLUSTER = dict(gpus=8, gpu="h100-80g", global_batch=256, steps=400_000, assumptions={"mfu_mixed": 0.5})


def _expected_s(evaluations: int, samples: int, forwards_per_image: int) -> float:
    flops = model_spec("DiT-XL/2", 256, "precomputed").fwd_flops_per_image
    peak = gpu_preset("h100-80g").matmul_peak_flops("bf16")
    return evaluations * samples * forwards_per_image * flops / (8 * peak * 0.5)


@pytest.mark.parametrize(
    "objective, cfg_scale, forwards_per_step",
    [("ddpm", 1.0, 1), ("ddpm", 1.5, 2), ("flow", 1.0, 2), ("flow", 4.0, 4)],
)
def test_evaluation_time_is_steps_times_forwards_of_every_sample_at_peak_times_mfu(
    objective, cfg_scale, forwards_per_step
):
    base = make_plan(**CLUSTER, objective=objective)["throughput"]
    plan = make_plan(
        **CLUSTER, objective=objective, eval_every=30_000, eval_samples=10_000, eval_cfg_scale=cfg_scale
    )
    t, evaluation = plan["throughput"], plan["throughput"]["evaluation"]
    assert evaluation["evaluations"] == 13  # steps 30,000 ... 390,000; never step 0
    expected = _expected_s(13, 10_000, 250 * forwards_per_step)
    assert evaluation["time_s"] == pytest.approx(expected, rel=1e-12)
    # the MFU pinned: no range, the same time at both ends
    assert evaluation["time_s_low"] == evaluation["time_s_high"] == pytest.approx(expected, rel=1e-12)
    assert base["evaluation"] is None
    assert t["time_to_train_s"] == pytest.approx(base["time_to_train_s"] + expected, rel=1e-12)
    assert t["gpu_hours"] == pytest.approx((base["time_to_train_s"] + expected) * 8 / 3600, rel=1e-12)
    for alternative, before in zip(
        plan["alternatives"], make_plan(**CLUSTER, objective=objective)["alternatives"]
    ):
        assert alternative["time_to_train_s"] == pytest.approx(
            before["time_to_train_s"] + expected, rel=1e-12
        )


def test_the_time_to_train_table_shows_the_evaluation_on_its_own_line_and_plan_json_holds_it(
    tmp_path, capsys
):
    from planner.cli import main

    argv = ["--gpus", "8", "--gpu", "h100-80g", "--global-batch", "256", "--steps", "100000"]
    argv += ["--assume", "mfu_mixed=0.5", "--eval-every", "50000", "--eval-samples", "5000"]
    argv += ["--eval-steps", "100", "--out", str(tmp_path / "plan")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("Time to train") :]
    assert "of which evaluation: 2 x 5,000 samples," in table and "every 50,000" in table
    evaluation = json.loads((tmp_path / "plan" / "plan.json").read_text())["throughput"]["evaluation"]
    assert evaluation["time_s"] == pytest.approx(_expected_s(2, 5000, 100), rel=1e-12)
    assert (evaluation["steps"], evaluation["model_calls_per_step"], evaluation["guidance_factor"]) == (
        100,
        1,
        1,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--eval-every", "1000"],
            "--eval-every adds its sampling time to the time to train: give --steps N",
        ),
        (["--steps", "10", "--eval-every", "0"], "--eval-every must be a positive finite number"),
        (["--steps", "10", "--eval-every", "5", "--eval-cfg-scale", "nan"], "--eval-cfg-scale must be"),
    ],
)
def test_bad_evaluation_flags_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    from planner.cli import main

    assert main(["--gpus", "8", "--vram", "80G", *flags, "--out", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "plan").exists()
