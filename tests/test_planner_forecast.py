"""What these hours buy (planner.forecast): the published FID milestones, each held to its source's figure, set
against a plan's own steps, hours, GPU-hours and cost at equal images seen; --target-fid's cheapest milestone;
a sweep ranked by the hours to it."""

from __future__ import annotations

import json
import math

import pytest

from planner.cli import main as dit_plan
from planner.errors import PlanError
from planner.forecast import method_of, milestones
from planner.plan import make_plan

# (method, steps, global batch, FID-50K guided, unguided): what each source states (presets/milestones.yaml)
PUBLISHED = [
    ("DiT", 400_000, 256, None, 19.47),
    ("DiT", 7_000_000, 256, 2.27, 9.62),
    ("SiT", 400_000, 256, None, 17.2),
    ("SiT", 7_000_000, 256, 2.06, None),
    ("REPA", 400_000, 256, None, 7.9),
    ("REPA", 4_000_000, 256, 1.42, 5.9),
    ("LightningDiT", 80_000, 1024, 2.11, 5.14),
    ("LightningDiT", 1_000_000, 1024, 1.35, 2.17),
]


def test_every_milestone_is_its_sources_figure_and_names_the_source():
    rows = milestones()
    assert [(r.method, r.steps, r.global_batch, r.fid_guided, r.fid_unguided) for r in rows] == PUBLISHED
    for row in rows:
        assert len(row.source) > 40 and ("arXiv" in row.source or "README" in row.source), row
        stated = [f for f in (row.fid_guided, row.fid_unguided) if f is not None]
        assert stated and all(f"{f:g}" in row.source for f in stated), (
            row
        )  # the source's line says the figure
        assert row.resolution == 256 and row.protocol  # each under a `sample --protocol` of its paper
    from dit_accel.sample.protocols import PROTOCOLS

    assert {row.protocol for row in rows} <= set(PROTOCOLS)


def _plan(**extra) -> dict:
    return make_plan(gpus=8, gpu="h100-80g", global_batch=256, **extra)


def test_each_milestone_becomes_this_plans_steps_hours_and_cost_at_equal_images_seen():
    plan = _plan(recipe="", gpu_hour_cost=2.5)
    rate, low, high = (
        plan["throughput"][k] for k in ("est_images_per_s", "est_images_per_s_low", "est_images_per_s_high")
    )
    forecast = plan["forecast"]
    assert forecast["method"] == "DiT" and [row["steps"] for row in forecast["rows"]] == [400_000, 7_000_000]
    for row in forecast["rows"]:
        images = row["steps"] * 256  # this plan's batch is the milestone's: the same steps
        assert row["images_seen"] == images
        assert row["time_s"] == pytest.approx(images / rate)
        assert (row["time_s_low"], row["time_s_high"]) == pytest.approx((images / high, images / low))
        assert row["gpu_hours"] == pytest.approx(images / rate * 8 / 3600)
        assert row["cost"] == pytest.approx(row["gpu_hours"] * 2.5)
    assert not any("another global batch" in note for note in forecast["notes"])


def test_another_global_batch_reaches_the_milestone_at_equal_images_and_says_so():
    plan = make_plan(gpus=8, gpu="h100-80g", global_batch=512, recipe="dit")
    first = plan["forecast"]["rows"][0]
    assert first["steps"] == 200_000 and first["images_seen"] == 400_000 * 256
    assert any("at equal images seen, not equal steps" in note for note in plan["forecast"]["notes"])


@pytest.mark.parametrize(
    ("flags", "method"),
    [
        ({}, "DiT"),
        ({"objective": "flow"}, "SiT"),
        ({"objective": "flow", "repa": "dinov2-b"}, "REPA"),
        ({"model": "LightningDiT-XL/1"}, "LightningDiT"),
    ],
)
def test_the_recipe_the_flags_imply(flags, method):
    assert _plan(recipe="auto", **flags)["forecast"]["method"] == method


def test_a_target_fid_is_the_cheapest_milestone_reaching_it_or_the_best_there_is():
    hit = _plan(target_fid=2.5)["forecast"]
    assert (hit["target"]["method"], hit["target"]["steps"]) == (
        "REPA",
        4_000_000,
    )  # 1.42 in the fewest images
    assert any("plan with REPA's flags" in note for note in hit["notes"])
    unguided = _plan(target_fid=10, target_guidance="unguided")["forecast"]
    assert (unguided["target"]["method"], unguided["target"]["steps"]) == ("REPA", 400_000)  # 7.9 at 400K
    none = make_plan(gpus=8, gpu="h100-80g", global_batch=1024, model="LightningDiT-XL/1", target_fid=1.0)
    from planner.forecast import target_sentence

    assert none["forecast"]["target"] is None and none["forecast"]["best"]["fid_guided"] == 1.35
    assert "no published run of this network reached it; the best is 1.35 (LightningDiT" in target_sentence(
        none["forecast"]
    )


def test_a_network_with_no_milestone_says_so_and_no_forecast_unless_asked():
    assert _plan()["forecast"] is None  # the README's plan output stays as it was
    small = make_plan(gpus=1, vram="8G", global_batch=8, model="DiT-S/2", recipe="")["forecast"]
    assert small["rows"] == [] and "no published milestone is of DiT-S/2 at 256 px" in small["notes"][0]


def test_a_bad_recipe_or_target_is_one_line(capsys, tmp_path):
    with pytest.raises(PlanError, match="--recipe 'nope' is none of the recipes with published milestones"):
        method_of("nope")
    assert method_of("repa-sit-xl2-256") == "REPA" and method_of("lightningdit") == "LightningDiT"
    assert dit_plan(["--gpu", "h100-80g", "--gpus", "8", "--target-fid", "-1", "--out", str(tmp_path)]) == 2
    assert "--target-fid must be a positive" in capsys.readouterr().err


def test_the_terminal_section_fits_100_columns_and_plan_md_names_every_source(tmp_path, capsys):
    argv = ["--gpu", "h100-80g", "--gpus", "8", "--recipe", "--target-fid", "2.5", "--gpu-hour-cost", "2.5"]
    assert dit_plan([*argv, "--out", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    section = out[out.index("What these hours buy") : out.index("Warnings")]
    assert max(map(len, section.splitlines())) <= 100 and "DiT 7M x 256" in section
    assert "FID 2.5 (guided): reached by REPA at 4,000,000 of this plan's steps" in section
    md = (tmp_path / "plan" / "plan.md").read_text()
    assert "## What these hours buy" in md and md.count("arXiv:2212.09748") >= 2 and "arXiv:2410.06940" in md
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())["forecast"]
    assert saved["target"]["method"] == "REPA" and math.isfinite(saved["target"]["cost"])


def test_a_sweep_ranks_gpus_by_the_hours_to_the_target(capsys):
    argv = [
        "--gpu",
        "h100-80g,h200",
        "--gpus",
        "8,16",
        "--model",
        "LightningDiT-XL/1",
        "--global-batch",
        "1024",
    ]
    assert dit_plan([*argv, "--target-fid", "2.2", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    hours = [row["target_hours"] for row in rows]
    assert hours == sorted(hours) and len(hours) == 4  # the fastest to the target first
    assert all(row["target_method"] == "LightningDiT" for row in rows)
