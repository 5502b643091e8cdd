"""The flow-matching objective and its samplers, held to closed forms: Gaussian data N(mu, s^2) per dimension,
whose velocity field E[v | x_t], score and marginals are known exactly (computed here in float64)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from dit_accel.data.order import SampleNoise
from dit_accel.diffusion.flow import FlowMatching, build_objective, draw_time, objective_from_description
from dit_accel.errors import UserError

MU, S = 0.7, 0.4  # the data distribution of every closed-form test: N(MU, S^2) in every dimension


def coefficients(path: str, t):
    """(alpha, sigma, alpha', sigma') by hand, for a float or a float64 tensor of times."""
    if path == "linear":
        return 1 - t, t, -1.0 + 0 * t, 1.0 + 0 * t
    h, cos, sin = (
        math.pi / 2,
        (torch.cos if torch.is_tensor(t) else math.cos),
        (torch.sin if torch.is_tensor(t) else math.sin),
    )
    return cos(h * t), sin(h * t), -h * sin(h * t), h * cos(h * t)


def exact_velocity(path: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """E[v | x_t = x] for Gaussian data: joint Gaussian regression of v = a' x0 + s' e on x_t = a x0 + s e."""
    a, s, da, ds = (c.view(-1, *[1] * (x.ndim - 1)) for c in coefficients(path, t.double()))
    variance = a * a * S * S + s * s
    return da * MU + (da * a * S * S + ds * s) / variance * (x - a * MU)


def gaussian_velocity_fn(path: str, channels: int = 1, garbage: bool = True):
    """A model_fn(x_t, t, y) whose first C channels are the exact velocity and whose other C are noise."""

    def model_fn(x, t, y):
        v = exact_velocity(path, x.double(), t.double()).to(x.dtype)
        return torch.cat([v, torch.randn_like(v) * 100 if garbage else torch.zeros_like(v)], dim=1)

    return model_fn


@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_interpolant_and_velocity_target_by_hand(path):
    flow = FlowMatching(path)
    x0, noise = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.randn(3, 2, 4, 4, dtype=torch.float64)
    t = torch.tensor([0.0, 0.3, 0.9])
    for i, ti in enumerate(t.tolist()):
        a, s, da, ds = coefficients(path, ti)
        assert torch.allclose(flow.interpolate(x0, t, noise)[i], a * x0[i] + s * noise[i])
        assert torch.allclose(flow.velocity_target(x0, t, noise)[i], da * x0[i] + ds * noise[i])
    # t = 0 is the data itself, t = 1 pure noise (the direction docs/model.md states)
    assert torch.equal(flow.interpolate(x0, torch.zeros(3), noise), x0)
    assert torch.allclose(flow.interpolate(x0, torch.ones(3), noise), noise, atol=1e-12)


@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_the_loss_minimiser_is_the_exact_velocity_field(path):
    """At fixed t, least squares of the loss's target on x_t recovers E[v | x_t] (slope and intercept), and
    the loss of the exact field is the target's conditional variance, the least any model can reach."""
    flow, n, generator = FlowMatching(path), 200_000, torch.Generator().manual_seed(0)
    for t_value in (0.2, 0.6):
        x0 = MU + S * torch.randn(n, 1, 1, 1, generator=generator, dtype=torch.float64)
        noise = torch.randn(n, 1, 1, 1, generator=generator, dtype=torch.float64)
        t = torch.full((n,), t_value)
        x_t, target = flow.interpolate(x0, t, noise).flatten(), flow.velocity_target(x0, t, noise).flatten()
        design = torch.stack([x_t, torch.ones_like(x_t)], dim=1)
        slope, intercept = torch.linalg.lstsq(design, target[:, None]).solution.flatten().tolist()
        a, s, da, ds = coefficients(path, t_value)
        variance = a * a * S * S + s * s
        exact_slope = (da * a * S * S + ds * s) / variance
        conditional_variance = da * da * S * S + ds * ds - (da * a * S * S + ds * s) ** 2 / variance
        standard_error = math.sqrt(conditional_variance / (n * variance))  # of the fitted slope
        assert slope == pytest.approx(exact_slope, abs=5 * standard_error)
        assert intercept == pytest.approx(da * MU - exact_slope * a * MU, abs=5 * standard_error)

        y = torch.zeros(n, dtype=torch.long)
        losses = flow.training_losses(gaussian_velocity_fn(path), x0, y, t=t, noise=noise)
        assert losses["loss"].mean().item() == pytest.approx(conditional_variance, rel=1e-2)
        shifted = flow.loss_terms(torch.cat([x_t.view(-1, 1, 1, 1) * 0 + 0.1, x0], 1), x0, t, noise)
        assert shifted["loss"].mean() > losses["loss"].mean()  # any other field does worse


