"""The trainer's pure parts, in-process and fast: data order, per-sample randomness, config, lr, EMA."""

import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from dit_accel.data.order import KeyedSamples, SampleNoise, SampleOrder, seeded_global_rngs
from dit_accel.errors import UserError
from dit_accel.train.config import TrainConfig
from dit_accel.train.ema import EMA
from dit_accel.train.flags import parse_config
from dit_accel.train.optim import build_optimizer, build_scheduler, create_states, effective_lr

ONE_BLOCK_PLAN = {  # a 1-block fp32 DDP plan on one process, for step-level tests
    "schema": "dit-plan/1",
    "inputs": {},
    "cluster": {"world_size": 1},
    "global_batch": 2,
    "model": {
        "name": "DiT-custom",
        "resolution": 32,
        "latent_size": 4,
        "in_channels": 4,
        "depth": 1,
        "hidden": 32,
        "heads": 2,
        "patch": 2,
        "num_classes": 4,
    },
    "decision": {
        "micro_batch": 2,
        "grad_accum": 1,
        "checkpointed_blocks": 0,
        "precision": "fp32",
        "sharding": "ddp",
        "latents": "precomputed",
        "ema": True,
    },
}


def _step_items(order: SampleOrder, step: int) -> list[tuple[int, int]]:
    """Every (dataset index, sample number) of one optimizer step, over all ranks and micro-steps."""
    items = []
    for rank in range(order.world_size):
        for micro_step in range(order.grad_accum):
            items += order.micro_batch_items(step, micro_step, rank)
    return items


def test_layouts_with_the_same_global_batch_read_the_same_samples():
    wide = SampleOrder(dataset_size=37, global_batch=8, micro_batch=2, grad_accum=2, world_size=2, seed=5)
    flat = SampleOrder(dataset_size=37, global_batch=8, micro_batch=8, grad_accum=1, world_size=1, seed=5)
    for step in range(9):  # across epoch boundaries (4 steps per epoch)
        assert sorted(_step_items(wide, step)) == sorted(_step_items(flat, step))
        numbers = [number for _, number in _step_items(wide, step)]
        assert sorted(numbers) == list(range(step * 8, step * 8 + 8))


def test_epochs_drop_the_partial_window_and_reshuffle():
    order = SampleOrder(dataset_size=37, global_batch=8, micro_batch=4, grad_accum=1, world_size=2, seed=0)
    assert order.steps_per_epoch == 4  # 32 of 37 samples; the last 5 are not padded into a short step
    epoch0 = [index for step in range(4) for index, _ in _step_items(order, step)]
    epoch1 = [index for step in range(4, 8) for index, _ in _step_items(order, step)]
    assert len(set(epoch0)) == 32 and len(set(epoch1)) == 32  # no repeats within an epoch
    assert epoch0 != epoch1
    assert order.epoch_and_offset(6) == (1, 16)


def test_batches_resume_where_they_stopped():
    order = SampleOrder(dataset_size=50, global_batch=12, micro_batch=3, grad_accum=2, world_size=2, seed=1)
    straight = order.batches(0, rank=1)
    expected = [next(straight) for _ in range(20)]
    resumed = order.batches(4, rank=1)  # 4 steps x 2 micro-steps already consumed
    assert [next(resumed) for _ in range(12)] == expected[8:]


def test_too_small_dataset_is_refused():
    with pytest.raises(UserError, match="fewer than one global batch"):
        SampleOrder(dataset_size=5, global_batch=8, micro_batch=8, grad_accum=1, world_size=1, seed=0)


def test_sample_randomness_depends_only_on_the_sample_number():
    noise = SampleNoise(
        seed=3, num_timesteps=1000, noise_shape=(4, 2, 2), class_dropout=0.5, posterior_shape=(4, 2, 2)
    )
    together = noise([10, 11, 12, 13])
    apart = [noise([n]) for n in (12, 10, 13, 11)]
    for position, number in enumerate([10, 11, 12, 13]):
        single = apart[[12, 10, 13, 11].index(number)]
        for key in ("t", "noise", "drop", "posterior_noise"):
            assert torch.equal(together[key][position], single[key][0])
    assert not torch.equal(together["noise"][0], together["noise"][1])
    other_seed = SampleNoise(seed=4, num_timesteps=1000, noise_shape=(4, 2, 2), class_dropout=0.5)([10])
    assert not torch.equal(other_seed["noise"][0], together["noise"][0])
    many = SampleNoise(seed=0, num_timesteps=1000, noise_shape=(1,), class_dropout=0.1)(list(range(2000)))
    assert 0.07 < many["drop"].float().mean() < 0.13
    assert many["t"].min() >= 0 and many["t"].max() <= 999


