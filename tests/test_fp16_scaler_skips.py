"""fp16's loss-scale skips are routine, not NaN stops: a real torch.amp.GradScaler("cpu") in accelerate.

Accelerate 1.15 refuses fp16 on a CPU (`Accelerator(mixed_precision="fp16")` needs a GPU-family device), so
the seam is the Accelerator's `scaler`, set before `prepare` exactly as accelerate sets it for fp16 on a GPU:
from then on accelerate's own code scales the loss, unscales before clipping and lets the scaler skip an
overflowing step (`optimizer_step_was_skipped`). The gradients are float32 here, so the seam gives them fp16's
range: after each backward a scaled gradient beyond fp16's largest finite value becomes inf, as it would in
fp16. An initial scale of 2**126 overflows that range for the first steps; the scaler lowers it per skip
until the steps fit, as on a GPU. (The overflow must be in the gradients themselves: accelerate 1.16 leaves
gradients alone when asked for their norm only, where 1.15 multiplied them by inf/inf.)
"""

import pytest
import torch
from test_train_e2e import QUIET, make_workspace, run_in_process

from dit_accel.run import checkpoint as ckpt
from dit_accel.train.step import NON_FINITE, SCALER_OVERFLOW

HUGE_SCALE = 2.0**126
FP16_MAX = torch.finfo(torch.float16).max


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The end-to-end tests' workspace (tests/test_train_e2e.py), made once for this module."""
    return make_workspace(tmp_path_factory.mktemp("train"))


def _with_cpu_grad_scaler(monkeypatch):
    import dit_accel.distributed.accelerator as distributed  # train() imports make_accelerator from here when it runs

    real = distributed.make_accelerator

    def make_accelerator(*args, **kwargs):
        accelerator = real(*args, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=HUGE_SCALE, backoff_factor=2.0**-40)
        backward = accelerator.backward

        def backward_in_fp16_range(loss, **kwargs):
            backward(loss, **kwargs)
            for optimizer in accelerator._optimizers:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.masked_fill_(p.grad.abs() > FP16_MAX, float("inf"))

        accelerator.backward = backward_in_fp16_range
        return accelerator

    monkeypatch.setattr(distributed, "make_accelerator", make_accelerator)


def test_scaler_skips_are_logged_and_do_not_stop_the_run(workspace, tmp_path, monkeypatch):
    _with_cpu_grad_scaler(monkeypatch)
    results = []
    import dit_accel.train.step as step  # train() imports optimizer_step from here when it runs

    real_step = step.optimizer_step

    def optimizer_step(*args, **kwargs):
        results.append(real_step(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(step, "optimizer_step", optimizer_step)
    out = tmp_path / "fp16"
    argv = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", out, *QUIET]
    code = run_in_process([*argv, "--no-tensorboard", "--max-steps", 6, "--checkpoint-every", 6])
    assert code == 0  # under the default --nan-policy abort
    skipped = [r.skipped for r in results]
    assert skipped[0] == SCALER_OVERFLOW and NON_FINITE not in skipped, skipped
    assert skipped[-1] is None  # the scale came down far enough to apply steps again
    state = ckpt.read_train_state(out / "checkpoints" / "step_00000006")
    assert state["skipped_steps"] == 0 and state["applied_steps"] == skipped.count(None) < 6
    log_text = (out / "logs" / "rank0.log").read_text()
    assert "fp16 gradients overflowed; the loss scaler skipped the step" in log_text
    assert "non-finite" not in log_text


def test_a_nan_loss_under_the_scaler_is_still_a_nan_stop(workspace, tmp_path, monkeypatch, capsys):
    """The scaler owns overflowing gradients; a non-finite loss is the run's own, and aborts (exit 3)."""
    _with_cpu_grad_scaler(monkeypatch)
    out = tmp_path / "nan"
    argv = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", out, *QUIET]
    code = run_in_process([*argv, "--no-tensorboard", "--max-steps", 3], env={"DIT_ACCEL_INJECT_NAN": "1"})
    assert code == 3
    assert "non-finite loss or gradient at step 1" in capsys.readouterr().err