def test_the_loss_reads_only_the_first_c_channels():
    flow = FlowMatching()
    x0, noise, t = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3), torch.rand(4)
    velocity = torch.randn(4, 2, 3, 3)
    first = flow.loss_terms(torch.cat([velocity, torch.zeros_like(velocity)], 1), x0, t, noise)["loss"]
    second = flow.loss_terms(torch.cat([velocity, torch.randn_like(velocity)], 1), x0, t, noise)["loss"]
    assert torch.equal(first, second)
    by_hand = ((velocity - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(first, by_hand)


@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_score_from_velocity_is_the_gaussian_score(path):
    flow = FlowMatching(path)
    x = torch.randn(5, 1, 2, 2, dtype=torch.float64)
    t = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.95])
    score = flow.score_from_velocity(exact_velocity(path, x, t), x, t)
    for i, ti in enumerate(t.tolist()):
        a, s, _, _ = coefficients(path, ti)
        assert torch.allclose(score[i], -(x[i] - a * MU) / (a * a * S * S + s * s))


def test_time_sampling_distributions():
    generator = torch.Generator().manual_seed(1)
    uniform = torch.stack([draw_time("uniform", "linear", generator) for _ in range(4000)])
    assert 0 <= uniform.min() and uniform.max() < 1 and abs(uniform.mean().item() - 0.5) < 0.02
    lognormal = torch.stack([draw_time("lognormal", "linear", generator) for _ in range(4000)])
    logit = torch.log(lognormal / (1 - lognormal))  # the noise-to-signal log-ratio: N(0, 1)
    assert abs(logit.mean().item()) < 0.05 and abs(logit.std().item() - 1) < 0.05
    gvp = torch.stack([draw_time("lognormal", "gvp", generator) for _ in range(4000)])
    log_ratio = torch.log(torch.tan(gvp * math.pi / 2))
    assert abs(log_ratio.mean().item()) < 0.05 and abs(log_ratio.std().item() - 1) < 0.05
    with pytest.raises(UserError, match="time-sampling"):
        draw_time("beta", "linear", generator)


def test_sample_noise_draws_float_times_per_sample_for_flow():
    flow = build_objective("flow", "linear", "lognormal")
    noise = SampleNoise.for_objective(flow, 5, (2, 4, 4), 0.1)
    batch, again = noise([3, 4, 5]), noise([5])
    assert batch["t"].dtype == torch.float32 and ((batch["t"] > 0) & (batch["t"] < 1)).all()
    assert torch.equal(batch["t"][2:], again["t"]) and torch.equal(batch["noise"][2:], again["noise"])
    ddpm = SampleNoise.for_objective(build_objective("ddpm"), 5, (2, 4, 4), 0.1)([3])
    assert ddpm["t"].dtype == torch.long  # DiT's draws are unchanged


def test_objective_descriptions_round_trip():
    flow = objective_from_description({"name": "flow", "path": "gvp", "time_sampling": "lognormal"})
    assert (flow.path, flow.time_sampling) == ("gvp", "lognormal")
    assert objective_from_description(None).num_timesteps == 1000  # no record: DiT's ddpm
    with pytest.raises(UserError, match="objective"):
        build_objective("edm")


# --- training: the normal trainer, accumulation, two processes, exact resume ----------------------------------


