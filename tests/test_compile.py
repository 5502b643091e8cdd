"""Compiled blocks (dit_accel.models.compile): `torch.compile` per transformer block, on the CPU with inductor.

Compiled and eager training of the same plan and samples agree: one process in-process (one checkpointed
block of two, micro-batch 4 x accumulation 2), and two processes launched over gloo with a zero2
plan (FSDP2, micro 2 x accumulation 2 per rank, one checkpointed block). The tiny 2-block network keeps
compile time to one block's graph, which both blocks share; inductor's on-disk cache then serves later runs
(a cold cache costs minutes on a 2-core box, a warm one seconds: docs/training.md, "Compiled blocks").

Why the tolerances: inductor fuses and reorders float arithmetic (layer norms, softmax, matmul epilogues), so
each op's result differs from eager's by float32 rounding, about 1e-7 relative. Over 4 AdamW steps at lr
3e-3 that stays near 1e-6 in the weights (measured: 5e-7 after 3 steps), except for parameters without a
true gradient (the attention key biases, tests/equivalence.py): their gradients are rounding noise in both
runs and AdamW scales any noise up to a step of lr, so they are left out, as in the cross-layout tests.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from equivalence import has_true_gradient
from test_train_e2e import run_in_process
from test_train_fsdp import QUIET, TINY, _assert_close, _finish, _losses, _start, _weights

from dit_accel.models.compile import compile_blocks, compiled_blocks, resolve_compile
from dit_accel.train.flags import parse_config
from planner.planfile import parse_plan

WEIGHTS_ATOL = 1e-5  # 10x the measured difference, 300x below one AdamW step (lr 3e-3)
LOSS_REL = 1e-5

# The trainer launched through this writes, per rank, what dynamo compiled: graphs and graph breaks.
DYNAMO_PROBE = """
import json, os, sys
from pathlib import Path
from torch._dynamo.utils import counters
from dit_accel.train.loop import main
code = main(sys.argv[1:])
stats = {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
Path(__file__).with_name(f"dynamo_{Path(sys.argv[sys.argv.index('--output-dir') + 1]).name}_rank"
                         f"{os.environ.get('RANK', '0')}.json").write_text(json.dumps(stats))
sys.exit(code)
"""


def _dit_plan(out: Path, *args: str) -> Path:
    from planner.cli import main as dit_plan

    assert dit_plan([*args, "--out", str(out)]) == 0
    return out


# --- the decision, without compiling anything ---------------------------------------------------------------


def test_the_flag_overrides_and_auto_follows_the_plan_on_cuda_only():
    assert resolve_compile(True, False, "cpu") == (True, "--compile")
    assert resolve_compile(False, True, "cuda") == (False, "--no-compile")
    assert resolve_compile(None, True, "cpu") == (False, "auto: off on CPU")
    assert resolve_compile(None, True, "cuda") == (True, "auto: the plan's compile true")
    assert resolve_compile(None, False, "cuda")[0] is False
    assert parse_config(["--plan", "p", "--output-dir", "o", "--latents", "l"]).compile is None
    assert parse_config(["--plan", "p", "--output-dir", "o", "--latents", "l", "--compile"]).compile is True
    assert (
        parse_config(["--plan", "p", "--output-dir", "o", "--latents", "l", "--no-compile"]).compile is False
    )


def test_plans_record_compile_and_older_plans_read_as_eager(tmp_path):
    on = json.loads((_dit_plan(tmp_path / "on", *TINY) / "plan.json").read_text())
    off = json.loads((_dit_plan(tmp_path / "off", *TINY, "--no-compile") / "plan.json").read_text())
    assert on["decision"]["compile"] is True and off["decision"]["compile"] is False
    assert parse_plan(on).compile is True and parse_plan(off).compile is False
    del on["decision"]["compile"]  # a plan written before the key: sized and run eager
    assert parse_plan(on).compile is False
    on["decision"]["compile"] = "yes"
    with pytest.raises(Exception, match="decision.compile is 'yes', not a bool"):
        parse_plan(on)


@pytest.mark.slow  # torch.compile imports dynamo and inductor: seconds, though nothing is compiled
def test_compiling_keeps_names_and_marks_every_block():
    from dit_accel.models.dit import build_model, checkpointed_blocks, set_checkpointed_blocks
    from planner.spec import DiTSpec

    spec = DiTSpec(name="DiT-S/2", depth=2, hidden=32, heads=2, patch=2, resolution=32, latents="pixel")
    model = build_model(spec)
    names = [name for name, _ in model.named_parameters()]
    set_checkpointed_blocks(model, 1)
    assert compile_blocks(model) == 2 and compile_blocks(model) == 2  # idempotent
    assert compiled_blocks(model) == 2 and checkpointed_blocks(model) == 1
    assert [name for name, _ in model.named_parameters()] == names  # state dicts and checkpoints unchanged
    assert type(model.transformer_blocks[0]) is type(model.transformer_blocks[1])  # one compiled forward


# --- compiled against eager training ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The eager and compiled runs of two plans on the same 32 px pixel images: one process (ddp), in-process;
    two processes (zero2 eager and compiled side by side). Each run prints how long it took."""
    import time

    from dit_accel.data.demo import write_demo_data

    root = tmp_path_factory.mktemp("compile")
    images = root / "images"
    write_demo_data(images, classes=4, per_class=8, resolution=32, seed=0)
    shape = [*TINY, "--precision", "fp32", "--checkpointing", "1"]  # TINY: 2 GPUs, global batch 8
    plans = {
        "ddp1": _dit_plan(
            root / "plan_ddp1", *shape, "--gpus", "1", "--max-micro-batch", "4", "--sharding", "ddp"
        ),
        "zero2": _dit_plan(root / "plan_zero2", *shape, "--max-micro-batch", "2", "--sharding", "zero2"),
    }
    probe = root / "dynamo_probe.py"
    probe.write_text(DYNAMO_PROBE)
    out, seconds = {"root": root, "plans": plans}, {}
    started = time.monotonic()
    launched = {
        name: _start(plans["zero2"], images, root / name, *flag, program=(str(probe),))
        for name, flag in (("zero2_eager", ()), ("zero2_compiled", ("--compile",)))
    }
    for name, flag in (("ddp1_eager", "--no-compile"), ("ddp1_compiled", "--compile")):
        from torch._dynamo.utils import counters

        counters.clear()
        begun = time.monotonic()
        argv = ["--plan", plans["ddp1"] / "plan.json", "--data-path", images, "--output-dir", root / name]
        assert run_in_process([*argv, *QUIET, flag]) == 0
        seconds[name] = time.monotonic() - begun
        out[f"{name}_dynamo"] = {
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
        out[name] = root / name
    for name, run in launched.items():
        out[name] = _finish(run)
    seconds["zero2 eager and compiled, side by side with the above"] = time.monotonic() - started
    print("compile test runs (s):", {name: round(s, 1) for name, s in seconds.items()}, file=sys.stderr)
    return out


def _log(run: Path, rank: int = 0) -> str:
    return (run / "logs" / f"rank{rank}.log").read_text()


@pytest.mark.slow
def test_one_process_compiled_training_matches_eager_with_a_checkpointed_block(runs):
    eager, compiled = runs["ddp1_eager"], runs["ddp1_compiled"]
    plan = json.loads((runs["plans"]["ddp1"] / "plan.json").read_text())["decision"]
    assert (plan["micro_batch"], plan["grad_accum"], plan["checkpointed_blocks"]) == (4, 2, 1)
    assert "compiled blocks: 2/2, torch.compile per block (--compile)" in _log(compiled)
    assert "compiled blocks: off, eager (--no-compile)" in _log(eager)
    # The checkpointed block and the stored one ran ONE compiled graph, whole (no graph break); eager none.
    assert runs["ddp1_compiled_dynamo"] == {"unique_graphs": 1, "graph_breaks": 0}
    assert runs["ddp1_eager_dynamo"]["unique_graphs"] == 0
    losses = _losses(compiled)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert losses == pytest.approx(_losses(eager), rel=LOSS_REL)
    final = "checkpoints/step_00000004"
    a, b = _weights(compiled / final), _weights(eager / final)
    _assert_close(a, b, WEIGHTS_ATOL, "compiled vs eager weights", layouts_differ=True)
    assert any(not torch.equal(a[k], b[k]) for k in a if has_true_gradient(k))  # really another computation


@pytest.mark.launched
def test_two_process_sharded_compiled_training_matches_eager(runs):
    """zero2 compiled against zero2 eager. zero3 runs the same per-unit graphs between the same FSDP2 hooks
    (it only reshards after forward); its compiled launch was left out to keep the suite's time."""
    sharding = "zero2"
    eager, compiled = runs["zero2_eager"], runs[f"{sharding}_compiled"]
    for rank in (0, 1):
        assert "compiled blocks: 2/2" in _log(compiled, rank) and "compiled blocks: off" in _log(eager, rank)
        dynamo = json.loads((runs["root"] / f"dynamo_{sharding}_compiled_rank{rank}.json").read_text())
        assert dynamo["unique_graphs"] >= 1, dynamo  # compiled, between FSDP2's hooks (docs/training.md)
        print(f"{sharding} compiled rank {rank}: {dynamo}", file=sys.stderr)
    losses = _losses(compiled)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert losses == pytest.approx(_losses(eager), rel=LOSS_REL)
    final = "checkpoints/step_00000004"
    _assert_close(
        _weights(compiled / final),
        _weights(eager / final),
        WEIGHTS_ATOL,
        f"{sharding} weights",
        layouts_differ=True,
    )