class _Augmenting(torch.utils.data.Dataset):
    """A dataset whose item uses all three global RNGs, like an unseeded random flip."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([random.random(), np.random.rand(), torch.rand(()).item()]), index


def test_keyed_samples_make_augmentation_a_function_of_the_sample():
    data = KeyedSamples(_Augmenting(), seed=9)
    torch.manual_seed(0)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    first = data[(2, 77)][0][0]
    torch.manual_seed(999)  # whatever the global state, the sample draws the same
    assert torch.equal(data[(2, 77)][0][0], first)
    assert not torch.equal(data[(2, 78)][0][0], first)
    torch.manual_seed(0)
    data[(2, 77)]
    assert torch.equal(torch.get_rng_state(), before[2])  # the caller's RNG state is left as it was


def test_seeded_global_rngs_restores_the_states():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(()))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with seeded_global_rngs(42):
        random.random(), np.random.rand(), torch.rand(())
    assert (random.random(), np.random.rand(), torch.rand(())) == expected


def test_config_flags_and_one_line_errors():
    config = parse_config(
        [
            "--plan",
            "p.json",
            "--data_path",
            "imgs",
            "--output-dir",
            "runs/a",
            "--max-steps",
            "7",
            "--betas",
            "0.8",
            "0.9",
            "--grad-clip",
            "1.5",
            "--no-tensorboard",
            "--scale-lr",
        ]
    )
    assert (config.data_path, config.max_steps, config.betas, config.grad_clip) == (
        "imgs",
        7,
        (0.8, 0.9),
        1.5,
    )
    assert config.tensorboard is False and config.scale_lr is True
    defaults = TrainConfig()
    assert (
        defaults.lr,
        defaults.betas,
        defaults.weight_decay,
        defaults.ema_decay,
        defaults.class_dropout,
        defaults.nan_policy,
    ) == (1e-4, (0.9, 0.999), 0.0, 0.9999, 0.1, "abort")
    assert TrainConfig.from_json(config.to_json()) == config
    for argv, message in [
        (["--plan", "p", "--output-dir", "o"], "exactly one of --data-path"),
        (
            ["--plan", "p", "--output-dir", "o", "--latents", "l", "--data-path", "d"],
            "exactly one of --data-path",
        ),
        (["--output-dir", "o", "--latents", "l"], "--plan is required"),
        (["--plan", "p", "--output-dir", "o", "--latents", "l", "--nan-policy", "retry"], "abort, skip"),
        (["--plan", "p", "--output-dir", "o", "--latents", "l", "--max-steps", "x"], "invalid int"),
        (["--plan", "p", "--output-dir", "o", "--latents", "l", "--bogus"], "unrecognized"),
    ]:
        with pytest.raises(UserError, match=message) as error:
            parse_config(argv)
        assert "\n" not in str(error.value)


def test_lr_warmup_and_scaling_count_applied_steps():
    model = nn.Linear(2, 2)
    assert effective_lr(1e-4, 512, scale_lr=True) == pytest.approx(2e-4)
    assert effective_lr(1e-4, 512, scale_lr=False) == 1e-4
    optimizer = build_optimizer(model, lr=1e-3)
    assert optimizer.defaults["fused"] in (None, False)  # fused only on CUDA
    scheduler = build_scheduler(optimizer, warmup_steps=4)
    seen = []
    for _ in range(6):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    restored = build_scheduler(build_optimizer(model, lr=1e-3), warmup_steps=4)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize(
    "kind", [{}, {"foreach": True}, {"fused": True}, {"foreach": False, "amsgrad": True}]
)
def test_adamw_state_made_before_the_first_step_trains_bit_for_bit_as_a_lazy_one(kind):
    """A fresh run makes AdamW's state up front (a resumed run's memory layout); every step after it equals
    the lazily initialised optimizer's exactly, weight decay and bias correction included."""
    torch.manual_seed(0)
    lazy = [nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(5))]
    eager = [nn.Parameter(p.detach().clone()) for p in lazy]
    settings = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, **kind)
    lazy_opt, eager_opt = torch.optim.AdamW(lazy, **settings), torch.optim.AdamW(eager, **settings)
    create_states(eager_opt)
    assert set(eager_opt.state) == set(eager)
    for param in eager:
        state = eager_opt.state[param]
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert ("max_exp_avg_sq" in state) == bool(kind.get("amsgrad"))
    for _ in range(5):
        for a, b in zip(lazy, eager):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        lazy_opt.step()
        eager_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(lazy, eager))
    for a, b in zip(lazy, eager):
        for key, value in lazy_opt.state[a].items():
            made = eager_opt.state[b][key]
            assert made.dtype == value.dtype and made.device == value.device and torch.equal(made, value)


