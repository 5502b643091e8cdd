"""plan.json read back through `planner.planfile`: a plan made by the real `dit-plan` reads back unchanged,
and every hand edit that breaks it is refused with one PlanError line that names the file, the key and the
fix, by the reader itself (no dit-plan CLI, no exit), by the doctor's reader, and by the trainer's process."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dit_accel.doctor.plan import load_plan
from planner.cli import main as dit_plan
from planner.errors import PlanError
from planner.planfile import Plan, parse_plan, read_plan
from planner.spec import model_spec

# DiT-XL/2 at 256 px on 2 x 40 GB, global batch 16: micro-batch 8 x accumulation 1 x 2 GPUs, 28 blocks
ARGS = ["--gpus", "2", "--vram", "40G", "--global-batch", "16"]
FIXES = ("re-create it with dit-plan", "re-plan with the dit-plan", "make one with `dit-plan")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("planfile") / "plan"
    assert dit_plan([*ARGS, "--out", str(folder)]) == 0
    path = folder / "plan.json"
    data = json.loads(path.read_text())
    # the layout the edits below start from
    assert (data["decision"]["micro_batch"], data["decision"]["grad_accum"]) == (8, 1)
    assert data["cluster"]["world_size"] == 2 and data["global_batch"] == 16 and data["model"]["depth"] == 28
    return path


def _node(data: dict, dotted: str):
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data[part]
    return data, leaf


def set_(dotted: str, value):
    def edit(data):
        node, leaf = _node(data, dotted)
        node[leaf] = value

    return edit


def drop(dotted: str):
    def edit(data):
        node, leaf = _node(data, dotted)
        del node[leaf]

    return edit


# (edit, what the one line must say: the key and the offending value)
BAD_EDITS = {
    "negative micro_batch": (set_("decision.micro_batch", -8), ["decision.micro_batch is -8", "positive"]),
    "zero grad_accum": (set_("decision.grad_accum", 0), ["decision.grad_accum is 0", "positive"]),
    "float micro_batch": (set_("decision.micro_batch", 2.5), ["decision.micro_batch is 2.5", "whole number"]),
    "string micro_batch": (
        set_("decision.micro_batch", "4"),
        ["decision.micro_batch is '4'", "whole number"],
    ),
    "bool micro_batch": (
        set_("decision.micro_batch", True),
        ["decision.micro_batch is True", "whole number"],
    ),
    "product, micro_batch": (
        set_("decision.micro_batch", 4),
        ["global_batch 16", "micro_batch x grad_accum x world_size", "(4 x 1 x 2)"],
    ),
    "product, global_batch": (
        set_("global_batch", 32),
        ["global_batch 32", "micro_batch x grad_accum x world_size", "(8 x 1 x 2)"],
    ),
    "old schema": (set_("schema", "dit-plan/0"), ["schema 'dit-plan/0'", "dit-plan/1"]),
    "no schema": (drop("schema"), ["schema None", "dit-plan/1"]),
    "no decision": (drop("decision"), ["lacks decision"]),
    "no decision.precision": (drop("decision.precision"), ["lacks decision.precision"]),
    "no cluster.world_size": (drop("cluster.world_size"), ["lacks cluster.world_size"]),
    "no model": (drop("model"), ["lacks model"]),
    "unknown precision": (
        set_("decision.precision", "fp8"),
        ["decision.precision is 'fp8'", "bf16, fp16, fp32"],
    ),
    "unknown sharding": (
        set_("decision.sharding", "zero1"),
        ["decision.sharding is 'zero1'", "ddp, zero2, zero3"],
    ),
    "checkpointed_blocks > depth": (
        set_("decision.checkpointed_blocks", 29),
        ["decision.checkpointed_blocks 29", "28 blocks"],
    ),
}


def write_edited(made: Path, folder: Path, edit) -> Path:
    data = json.loads(made.read_text())
    edit(data)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def assert_one_line(error: PlanError | str, path, *says: str) -> str:
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert str(path) in message, message  # which file
    for part in says:
        assert part in message, (part, message)
    assert any(fix in message for fix in FIXES), message  # and what to do: (re-)make it with dit-plan
    return message


@pytest.mark.parametrize("case", list(BAD_EDITS))
def test_a_hand_edited_plan_is_refused_in_one_line_naming_the_key(made, tmp_path, capsys, case):
    edit, says = BAD_EDITS[case]
    path = write_edited(made, tmp_path, edit)
    capsys.readouterr()
    with pytest.raises(PlanError) as refused:  # an exception from the reader itself: no SystemExit, no print
        read_plan(path)
    assert capsys.readouterr() == ("", "")
    message = assert_one_line(refused.value, path, *says)
    # the doctor reads the plan with the same reader: the same line
    with pytest.raises(PlanError) as doctor:
        load_plan(path)
    assert str(doctor.value) == message
    # parse_plan names the origin it is given
    with pytest.raises(PlanError) as parsed:
        parse_plan(json.loads(path.read_text()), "hand-edited.json")
    assert str(parsed.value) == message.replace(str(path), "hand-edited.json")


@pytest.mark.parametrize(
    "text, says",
    [
        (None, ["is not valid JSON"]),  # None: the real plan cut in half, as an interrupted copy leaves it
        ("", ["is not valid JSON", "line 1"]),
        ("[1, 2]", ["is not a JSON object"]),
    ],
)
def test_a_file_that_is_not_a_plan_object_is_refused_in_one_line(made, tmp_path, capsys, text, says):
    path = tmp_path / "plan.json"
    whole = made.read_text()
    path.write_text(whole[: len(whole) // 2] if text is None else text)
    capsys.readouterr()
    with pytest.raises(PlanError) as refused:
        read_plan(path)
    assert capsys.readouterr() == ("", "")
    assert_one_line(refused.value, path, *says)


def test_a_missing_plan_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "nowhere" / "plan.json"
    with pytest.raises(PlanError) as refused:
        read_plan(path)
    assert capsys.readouterr() == ("", "")
    assert_one_line(refused.value, path, "not found", "--out DIR")
    with pytest.raises(PlanError):  # a folder is not a plan either
        read_plan(tmp_path)


def test_the_plan_dit_plan_wrote_reads_back_unchanged(made):
    original = json.loads(made.read_text())
    plan = read_plan(made)
    assert isinstance(plan, Plan)
    assert plan.to_json() == original
    # to_json is a copy: editing it leaves the plan as read
    copied = plan.to_json()
    copied["decision"]["micro_batch"] = 1
    assert plan.to_json() == original and plan.decision.micro_batch == 8
    assert (plan.schema, plan.world_size, plan.global_batch) == (original["schema"], 2, 16)
    assert (plan.decision.micro_batch, plan.decision.grad_accum) == (8, 1)
    assert plan.decision.micro_batch * plan.decision.grad_accum * plan.world_size == plan.global_batch
    assert plan.precision.name == original["decision"]["precision"]
    assert plan.precision.accelerate_mixed_precision == original["decision"]["mixed_precision"]
    assert plan.sharding.name == original["decision"]["sharding"]
    assert plan.memory is not None and plan.memory.peak_bytes == original["memory"]["peak_bytes"]
    assert parse_plan(copy.deepcopy(original)).to_json() == original


def test_the_plan_spec_is_the_planners_spec(made):
    plan = read_plan(made)
    planned = model_spec("DiT-XL/2", 256, plan.decision.latents)
    spec = plan.spec()
    assert spec.params_trainable == planned.params_trainable == plan.model.params_trainable
    assert (spec.depth, spec.hidden, spec.heads, spec.patch) == (28, 1152, 16, 2)
    assert spec.latent_size == plan.model.latent_size == 32


def test_a_changed_decision_is_written_back(made):
    plan = read_plan(made)
    halved = plan.with_decision(micro_batch=4, grad_accum=2)
    decision = halved.to_json()["decision"]
    assert (decision["micro_batch"], decision["grad_accum"]) == (4, 2)
    assert read_plan(made).to_json() == plan.to_json()  # the original is untouched
    assert parse_plan(halved.to_json()).decision.grad_accum == 2  # and the variant is itself a plan


@pytest.mark.launched
def test_the_trainer_refuses_a_bad_plan_in_one_line_before_writing_anything(made, tmp_path):
    path = write_edited(made, tmp_path / "bad", set_("decision.micro_batch", 4))
    out = tmp_path / "run"
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), PYTHONUNBUFFERED="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "dit_accel.train",
        "--plan",
        str(path),
        "--output-dir",
        str(out),
        "--latents",
        str(tmp_path / "latents"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("dit_accel.train: error: plan ")
    assert_one_line(lines[0], path, "global_batch 16", "(4 x 1 x 2)")
    assert not out.exists()  # refused before the run folder was made