@pytest.fixture(scope="module")
def flow_runs(tmp_path_factory):
    """One launched 2-process flow run (micro 2 x accumulation 2), and 1-process runs beside it: straight, and
    resumed from its half-way checkpoint. Shared by the training tests below."""
    from test_train_e2e import QUIET, _launch, make_workspace, run_in_process

    root = tmp_path_factory.mktemp("flow")
    workspace = make_workspace(root)
    shutil.copy(workspace["plan1"], root / "ddpm_plan.json")
    for name in ("plan1", "plan2"):  # as `dit-plan --objective flow` writes them (see the planner test)
        plan = json.loads(workspace[name].read_text())
        workspace[name].write_text(json.dumps(dict(plan, objective="flow")))
    flow = [
        "--objective",
        "flow",
        "--time-sampling",
        "lognormal",
        "--max-steps",
        "6",
        "--checkpoint-every",
        "3",
    ]
    launched = _launch(workspace, root / "two", *flow, "--debug-checksums")
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = ["--plan", workspace["plan1"], "--latents", workspace["latents"], *QUIET, "--no-tensorboard", *flow]
    assert run_in_process([*one, "--output-dir", root / "one"]) == 0
    resumed = root / "resumed"
    shutil.copytree(root / "one" / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    shutil.copy(root / "one" / "train_config.json", resumed)  # the run's record: what --resume inherits
    again = ["--plan", workspace["plan1"], "--latents", workspace["latents"], "--output-dir", resumed]
    assert run_in_process([*again, "--resume", "auto"]) == 0  # the objective is not given again
    return {
        "two": root / "two",
        "one": root / "one",
        "resumed": resumed,
        "root": root,
        "workspace": workspace,
    }


def test_flow_trains_with_accumulation_over_two_processes_as_one_process(flow_runs):
    from test_train_e2e import _checksums, _losses, assert_same_state

    two, one = flow_runs["two"], flow_runs["one"]
    assert _checksums(two, 0) == _checksums(two, 1) and len(_checksums(two, 0)) == 6
    assert _losses(one) == pytest.approx(_losses(two), rel=1e-5, abs=1e-6)  # the same samples, t and noise
    last = "checkpoints/step_00000006"
    assert_same_state(two / last, one / last, exact=False, atol=1e-5, layouts_differ=True)


def test_a_resumed_flow_run_is_the_straight_run_and_records_its_objective(flow_runs):
    from test_train_e2e import assert_same_state

    from dit_accel.run.weights import recorded_objective

    last = "checkpoints/step_00000006"
    assert_same_state(flow_runs["one"] / last, flow_runs["resumed"] / last)  # bit for bit
    recorded = recorded_objective(flow_runs["resumed"] / last)
    assert recorded == {"name": "flow", "path": "linear", "time_sampling": "lognormal"}
    config = json.loads((flow_runs["resumed"] / "train_config.json").read_text())
    assert config["objective"] == "flow"  # inherited on resume without being given again


# --- samplers -------------------------------------------------------------------------------------------------


def test_the_ode_with_the_exact_velocity_maps_noise_onto_the_data_and_heun_beats_euler():
    """For Gaussian data the probability-flow map is affine, x_t = alpha_t MU + sqrt(V_t) z: the ODE from
    noise z at t = 1 must land on MU + S z, sample by sample."""
    from dit_accel.diffusion.flow_sampling import ode_sample

    flow, y = FlowMatching("linear"), torch.zeros(2000, dtype=torch.long)
    noise = torch.randn(2000, 1, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model_fn, exact = gaussian_velocity_fn("linear", garbage=False), MU + S * noise
    errors = {}
    for solver in ("euler", "heun"):
        x = ode_sample(
            model_fn, flow, noise.shape, y, num_steps=10, solver=solver, noise=noise, dtype=torch.float64
        )
        errors[solver] = (x - exact).abs().max().item()
    assert errors["heun"] < 0.2 * errors["euler"], errors
    assert errors["heun"] < 2e-2
    x = ode_sample(model_fn, flow, noise.shape, y, num_steps=40, noise=noise, dtype=torch.float64)
    assert (x - exact).abs().max().item() < errors["heun"] / 10  # second order: 4x the steps, ~16x less


@pytest.mark.parametrize("form", ["sigma", "SBDM"])
def test_the_sde_with_the_exact_velocity_samples_the_data_distribution(form):
    from dit_accel.diffusion.flow_sampling import sde_sample

    flow, n = FlowMatching("linear"), 8000
    y, generator = torch.zeros(n, dtype=torch.long), torch.Generator().manual_seed(1)
    x = sde_sample(
        gaussian_velocity_fn("linear", garbage=False),
        flow,
        (n, 1, 1, 2),
        y,
        num_steps=100,
        diffusion_form=form,
        generator=generator,
        dtype=torch.float64,
    )
    assert x.mean().item() == pytest.approx(MU, abs=0.02)
    assert x.std().item() == pytest.approx(S, abs=0.02)


def test_diffusion_coefficients_in_dit_accel_time():
    from dit_accel.diffusion.flow_sampling import diffusion_coefficient

    linear = FlowMatching("linear")
    assert diffusion_coefficient(linear, "sigma", 0.3) == pytest.approx(0.3)  # REPA's g^2 / 2 = t
    assert diffusion_coefficient(linear, "SBDM", 0.3) == pytest.approx(0.3 / 0.7)  # SiT's (1 - tau) / tau
    assert diffusion_coefficient(linear, "linear", 0.3, norm=2.0) == pytest.approx(0.6)
    gvp = FlowMatching("gvp")
    assert diffusion_coefficient(gvp, "sigma", 0.5) == pytest.approx(math.sin(math.pi / 4))


def test_guidance_applies_only_inside_the_cfg_interval():
    """A model whose conditional velocity is 1 and unconditional 0: guided 3, unguided 1; the doubled batch
    runs only at the times inside [LOW, HIGH], which the Euler sum of the velocities then shows."""
    from dit_accel.diffusion.flow_sampling import guided_velocity, ode_sample

    calls = []

    def model_fn(x, t, y):
        calls.append((len(x), round(t[0].item(), 6)))
        return (y != 9).to(x.dtype).view(-1, 1, 1, 1).expand(-1, 2 * x.shape[1], *x.shape[2:])

    flow, y = FlowMatching(), torch.zeros(2, dtype=torch.long)
    start = torch.zeros(2, 1, 1, 1)
    x = ode_sample(
        model_fn,
        flow,
        start.shape,
        y,
        num_steps=10,
        solver="euler",
        guidance_scale=3.0,
        null_class=9,
        cfg_interval=(0.3, 0.6),
        noise=start,
    )
    doubled = [t for size, t in calls if size == 4]
    assert doubled == [0.6, 0.5, 0.4, 0.3]
    assert x.flatten().tolist() == pytest.approx([-(6 * 1 + 4 * 3) / 10] * 2)  # x_0 = x_1 - sum h v
    first3 = guided_velocity(model_fn, flow, 3.0, 9, channels="first3")(torch.zeros(1, 4, 1, 1), 0.5, y[:1])
    assert first3.flatten().tolist() == [3.0, 3.0, 3.0, 1.0]  # SiT's forward_with_cfg
    with pytest.raises(UserError, match="cfg-interval"):
        guided_velocity(model_fn, flow, 3.0, 9, interval=(0.7, 0.2))


def test_dit_accel_sample_reads_the_objective_from_the_checkpoint(flow_runs, tmp_path, capsys):
    """The grid and the evaluation batch of a flow run, with no --objective anywhere: the ODE by default,
    the SDE when asked; a DDPM sampler is refused in one line."""
    import numpy as np
    from test_sample import sample_main

    common = ["--checkpoint", str(flow_runs["one"]), "--steps", "3", "--classes", "0,1", "--batch-size", "2"]
    assert sample_main([*common, "--out", str(tmp_path / "grid.png"), "--cfg-interval", "0,0.7"]) == 0
    assert "ode 3 steps" in capsys.readouterr().out and (tmp_path / "grid.png").is_file()
    npz = tmp_path / "eval.npz"
    assert sample_main([*common, "--sampler", "sde", "--num-samples", "2", "--npz", str(npz)]) == 0
    assert "sde 3 steps" in capsys.readouterr().out
    assert np.load(npz)["arr_0"].shape[0] == 2
    assert sample_main([*common, "--sampler", "ddim", "--out", str(tmp_path / "ddim.png")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--sampler ddim is for ddpm models" in error[0] and "ode or sde" in error[0]
    # a flag only another sampler reads is refused, not silently ignored; nothing is written
    for flags, message in (
        (
            ["--diffusion-form", "linear"],
            "--diffusion-form is read by --sampler sde only, but this one samples with ode",
        ),
        (["--sampler", "sde", "--ode-solver", "euler"], "--ode-solver is read by --sampler ode only"),
        (["--spacing", "leading"], "--spacing is read by --sampler ddpm or ddim only"),
        # given at their default values: still a flag this sampler would not read
        (["--sampler", "sde", "--ode-solver", "heun"], "--ode-solver is read by --sampler ode only"),
        (["--diffusion-form", "sigma"], "--diffusion-form is read by --sampler sde only"),
        (["--diffusion-norm", "1"], "--diffusion-norm is read by --sampler sde only"),
    ):
        out = tmp_path / "ignored.png"
        assert sample_main([*common, *flags, "--out", str(out)]) == 2, flags
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and message in error[0] and not out.exists(), error


def test_the_trainer_refuses_an_objective_the_plan_did_not_make(flow_runs, capsys):
    from test_train_e2e import QUIET, run_in_process

    root, latents = flow_runs["root"], flow_runs["workspace"]["latents"]
    argv = ["--plan", root / "ddpm_plan.json", "--latents", latents, *QUIET, "--max-steps", "1"]
    assert run_in_process([*argv, "--output-dir", root / "refused", "--objective", "flow"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--objective flow contradicts the plan's objective ddpm" in error
    assert "dit-plan --objective flow" in error
    assert not (root / "refused" / "checkpoints").exists()


def test_dit_plan_records_the_objective_in_plan_json(tmp_path):
    from planner.cli import main as dit_plan
    from planner.planfile import read_plan

    tiny = ["--model", "DiT-S/2", "--depth", "2", "--hidden", "32", "--heads", "2", "--resolution", "64"]
    tiny += [
        "--num-classes",
        "4",
        "--vram",
        "8G",
        "--precision",
        "fp32",
        "--global-batch",
        "8",
        "--gpus",
        "1",
    ]
    assert dit_plan([*tiny, "--objective", "flow", "--out", str(tmp_path / "flow")]) == 0
    assert read_plan(tmp_path / "flow" / "plan.json").objective == "flow"
    assert dit_plan([*tiny, "--out", str(tmp_path / "ddpm")]) == 0
    assert read_plan(tmp_path / "ddpm" / "plan.json").objective == "ddpm"  # DiT's, as before