def test_adamw_state_already_there_is_left_alone():
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.step()
    before = {key: value.clone() for key, value in optimizer.state[param].items()}
    create_states(optimizer)  # a resumed run's loaded state is never reset
    assert all(torch.equal(optimizer.state[param][key], value) for key, value in before.items())


def test_ema_is_fp32_and_follows_the_decay():
    model = nn.Linear(3, 1).to(torch.bfloat16)
    ema = EMA(model, decay=0.75)
    start = {k: v.clone() for k, v in ema.shadow.items()}
    assert all(v.dtype == torch.float32 for v in ema.shadow.values())
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    expected = 0.75 * start["weight"] + 0.25 * model.weight.float()
    assert torch.allclose(ema.shadow["weight"], expected, atol=1e-7)
    target = nn.Linear(3, 1)
    ema.copy_to(target)
    assert torch.equal(target.weight, ema.shadow["weight"])


def test_ema_warmup_copies_first_then_ramps_to_the_decay_as_diffusers_does():
    model = nn.Linear(3, 1)
    ema = EMA(model, decay=0.9, warmup=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert ema.current_decay() == 0.0
    ema.update(model)
    assert torch.equal(ema.shadow["weight"], model.weight)  # the first update copies the weights
    decays = []
    for _ in range(40):
        decays.append(ema.current_decay())
        ema.update(model)
    ramp = [min(0.9, 1 - (1 + n) ** (-2 / 3)) for n in range(1, 41)]
    assert decays == pytest.approx(ramp) and decays[0] < decays[5] < decays[-1] == 0.9  # capped
    assert ema.updates == 41
    assert EMA(model, decay=0.9).current_decay() == 0.9  # without warm-up: the recipe's constant


def test_sample_warns_when_the_ema_is_still_mostly_its_initial_weights(tmp_path, capsys):
    from dit_accel.sample.generate import warn_if_ema_is_mostly_initial

    (tmp_path / "train_state.json").write_text(json.dumps({"step": 325, "applied_steps": 325}))
    share = warn_if_ema_is_mostly_initial(tmp_path, {"ema_decay": 0.9999})
    assert share == pytest.approx(0.9999**325) and share > 0.96
    err = capsys.readouterr().err
    assert "still 97% their initial weights" in err and "--no-ema" in err and len(err.splitlines()) == 1
    assert warn_if_ema_is_mostly_initial(tmp_path, {"ema_decay": 0.9}) < 0.1  # 0.9^325: trained
    assert warn_if_ema_is_mostly_initial(tmp_path, {"ema_decay": 0.9999, "ema_warmup": True}) == 0.0
    assert capsys.readouterr().err == ""
    assert warn_if_ema_is_mostly_initial(tmp_path / "nowhere", {}) is None  # no train_state: says nothing


@pytest.mark.parametrize(
    "state",
    [
        {"step": 0, "imported_from": "DiT-XL-2-256x256.pt"},  # import-dit / import-sit commit this
        {"step": 325, "applied_steps": 325, "init_from": "runs/base/checkpoints/step_0400000"},  # --init-from
    ],
)
def test_sample_says_nothing_of_initial_weights_when_the_ema_started_from_trained_ones(
    tmp_path, capsys, state
):
    """An imported checkpoint's EMA is the published EMA, and an --init-from run's EMA started from trained
    weights: few updates there do not mean an untrained network."""
    from dit_accel.sample.generate import warn_if_ema_is_mostly_initial

    (tmp_path / "train_state.json").write_text(json.dumps(state))
    assert warn_if_ema_is_mostly_initial(tmp_path, {"ema_decay": 0.9999}) is None
    assert capsys.readouterr().err == ""


def test_dit_accel_train_launches_with_the_plans_config(tmp_path, capsys):
    from dit_accel.train.launch import launch_command, main

    plan = tmp_path / "plan" / "plan.json"
    plan.parent.mkdir()
    plan.write_text("{}")
    with pytest.raises(UserError, match="accelerate_config.yaml not found"):
        launch_command(["--plan", str(plan), "--latents", "c"])
    (plan.parent / "accelerate_config.yaml").write_text("num_processes: 2\n")
    command = launch_command(
        [
            "--plan",
            str(plan),
            "--latents",
            "c",
            "--num-processes",
            "2",
            "--machine-rank",
            "1",
            "--output-dir",
            "runs/a",
            "--max-steps",
            "5",
        ]
    )
    launcher, trainer = command[: command.index("-m", 3)], command[command.index("-m", 3) :]
    assert launcher[1:] == [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(plan.parent / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        "--machine_rank",
        "1",
    ]
    assert trainer == [
        "-m",
        "dit_accel.train",
        "--plan",
        str(plan),
        "--latents",
        "c",
        "--output-dir",
        "runs/a",
        "--max-steps",
        "5",
    ]
    assert main(["--plan", str(plan), "--latents", "c", "--print-command"]) == 0
    assert capsys.readouterr().out.startswith("accelerate launch --config_file ")
    assert main(["--latents", "c"]) == 2


def test_loader_workers_default_is_capped_by_the_nodes_cpus_and_an_explicit_count_is_obeyed():
    from dit_accel.train.data import loader_workers

    assert (
        parse_config(["--plan", "p", "--output-dir", "o", "--latents", "l"]).num_workers is None
    )  # not given
    assert (
        parse_config(["--plan", "p", "--output-dir", "o", "--latents", "l", "--num-workers", "4"]).num_workers
        == 4
    )
    assert loader_workers(None, ranks_per_node=8, cpus=96) == 4  # plenty: the default
    assert loader_workers(None, ranks_per_node=1, cpus=2) == 1  # one CPU for the rank, one for a worker
    assert loader_workers(None, ranks_per_node=8, cpus=16) == 1
    assert loader_workers(None, ranks_per_node=2, cpus=2) == 0  # load in the rank's own process
    assert loader_workers(None, ranks_per_node=8, cpus=4) == 0
    assert loader_workers(6, ranks_per_node=2, cpus=2) == 6  # asked for: obeyed
    assert loader_workers(0, ranks_per_node=1, cpus=64) == 0


def test_optimizer_step_applies_a_finite_step_and_leaves_everything_as_it_was_on_a_non_finite_one():
    """check_step + the all-finite decision + apply_step: a skipped step moves no weight, AdamW moment, EMA
    or lr-schedule position, and both paths end with the gradients cleared."""
    from dit_accel.run.faults import Faults
    from dit_accel.train.step import build_components, optimizer_step, train_micro_step
    from planner.planfile import parse_plan

    plan = parse_plan(ONE_BLOCK_PLAN)
    components = build_components(plan, TrainConfig(plan="p", output_dir="o", latents="l", warmup_steps=3))
    Faults(nan_step=2).install(components.raw_model, start_step=0, grad_accum=1)  # step 2's output is NaN
    generator = torch.Generator().manual_seed(0)
    batch = {
        "x": torch.randn(2, 4, 4, 4, generator=generator),
        "y": torch.tensor([0, 3]),
        "t": torch.tensor([5, 900]),
        "noise": torch.randn(2, 4, 4, 4, generator=generator),
        "drop": torch.tensor([False, True]),
    }

    def snapshot():
        return (
            [p.detach().clone() for p in components.model.parameters()],
            [t.clone() for t in components.ema.shadow.values()],
            [t.clone() for s in components.optimizer.state.values() for t in s.values()],
            components.scheduler.last_epoch,
        )

    result = optimizer_step(components, train_micro_step(components, batch))
    assert (
        result.applied
        and math.isfinite(result.loss)
        and result.grad_norm > 0
        and result.lr == pytest.approx(1e-4 / 3)
    )
    before = snapshot()
    skipped = optimizer_step(components, train_micro_step(components, batch))
    assert not skipped.applied and math.isnan(skipped.loss)
    after = snapshot()
    assert after[3] == before[3] == 1
    for old, new in zip(before[:3], after[:3]):
        assert len(old) == len(new) > 0 and all(torch.equal(a, b) for a, b in zip(old, new))
    assert all(p.grad is None for p in components.model.parameters())


def test_cuda_runs_use_expandable_segments_unless_the_user_chose_an_allocator_config():
    from dit_accel.distributed.accelerator import ALLOCATOR_ENV, EXPANDABLE_SEGMENTS, use_expandable_segments

    env = {}
    assert use_expandable_segments(env) is True and env == {ALLOCATOR_ENV: EXPANDABLE_SEGMENTS}
    mine = {ALLOCATOR_ENV: "max_split_size_mb:512"}
    assert use_expandable_segments(mine) is False and mine == {ALLOCATOR_ENV: "max_split_size_mb:512"}
    empty = {ALLOCATOR_ENV: ""}  # set but empty: nothing chosen
    assert use_expandable_segments(empty) is True and empty[ALLOCATOR_ENV] == EXPANDABLE_SEGMENTS


def test_the_measured_peaks_are_held_to_the_plans_tensors_with_cublas_workspaces_and_its_reserved_peak():
    """max_memory_allocated counts cuBLAS's workspaces, which the plan puts in its allocator share: an exact
    plan must not warn for them; a byte over either figure does."""
    from dit_accel.train.steplog import memory_over_plan
    from planner.hardware import Assumptions
    from planner.plan import make_plan
    from planner.planfile import parse_plan

    plan = parse_plan(make_plan(gpus=1, vram="80G", global_batch=32))
    tensors, reserved = plan.memory.tensor_bytes, plan.memory.reserved_peak_bytes
    workspaces = Assumptions().cublas_workspace_bytes
    assert memory_over_plan(plan, tensors + workspaces, reserved) is None
    assert "allocated exceeds" in memory_over_plan(plan, tensors + workspaces + 1, reserved)
    assert "reserved exceeds" in memory_over_plan(plan, tensors, reserved + 1)


def test_a_fresh_run_has_adamw_state_before_its_first_step(caplog):
    """dit_accel.train.resume.restore, the trainer's start: a fresh run makes AdamW's state (zero moments, step 0)
    before any step, where a resumed run loads it, so both run in the same memory layout; a plan made for a
    lazily made state (another codebase's order) is told so."""
    from types import SimpleNamespace

    from dit_accel.train.resume import Start, restore

    model = nn.Linear(4, 3)
    plan = SimpleNamespace(assumptions={"adamw_state": "lazy"})
    components = SimpleNamespace(optimizer=build_optimizer(model, lr=1e-4), plan=plan, fp8=None)
    with caplog.at_level("INFO", logger="dit_accel.train"):
        state = restore(Start(), SimpleNamespace(process_index=0), components, data={"entries": 8}, seed=0)
    assert "adamw_state=lazy" in caplog.text and "makes it before the first step" in caplog.text
    assert state["step"] == 0
    made = components.optimizer.state
    assert set(made) == set(model.parameters())
    assert all(
        float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in made.values()
    )


@pytest.mark.parametrize(
    ("precision", "requested", "on"),
    [("tf32", True, True), ("tf32", False, False), ("fp32", True, False), ("bf16", True, True)],
)
def test_tf32_is_on_as_the_plan_was_rated_and_as_asked(precision, requested, on):
    """An IEEE fp32 plan (dit-plan --precision fp32) was estimated with TF32 off: the trainer and calibrate
    train it so, without --no-tf32; --no-tf32 turns it off on any plan."""
    from dit_accel.distributed.accelerator import planned_tf32
    from planner.plan import make_plan
    from planner.planfile import parse_plan

    plan = parse_plan(make_plan(gpus=1, vram="80G", global_batch=32, precision=precision))
    assert plan.matmul == {"tf32": "tf32", "fp32": "ieee-fp32", "bf16": "bf16"}[precision]
    assert planned_tf32(requested, plan) is on


def test_the_log_line_carries_the_measured_peaks_and_the_data_wait_of_a_gpu_run(tmp_path, monkeypatch):
    """The GPU branch of the log line, on a CPU: the peaks torch.cuda reports (here faked) go to metrics.jsonl
    beside the plan's, with the window's share of time spent waiting for batches."""
    import time
    from types import SimpleNamespace

    import dit_accel.train.steplog as runlog
    from planner.plan import make_plan
    from planner.planfile import parse_plan

    plan = parse_plan(make_plan(gpus=1, vram="80G", global_batch=32))
    monkeypatch.setattr(runlog, "measured_peak_bytes", lambda device: (5 * 2**30, 6 * 2**30))
    accelerator = SimpleNamespace(is_main_process=True, log_with=[], num_processes=1)
    steplog = runlog.StepLog(tmp_path, plan, accelerator, torch.device("cpu"), max_steps=1)
    with steplog.waiting_for_data():
        time.sleep(0.05)
    result = SimpleNamespace(applied=True, loss=0.5, lr=1e-4, grad_norm=1.0)
    steplog.record(result)
    steplog.write(1, result, skipped_steps=0)
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (line["peak_allocated_bytes"], line["peak_reserved_bytes"]) == (5 * 2**30, 6 * 2**30)
    assert 0 < line["data_wait_fraction"] <= 1
