"""The optimizer step's fast path: without --grad-clip, a step that neither logs nor saves reads no gradient
(no norm pass) and makes one device->host copy; the weights are those of the measured path, bit for bit, and
a non-finite loss is still a skipped step."""

import math

import pytest
import torch
from test_train_units import ONE_BLOCK_PLAN

from dit_accel.run.faults import Faults
from dit_accel.train import step as step_module
from dit_accel.train.config import TrainConfig
from dit_accel.train.step import NON_FINITE, build_components, optimizer_step, train_micro_step
from planner.planfile import parse_plan


def _batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(2, 4, 4, 4, generator=generator),
        "y": torch.tensor([0, 3]),
        "t": torch.tensor([5, 900]),
        "noise": torch.randn(2, 4, 4, 4, generator=generator),
        "drop": torch.tensor([False, True]),
    }


def _components(accelerated: bool, **config):
    config = TrainConfig(plan="p", output_dir="o", latents="l", **config)
    accelerator = None
    if accelerated:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    return build_components(parse_plan(ONE_BLOCK_PLAN), config, accelerator)


@pytest.fixture
def norm_calls(monkeypatch):
    """Every gradient-norm entry point the step could use, counted."""
    from accelerate import Accelerator

    calls = []
    for owner, name in (
        (torch.nn.utils, "clip_grad_norm_"),
        (torch.nn.utils, "get_total_norm"),
        (Accelerator, "clip_grad_norm_"),
    ):
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return calls


@pytest.mark.parametrize("accelerated", [False, True], ids=["bare", "accelerate"])
def test_without_clipping_an_unmeasured_step_computes_no_gradient_norm(norm_calls, accelerated):
    components = _components(accelerated)
    result = optimizer_step(components, train_micro_step(components, _batch()), measure_grad_norm=False)
    assert norm_calls == [] and result.applied and result.grad_norm is None and math.isfinite(result.loss)
    measured = optimizer_step(components, train_micro_step(components, _batch(1)), measure_grad_norm=True)
    assert norm_calls and measured.applied and measured.grad_norm > 0


def test_with_clipping_every_step_clips_measured_or_not(norm_calls):
    components = _components(accelerated=False, grad_clip=1e-3)
    result = optimizer_step(components, train_micro_step(components, _batch()), measure_grad_norm=False)
    assert norm_calls == ["clip_grad_norm_"] and result.grad_norm > 1e-3  # measured before clipping


def test_under_the_skip_policy_every_step_measures_its_gradient(norm_calls):
    """A skipped step must never have been applied: the skip policy checks the gradient on every step."""
    components = _components(accelerated=False, nan_policy="skip")
    result = optimizer_step(components, train_micro_step(components, _batch()), measure_grad_norm=False)
    assert norm_calls == ["clip_grad_norm_"] and result.grad_norm > 0


def test_an_unmeasured_step_gives_the_weights_of_the_measured_one_exactly():
    """The unmeasured step only leaves out clip_grad_norm_(inf), whose multiply by 1.0 changes no bit."""
    runs = []
    for measure in (True, False):
        components = _components(accelerated=True)
        for seed in range(2):
            optimizer_step(components, train_micro_step(components, _batch(seed)), measure_grad_norm=measure)
        runs.append(
            (
                [p.detach().clone() for p in components.raw_model.parameters()],
                [t.clone() for t in components.ema.shadow.values()],
                [t.clone() for s in components.optimizer.state.values() for t in s.values()],
            )
        )
    for measured, unmeasured in zip(*runs):
        assert len(measured) == len(unmeasured) > 0
        assert all(torch.equal(a, b) for a, b in zip(measured, unmeasured))


def test_a_nan_loss_on_an_unmeasured_step_is_still_skipped_and_changes_nothing(norm_calls):
    components = _components(accelerated=True)
    Faults(nan_step=2).install(components.raw_model, start_step=0, grad_accum=1)
    optimizer_step(components, train_micro_step(components, _batch()), measure_grad_norm=False)
    before = [p.detach().clone() for p in components.raw_model.parameters()]
    skipped = optimizer_step(components, train_micro_step(components, _batch()), measure_grad_norm=False)
    assert skipped.skipped == NON_FINITE and not skipped.applied and math.isnan(skipped.loss)
    assert norm_calls == [] and skipped.grad_norm is None
    after = list(components.raw_model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(p.grad is None for p in after)


def test_an_unmeasured_step_reads_the_device_once_and_a_stop_vote_measures_it(monkeypatch, norm_calls):
    """One copy to the host (the vote, the loss, the stop) outside AdamW/EMA; a step that will be
    checkpointed because a rank was asked to stop gets its gradient norm even when the loop did not ask."""
    reads = []
    counting = [True]
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            if counting[0]:
                reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    real_apply = step_module.apply_step

    def apply_step(components):  # AdamW on a CPU reads its step counter: not the step's own reads
        counting[0] = False
        try:
            return real_apply(components)
        finally:
            counting[0] = True

    monkeypatch.setattr(step_module, "apply_step", apply_step)
    components = _components(accelerated=True)
    loss = train_micro_step(components, _batch())
    reads.clear()
    result = optimizer_step(components, loss, measure_grad_norm=False)
    assert reads == ["tolist"] and result.applied and result.grad_norm is None
    loss = train_micro_step(components, _batch(1))
    reads.clear()
    stopping = optimizer_step(components, loss, stop_signum=15, measure_grad_norm=False)
    assert stopping.stop_ranks == 1 and stopping.stop_signum == 15
    assert norm_calls and stopping.grad_norm > 0 and reads == ["tolist", "tolist"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The end-to-end tests' workspace (tests/test_train_e2e.py), made once for this module."""
    from test_train_e2e import make_workspace

    return make_workspace(tmp_path_factory.mktemp("train"))


def test_the_loop_measures_the_gradient_norm_only_where_it_logs_or_saves_it(workspace, tmp_path, monkeypatch):
    import json

    from test_train_e2e import QUIET, run_in_process

    import dit_accel.train.step as step  # train() imports optimizer_step from here when it runs

    measured = []
    real_step = step.optimizer_step

    def optimizer_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        measured.append(result.grad_norm is not None)
        return result

    monkeypatch.setattr(step, "optimizer_step", optimizer_step)
    out = tmp_path / "run"
    argv = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", out, *QUIET]
    argv += ["--no-tensorboard", "--log-every", 3, "--checkpoint-every", 4, "--max-steps", 7]
    assert run_in_process(argv) == 0
    assert measured == [False, False, True, True, False, True, True]  # logs 3, 6, 7; saves 4, 7
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6, 7] and all(line["grad_norm"] > 0 for line in lines)
