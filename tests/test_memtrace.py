"""The tracer: storage accounting, the trainer's step on fake tensors, exact per-block extrapolation, and
`dit-accel verify`. Models are traced on fake tensors, so even DiT-XL/2 allocates nothing here."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dit_accel import memtrace
from dit_accel.memtrace import StorageTracker, driver, extrapolate, trace_training_step
from dit_accel.memtrace import comparison as memtrace_compare
from planner.planfile import Plan, parse_plan
from planner.spec import model_spec


def tiny_plan_json(
    depth=6,
    checkpointed_blocks=0,
    precision="fp32",
    micro_batch=4,
    grad_accum=1,
    ema=True,
    latents="precomputed",
) -> dict:
    """A 64-px DiT (8x8 latents, 16 tokens) of `depth` blocks, hidden 64: the least plan.json the trainer reads."""
    return {
        "schema": "dit-plan/1",
        "inputs": {},
        "model": {
            "name": "DiT-custom",
            "resolution": 64,
            "depth": depth,
            "hidden": 64,
            "heads": 4,
            "patch": 2,
            "num_classes": 10,
        },
        "cluster": {"world_size": 1},
        "global_batch": micro_batch * grad_accum,
        "decision": {
            "micro_batch": micro_batch,
            "grad_accum": grad_accum,
            "checkpointed_blocks": checkpointed_blocks,
            "precision": precision,
            "sharding": "ddp",
            "latents": latents,
            "ema": ema,
        },
    }


def tiny_plan(**changes) -> Plan:
    return parse_plan(tiny_plan_json(**changes))


# --- the tracker ------------------------------------------------------------------------------------


def test_a_storage_is_counted_once_however_many_views_and_released_when_dropped():
    with FakeTensorMode():
        tracker = StorageTracker()
        with tracker:
            a = torch.empty(1000)  # 4000 bytes
            views = [a.view(10, 100), a[:500], a.t() if a.ndim == 2 else a.unsqueeze(0)]
            assert tracker.total_bytes == 4000
            b = torch.empty(250, dtype=torch.float64)  # 2000 bytes
            assert tracker.total_bytes == 6000
            del a, views
            assert tracker.total_bytes == 2000
            del b
        assert tracker.total_bytes == 0
        assert tracker.peak_bytes == 6000
        assert tracker.peak_components["activations"] == 6000


def test_tag_moves_bytes_between_components_without_changing_the_total():
    with FakeTensorMode():
        tracker = StorageTracker()
        t = torch.empty(64)
        tracker.tag(t, "weights")
        tracker.tag(t.view(8, 8), "grads")
        assert (
            tracker.current["weights"] == 0 and tracker.current["grads"] == 256 and tracker.total_bytes == 256
        )


def test_autocast_copies_of_weights_are_their_own_component():
    with FakeTensorMode():
        layer = torch.nn.Linear(32, 16)
        x = torch.randn(8, 32)
        tracker = StorageTracker()
        for p in layer.parameters():
            tracker.tag(p, "weights")
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
            assert tracker.current["autocast_cache"] == 2 * (32 * 16 + 16)  # bf16 weight and bias
            assert y.dtype == torch.bfloat16
        assert tracker.current["weights"] == 4 * (32 * 16 + 16)


def test_roles_pick_first_second_and_last_block_of_each_run_in_processing_order():
    kinds = [True, True, True, False, False]
    assert extrapolate._segments(kinds) == [(0, 3, True), (3, 5, False)]
    fwd = {i: extrapolate._roles(("fwd", 1, 0, i), kinds) for i in range(5)}
    assert [r[-1] for r in fwd[0]] == ["first"] and [r[-1] for r in fwd[1]] == ["second"]
    assert [r[-1] for r in fwd[2]] == ["last"] and [r[-1] for r in fwd[4]] == ["second", "last"]
    bwd = {i: [r[-1] for r in extrapolate._roles(("bwd", 1, 0, i), kinds)] for i in range(5)}
    assert bwd == {0: ["last"], 1: ["second"], 2: ["first"], 3: ["second", "last"], 4: ["first"]}


def test_shallow_trace_counts_grow_by_one_block_of_each_kind_present():
    assert extrapolate.trace_plan_counts((28, 0)) == ((2, 0), [(2, 0), (3, 0)])
    assert extrapolate.trace_plan_counts((14, 14)) == ((2, 2), [(2, 2), (3, 2), (2, 3)])
    assert extrapolate.trace_plan_counts((27, 1)) == ((2, 1), [(2, 1), (3, 1)])
    assert extrapolate.trace_plan_counts((2, 0)) == ((2, 0), [(2, 0)])


# --- the trainer's step -----------------------------------------------------------------------------


CASES = [
    dict(precision="fp32", checkpointed_blocks=0),
    dict(precision="bf16", checkpointed_blocks=3, grad_accum=2),
    dict(precision="fp16", checkpointed_blocks=6, ema=False),
    dict(precision="fp32", checkpointed_blocks=5, grad_accum=3),
    dict(precision="bf16", checkpointed_blocks=2, latents="online"),
]


@pytest.mark.slow  # whole-model traces at several depths
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_per_block_extrapolation_equals_the_full_trace(case):
    plan = tiny_plan(depth=6, **case)
    full = trace_training_step(plan, depth_extrapolate="off", autocast_device="cpu")
    extrapolated = trace_training_step(plan, depth_extrapolate="on", autocast_device="cpu")
    assert full.traced_depths == [6] and max(extrapolated.traced_depths) <= 5
    assert extrapolated.peak_bytes == full.peak_bytes
    assert extrapolated.components == full.components
    assert extrapolated.peak_at == full.peak_at  # e.g. "backward of block 5 (step 2, micro-step 1)"


def test_the_trace_of_dit_xl2_holds_exactly_the_architectures_states():
    """Weights, EMA and AdamW state at the peak follow from the parameter count alone (the traced
    network is the planner's: same parameter count), whatever the extrapolation did."""
    plan = tiny_plan_json()
    plan["model"] = {"name": "DiT-XL/2", "resolution": 256}
    plan["decision"].update(precision="bf16", micro_batch=32)
    plan["global_batch"] = 32
    plan = parse_plan(plan)
    result = trace_training_step(plan, autocast_device="cpu")
    spec = model_spec("DiT-XL/2", 256)
    from dit_accel.models.dit import build_model

    with torch.device("meta"):
        tensors = len(list(build_model(spec, init="torch").parameters()))
    params = spec.params_trainable
    assert result.depth == 28 and max(result.traced_depths) <= 5
    assert result.components["weights"] == 4 * params
    assert result.components["buffers"] == 4 * spec.tokens * spec.hidden
    assert result.components["ema"] == 4 * params
    assert (
        result.components["optimizer"] == 8 * params + 4 * tensors
    )  # exp_avg, exp_avg_sq, fp32 step counters
    # bf16 autocast: the residual stream and most saved tensors are 2 bytes; about 40 bytes per token,
    # hidden unit and block (docs/architecture.md): a loose bracket; the grid holds the planner to exact bytes
    per_unit = result.components["activations"] / (32 * spec.tokens * spec.hidden * spec.depth)
    assert 35 < per_unit < 45


def test_checkpointing_every_block_removes_almost_all_saved_activations():
    stored = trace_training_step(
        tiny_plan(depth=2, checkpointed_blocks=0, micro_batch=64), autocast_device="cpu"
    )
    checkpointed = trace_training_step(
        tiny_plan(depth=2, checkpointed_blocks=2, micro_batch=64), autocast_device="cpu"
    )
    assert checkpointed.peak_bytes < stored.peak_bytes
    assert checkpointed.components["activations"] < stored.components["activations"]


def test_accumulation_keeps_gradients_alive_at_the_start_of_the_next_micro_step():
    one = trace_training_step(tiny_plan(depth=2, micro_batch=64), autocast_device="cpu")
    two = trace_training_step(tiny_plan(depth=2, micro_batch=64, grad_accum=2), autocast_device="cpu")
    assert two.components["grads"] > one.components["grads"]
    assert two.peak_bytes > one.peak_bytes


@pytest.mark.parametrize("micro_batch, point", [(4, "output linear"), (64, "gelu")])
def test_the_planners_moments_of_a_checkpointed_step_equal_the_traced_ones(micro_batch, point):
    """Every block checkpointed under autocast: the moments the planner names, component by component, against
    the trace's window of the same moment (not only at the step's peak, which the grid holds). Inside the last
    block's forward the peak is at the GELU, or, with few tokens (4 x 16 here, hidden 64), at the MLP's output
    linear, whose uncached weight copy is then alive; the cache holds only the patch conv's and the embedder's."""

    from planner.activations import checkpointed_forward_peak, element_bytes
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.memory import step_memory

    plan = tiny_plan(depth=3, checkpointed_blocks=3, precision="bf16", micro_batch=micro_batch)
    spec = plan.spec()
    tracker, _ = driver._trace_once(plan, spec, 3, micro_batch, "cpu")
    decision = Decision(
        micro_batch=micro_batch,
        grad_accum=1,
        checkpointed_blocks=3,
        precision="bf16",
        sharding="ddp",
        latents="precomputed",
        adamw="single",
    )
    planned = step_memory(
        spec, decision, Cluster(1, 1, 2**40), Assumptions().replace(autocast_device="cpu")
    ).phases
    _, in_use = checkpointed_forward_peak(spec, micro_batch, element_bytes("bf16", "cpu"), casts_weights=True)
    assert (in_use > 0) == (point == "output linear")
    windows = {
        "last_block_forward": ("fwd", 1, 0, 2),
        "start_of_backward": ("bwd", 1, 0, 2),
        "end_of_backward": ("bwd", 1, 0, 0),
        "optimizer_step": ("opt", 1),
    }
    for moment, window in windows.items():
        traced = dict(tracker.window_peaks[window][1])
        traced["weights"] += traced.pop("buffers")
        traced.pop("batch")  # the micro-batch itself, which the planner does not count
        for name, value in traced.items():
            # exact but for scalars: AdamW's fp32 step counters (one per tensor), the loss, one bias gradient
            assert abs(planned[moment][name] - value) <= 512, (moment, name, value, planned[moment][name])
    timestep_mlp = spec.embedder_params - (spec.num_classes + 1) * spec.hidden
    assert planned["last_block_forward"]["autocast_cache"] == in_use + 2 * (
        spec.param_breakdown()["patch_embed"] + timestep_mlp
    )


def test_bad_inputs_are_user_errors():
    from dit_accel.errors import UserError

    with pytest.raises(UserError, match="depth-extrapolate"):
        trace_training_step(tiny_plan(), depth_extrapolate="sometimes")
    with pytest.raises(UserError, match="device-autocast"):
        trace_training_step(tiny_plan(), autocast_device="tpu")
    if not torch.backends.cuda.is_built():
        with pytest.raises(UserError, match="CUDA build"):
            trace_training_step(tiny_plan(), autocast_device="cuda")


# --- dit-accel verify -------------------------------------------------------------------------------


def test_verify_prints_the_trace_beside_the_planner_and_what_it_cannot_see(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(tiny_plan_json(checkpointed_blocks=2, precision="bf16")))
    out_json = tmp_path / "verify.json"
    assert memtrace.main([str(plan_path), "--device-autocast", "cpu", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    expected = trace_training_step(
        tiny_plan(checkpointed_blocks=2, precision="bf16"), autocast_device="cpu", replay_at_depth=True
    )
    assert f"traced peak: {expected.peak_bytes / 2**30:.3f} GiB" in out
    for name in memtrace_compare.COMPARED:
        assert name in out
    assert "CUDA context" in out and "NCCL" in out and "autocast" in out
    assert "reserved peak, expandable segments" in out and "reserved peak, fixed segments" in out
    saved = json.loads(out_json.read_text())
    assert saved["trace"]["peak_bytes"] == expected.peak_bytes
    assert set(saved["planner"]["components"]) == set(memtrace_compare.COMPARED)
    # the replayed reserved peaks are the traced step's own, and never below what its tensors held at once
    for mode in ("expandable", "fixed"):
        replayed = saved["reserved"][mode]["replayed_peak_bytes"]
        assert replayed == expected.allocator[mode]["reserved_peak_bytes"] >= expected.peak_bytes


# the README's CPU demo plan: 2 blocks of width 32 at 32 px, two processes
README_CPU_PLAN = (
    "--model DiT-S/2 --depth 2 --hidden 32 --heads 2 --resolution 32 --latents pixel --num-classes 4 "
    "--gpus 2 --vram 8G --global-batch 8"
).split()


def _verify(tmp_path, capsys, plan_flags: list[str]) -> tuple[int, str, dict]:
    from planner.cli import main as dit_plan

    assert dit_plan([*plan_flags, "--out", str(tmp_path / "plan")]) == 0
    capsys.readouterr()
    out_json = tmp_path / "verify.json"
    code = memtrace.main([str(tmp_path / "plan" / "plan.json"), "--json", str(out_json)])
    return code, capsys.readouterr().out, json.loads(out_json.read_text())


def test_verify_holds_tiny_figures_to_an_absolute_floor(tmp_path, capsys):
    """The README's CPU demo: the planner's expandable-segment model adds a 20 MiB page to a 6 MiB step, a
    large share but nothing a plan can turn on: within the 64 MiB floor, exit 0."""
    code, out, saved = _verify(tmp_path, capsys, README_CPU_PLAN)
    assert code == 0 and "(outside tolerance)" not in out and "every figure is within" in out
    assert saved["outside_tolerance"] == []
    expandable = saved["reserved"]["expandable"]
    assert expandable["error"] > memtrace_compare.RESERVED_TOLERANCE["expandable"]  # relatively far off
    assert abs(expandable["planner_peak_bytes"] - expandable["replayed_peak_bytes"]) < 64 * 2**20
    # the row says which floor holds it ("+24.5%" under "held to within 3%" once said nothing)
    row = next(line for line in out.splitlines() if line.startswith("reserved peak, expandable segments"))
    assert row.endswith("(within the 64 MiB floor)"), row


def test_verify_exits_1_when_the_planner_is_outside_tolerance(tmp_path, capsys):
    """A plan made with --assume attention=math sizes a softmax per block that the trainer's fused attention
    never stores: 1,024 tokens make that 2 x 64 MiB the trace does not see, outside tolerance, exit 1."""
    flags = (
        "--model DiT-S/2 --depth 2 --hidden 64 --heads 2 --resolution 64 --latents pixel --num-classes 4 "
        "--gpus 1 --vram 8G --global-batch 8 --precision fp32 --assume attention=math"
    ).split()
    code, out, saved = _verify(tmp_path, capsys, flags)
    assert code == 1
    assert {"activations", "traceable peak"} <= set(saved["outside_tolerance"])
    activations = next(line for line in out.splitlines() if line.startswith("activations"))
    assert activations.endswith("(outside tolerance)") and "(exit 1)" in out
    assert "weights" not in saved["outside_tolerance"]  # the figures the planner gets right stay unmarked


def test_the_tolerance_rule():
    within = memtrace_compare.within_tolerance
    MiB = 2**20
    GiB = 2**30
    assert within(105 * GiB // 10, 10 * GiB, 0.05) and not within(106 * GiB // 10, 10 * GiB, 0.05)
    assert within(70 * MiB, 7 * MiB, 0.03)  # 63 MiB off: within the absolute floor
    assert not within(72 * MiB, 7 * MiB, 0.03)
    assert within(5 * MiB + 60 * MiB, 5 * MiB, 0.05, floor_bytes=10 * 2**30)  # a small share of a big peak


def test_verify_refuses_a_missing_or_foreign_plan_in_one_line(tmp_path, capsys):
    assert memtrace.main([str(tmp_path / "missing.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something-else/9"}))
    assert memtrace.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "schema" in err


def test_the_traced_step_is_the_trainers_own(monkeypatch):
    """verify must run the trainer's step functions, not a copy: count the calls it makes into them."""
    from dit_accel.train import step as train

    calls = {"build_components": 0, "train_micro_step": 0, "check_step": 0, "apply_step": 0}
    for name in calls:
        original = getattr(train, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(train, name, counted)
    trace_training_step(tiny_plan(depth=2, grad_accum=4), depth_extrapolate="off", autocast_device="cpu")
    # two optimizer steps: the first with one micro-step (it leaves the cache later steps find), the last with two
    assert calls == {"build_components": 1, "train_micro_step": 3, "check_step": 2, "apply_step": 2}


def test_only_the_steps_decision_reads_a_value_so_fake_tensors_run_the_trainer_as_it_is():
    """On value-less fake tensors the trainer builds its model on the device and runs check_step and
    apply_step unpatched, in the plan's fp16 asked for directly; only optimizer_step's decision between the
    two needs a value, and there a fake tensor refuses."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from dit_accel.train import step as train
    from dit_accel.train.config import TrainConfig

    plan = tiny_plan(depth=1, precision="fp16")
    config = TrainConfig(plan="p", output_dir="o", latents="l")
    with FakeTensorMode():
        assert train.build_components(plan, config).autocast_dtype is None  # a CPU run of fp16 trains fp32
        components = train.build_components(plan, config, precision="fp16")
        assert components.autocast_dtype == torch.float16
        batch = driver.fake_batch(components.spec, 2, components.device, online=False)
        for _ in range(2):
            check = train.check_step(components, train.train_micro_step(components, batch))
            assert check.stats.shape == (4,)  # loss, non-finite ranks, stopping ranks, signals
            assert train.apply_step(components)
        assert all(param.grad is None for param in components.model.parameters())
        assert all(state["exp_avg"].dtype == torch.float32 for state in components.optimizer.state.values())
        with pytest.raises(DataDependentOutputException):
            train.optimizer_step(components, train.train_micro_step(components, batch))


def test_verify_traces_the_vae_architecture_of_a_given_folder(tmp_path, capsys):
    """--vae reads only config.json: a tiny AutoencoderKL saved here is what the trace's vae holds."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
    )  # downsamples by 8, like the SD VAE: 64 px -> 8x8 latents
    vae.save_pretrained(tmp_path / "vae")
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(tiny_plan_json(depth=2, latents="online")))
    plan = tiny_plan(depth=2, latents="online")
    out_json = tmp_path / "v.json"
    assert (
        memtrace.main(
            [
                str(plan_path),
                "--device-autocast",
                "cpu",
                "--vae",
                str(tmp_path / "vae"),
                "--json",
                str(out_json),
            ]
        )
        == 1  # the plan sized the SD VAE, not this one: its vae figure is outside tolerance
    )
    assert "vae" in json.loads(out_json.read_text())["outside_tolerance"]
    weights = 4 * sum(p.numel() for p in vae.parameters())
    traced = json.loads(out_json.read_text())["trace"]
    assert (
        traced["components"]["vae"] >= weights
    )  # its weights, and its encoder's working set if that is the peak
    sd = trace_training_step(plan, autocast_device="cpu", depth_extrapolate="off")
    assert sd.components["vae"] > traced["components"]["vae"]  # the default SD VAE is far larger
    assert memtrace.main([str(plan_path), "--vae", str(tmp_path / "nothing")]) == 2
    assert "config.json" in capsys.readouterr().err


# --- sharded plans: one rank's pure low-precision compute ---------------------------------------------------


def sharded_plan_json(sharding, checkpointed_blocks, world_size=4, precision="bf16", grad_accum=1, depth=4):
    plan = tiny_plan_json(
        depth=depth,
        checkpointed_blocks=checkpointed_blocks,
        precision=precision,
        micro_batch=8,
        grad_accum=grad_accum,
    )
    plan["decision"]["sharding"] = sharding
    plan["cluster"]["world_size"] = world_size
    plan["global_batch"] *= world_size
    return plan


def sharded_plan(*args, **kwargs) -> Plan:
    return parse_plan(sharded_plan_json(*args, **kwargs))


SHARDED_CASES = [
    dict(sharding="zero2", checkpointed_blocks=0),
    dict(sharding="zero3", checkpointed_blocks=2, grad_accum=2),
    dict(sharding="zero2", checkpointed_blocks=4, world_size=2),
    dict(sharding="zero3", checkpointed_blocks=4),
    dict(sharding="zero3", checkpointed_blocks=1, precision="fp16", world_size=8),
]


@pytest.mark.parametrize("case", SHARDED_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_a_sharded_ranks_traced_activations_are_the_planners(case, capsys):
    """One rank of a sharded plan: the traced part (activations, in pure bf16/fp16 with no autocast) within 5% of
    the planner's sharded estimate at the same moment; the derived part exactly 1/world_size of the traced
    parameters; the rest printed with how each figure is known."""
    plan = sharded_plan(**case)
    world_size = plan.world_size
    result = trace_training_step(plan, autocast_device="cpu")
    comparison = memtrace.compare_sharded(result, plan)
    assert (result.sharding, result.world_size) == (case["sharding"], world_size)
    assert result.peak_moment == comparison.planned_compute_phase  # compared at the moment the trace peaked
    assert abs(comparison.component_error("activations")) < 0.05
    rows = {row[0]: row for row in comparison.rows}
    assert rows["autocast_cache"][1] == 0 and result.components["optimizer"] == result.components["ema"] == 0
    spec = plan.spec()
    params = spec.params_trainable
    assert result.components["weights"] == 2 * params  # every parameter traced in the compute dtype
    assert rows["optimizer"][1] == 8 * params // world_size and rows["ema"][1] == 4 * params // world_size
    assert rows["weights"][1] == rows["weights"][2]  # master shard + buffer + gathered, as the planner counts
    if (
        comparison.planned_compute_phase in ("end_of_backward", "optimizer_step")
        or case.get("grad_accum", 1) > 1
    ):
        assert rows["grads"][1] > 0 and abs(rows["grads"][3]) < 0.05  # the emulated 1/N fp32 shards
    report = memtrace.format_sharded_report(result, comparison)
    print(report)
    assert "traced: pure" in report and "derived: 1/" in report and "FSDP2's all-gather" in report
    assert ("modelled" in rows["weights"][4]) == (
        case["sharding"] == "zero3"
    )  # zero3's gathers: the planner's rule
    assert "CPU-vs-CUDA" not in report  # no autocast, so no CPU/CUDA difference in what is saved


def test_the_sharded_trace_is_pure_low_precision_not_autocast():
    """The same network and batch: the DDP trace autocasts (weight copies in its cache, fp32 conditioning); the
    sharded rank's holds no cache and saves less, and its parameters are bf16."""
    ddp = trace_training_step(
        tiny_plan(depth=2, precision="bf16", micro_batch=8), autocast_device="cpu", depth_extrapolate="off"
    )
    sharded = trace_training_step(
        sharded_plan("zero2", 0, depth=2), autocast_device="cpu", depth_extrapolate="off"
    )
    assert ddp.components["autocast_cache"] > 0 and sharded.components["autocast_cache"] == 0
    assert sharded.components["activations"] < ddp.components["activations"]
    assert ddp.components["weights"] == 2 * sharded.components["weights"]  # fp32 there, bf16 here
    assert "sharding" not in ddp.to_json() and sharded.to_json()["sharding"] == "zero2"


@pytest.mark.slow  # whole-model traces at several depths
@pytest.mark.parametrize("case", [dict(sharding="zero2", checkpointed_blocks=3, depth=6)])
def test_sharded_extrapolation_equals_the_full_trace(case):
    plan = sharded_plan(**case)
    full = trace_training_step(plan, depth_extrapolate="off", autocast_device="cpu")
    extrapolated = trace_training_step(plan, depth_extrapolate="on", autocast_device="cpu")
    assert (
        extrapolated.peak_bytes,
        extrapolated.components,
        extrapolated.peak_at,
        extrapolated.peak_moment,
    ) == (full.peak_bytes, full.components, full.peak_at, full.peak_moment)


def test_verify_of_a_sharded_plan_names_what_is_traced_derived_and_modelled(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(sharded_plan_json("zero3", 2)))
    out_json = tmp_path / "verify.json"
    assert memtrace.main([str(plan_path), "--device-autocast", "cpu", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "one rank" in out and "zero3, FSDP2, world size 4" in out and "no autocast" in out
    assert "unsharded process" not in out  # the old note: traced as if unsharded with autocast
    saved = json.loads(out_json.read_text())
    assert saved["trace"]["sharding"] == "zero3" and saved["rank"]["activations"]["how"].startswith("traced")
    assert (
        saved["rank"]["weights"]["how"].startswith("derived")
        and "modelled" in saved["rank"]["weights"]["how"]
    )
    assert saved["rank"]["optimizer"]["bytes"] == saved["planner"]["components"]["optimizer"]
