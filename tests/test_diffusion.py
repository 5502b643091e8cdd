"""The DiT objective and the samplers, held to closed forms computed independently here (numpy, float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, DiTPipeline, DPMSolverMultistepScheduler

from dit_accel.diffusion.objective import (
    DIT_SCHEDULER_CONFIG,
    Diffusion,
    discretized_gaussian_log_likelihood,
    normal_kl,
)
from dit_accel.diffusion.sampling import (
    classifier_free_guidance,
    ddim_sample,
    ddpm_sample,
    respaced,
    sample_with_scheduler,
    spaced_timesteps,
)
from dit_accel.errors import UserError
from dit_accel.models.dit import as_model_fn, build_model
from planner.spec import custom_spec

T = 1000
BETAS = np.linspace(1e-4, 0.02, T)
ALPHAS_CUMPROD = np.cumprod(1 - BETAS)


@pytest.fixture(scope="module")
def diffusion():
    return Diffusion.linear()


# --- schedule -----------------------------------------------------------------------------------------------


def test_schedule_is_diffusers_ddpm_schedule(diffusion):
    scheduler = DDPMScheduler(**DIT_SCHEDULER_CONFIG)
    np.testing.assert_allclose(
        diffusion.table("alphas_cumprod").numpy(), scheduler.alphas_cumprod.double().numpy(), rtol=2e-6
    )
    np.testing.assert_allclose(diffusion.table("alphas_cumprod").numpy(), ALPHAS_CUMPROD, rtol=1e-12)
    assert Diffusion.from_scheduler_config(scheduler.config).num_timesteps == 1000
    with pytest.raises(UserError, match="linear"):
        Diffusion.from_scheduler_config({**DIT_SCHEDULER_CONFIG, "beta_schedule": "squaredcos_cap_v2"})


def test_q_sample_closed_form(diffusion):
    x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    t = torch.tensor([0, 500, 999])
    a = torch.from_numpy(ALPHAS_CUMPROD[[0, 500, 999]]).float().view(3, 1, 1, 1)
    torch.testing.assert_close(diffusion.q_sample(x0, t, noise), a.sqrt() * x0 + (1 - a).sqrt() * noise)


def test_uniform_timesteps_are_seeded_and_cover_the_range(diffusion):
    t = diffusion.sample_timesteps(20_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(t, diffusion.sample_timesteps(20_000, generator=torch.Generator().manual_seed(0)))
    assert t.min() == 0 and t.max() == 999
    counts = torch.bincount(t // 100, minlength=10).float()
    assert (counts / 2000 - 1).abs().max() < 0.1


# --- loss terms against an independent float64 computation --------------------------------------------------


def normal_cdf(z):
    return 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))


def recipe_cdf(z):
    """The tanh approximation of the normal CDF that DiT's (ADM's) t = 0 term uses, in float64."""
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


def reference_terms(out, x0, t, noise):
    """mse and vb (bits/dim) per sample; the posterior from Bayes' rule, not the code's coefficients."""
    out, x0, noise = (a.double().numpy() for a in (out, x0, noise))
    channels = x0.shape[1]
    mse, vb = [], []
    for i, step in enumerate(t.tolist()):
        b, a = BETAS[step], ALPHAS_CUMPROD[step]
        a_prev = ALPHAS_CUMPROD[step - 1] if step > 0 else 1.0
        x_t = math.sqrt(a) * x0[i] + math.sqrt(1 - a) * noise[i]
        eps, v = out[i, :channels], out[i, channels:]
        mse.append(np.mean((noise[i] - eps) ** 2))

        def posterior(start):  # N(mean, var) of x_{t-1} given x_t and x_0 = start
            if step == 0:
                return start, 0.0
            precision = 1 / (1 - a_prev) + (1 - b) / b
            var = 1 / precision
            return var * (math.sqrt(a_prev) * start / (1 - a_prev) + math.sqrt(1 - b) * x_t / b), var

        var_at_1 = BETAS[1] * (1 - ALPHAS_CUMPROD[0]) / (1 - ALPHAS_CUMPROD[1])  # the clip at t = 0
        true_mean, true_var = posterior(x0[i])
        log_min = math.log(true_var) if step > 0 else math.log(var_at_1)
        model_log_var = (v + 1) / 2 * math.log(b) + (1 - v) / 2 * log_min
        pred_x0 = (x_t - math.sqrt(1 - a) * eps) / math.sqrt(a)
        model_mean, _ = posterior(pred_x0)
        if step > 0:
            model_var = np.exp(model_log_var)
            kl = 0.5 * (
                np.log(model_var / true_var)
                + true_var / model_var
                + (true_mean - model_mean) ** 2 / model_var
                - 1
            )
            vb.append(np.mean(kl) / math.log(2))
        else:
            std = np.exp(0.5 * model_log_var)
            upper = recipe_cdf((x0[i] + 1 / 255 - model_mean) / std)
            lower = recipe_cdf((x0[i] - 1 / 255 - model_mean) / std)
            prob = np.where(x0[i] < -0.999, upper, np.where(x0[i] > 0.999, 1 - lower, upper - lower))
            prob = np.maximum(prob, 1e-12)
            vb.append(np.mean(-np.log(prob)) / math.log(2))
    return np.array(mse), np.array(vb)


def quantised_images(n, channels=2, size=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 256, (n, channels, size, size), generator=generator)
    x0 = levels.float() / 127.5 - 1
    x0[0, 0, 0, 0], x0[0, 0, 0, 1] = -1.0, 1.0  # both edge bins
    return x0


def test_loss_terms_match_closed_forms(diffusion):
    t = torch.tensor([0, 1, 10, 500, 999])
    x0 = quantised_images(5)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(x0.shape, generator=g)
    eps = noise + 0.3 * torch.randn(x0.shape, generator=g)
    v = torch.rand(x0.shape, generator=g) * 2 - 1
    out = torch.cat([eps, v], dim=1)
    terms = diffusion.loss_terms(out, x0, t, noise)
    mse, vb = reference_terms(out, x0, t, noise)
    np.testing.assert_allclose(terms["mse"].numpy(), mse, rtol=1e-5)
    np.testing.assert_allclose(terms["vb"].numpy(), vb, rtol=2e-4)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])
    assert all(terms[k].shape == (5,) for k in ("mse", "vb", "loss"))


def test_perfect_prediction_has_zero_mse_and_zero_kl(diffusion):
    t = torch.tensor([1, 250, 999])
    x0, noise = quantised_images(3), torch.randn(3, 2, 4, 4)
    out = torch.cat([noise, -torch.ones_like(noise)], dim=1)  # v = -1: the posterior variance itself
    terms = diffusion.loss_terms(out, x0, t, noise)
    assert terms["mse"].abs().max() == 0
    assert terms["vb"].abs().max() < 1e-4  # float32 rounding of the means, nothing more


def test_normal_kl_identities():
    mean, log_var = torch.randn(100), torch.randn(100)
    assert normal_kl(mean, log_var, mean, log_var).abs().max() < 1e-6  # zero up to float32 rounding
    # KL(N(0,1) || N(1, e^2)) = 0.5 * (2 + e^-2 + e^-2 - 1)
    value = normal_kl(torch.tensor(0.0), torch.tensor(0.0), torch.tensor(1.0), torch.tensor(2.0))
    assert value.item() == pytest.approx(0.5 * (2 + 2 * math.exp(-2) - 1), rel=1e-6)


def test_decoder_nll_at_t0_and_bits(diffusion):
    x0 = quantised_images(2)
    noise = torch.randn(x0.shape)
    # eps = noise makes the model's mean exactly x0 at t = 0; v = -1: std = sqrt(posterior variance at t=1)
    out = torch.cat([noise, -torch.ones_like(noise)], dim=1)
    vb = diffusion.loss_terms(out, x0, torch.tensor([0, 0]), noise)["vb"]
    std = math.sqrt(BETAS[1] * (1 - ALPHAS_CUMPROD[0]) / (1 - ALPHAS_CUMPROD[1]))
    interior = recipe_cdf(1 / 255 / std) - recipe_cdf(-1 / 255 / std)
    edge = recipe_cdf(1 / 255 / std)
    is_edge = (x0.abs() > 0.999).double().numpy()
    nats = -(is_edge * np.log(edge) + (1 - is_edge) * np.log(interior)).reshape(2, -1).mean(axis=1)
    np.testing.assert_allclose(vb.numpy(), nats / math.log(2), rtol=1e-4)
    log_p = discretized_gaussian_log_likelihood(x0, x0, torch.full_like(x0, math.log(std)))
    assert log_p.max() <= 0 and torch.isfinite(log_p).all()


def test_decoder_nll_uses_the_recipes_tanh_cdf_not_the_exact_one():
    """The t = 0 term scores bins with the tanh CDF (and clamps at 1e-12) as the DiT recipe does; the exact CDF
    differs by up to 2e-4, which the bins of a wide Gaussian show plainly."""
    x = torch.linspace(-1, 1, 256, dtype=torch.float64)  # every bin, both edges included
    mean, log_scale = torch.full_like(x, 0.1), torch.full_like(x, math.log(0.4))
    log_p = discretized_gaussian_log_likelihood(x, mean, log_scale).numpy()
    z_upper, z_lower = (x.numpy() - 0.1 + 1 / 255) / 0.4, (x.numpy() - 0.1 - 1 / 255) / 0.4

    def log_bins(cdf):
        upper, lower = cdf(z_upper), cdf(z_lower)
        prob = np.where(x.numpy() < -0.999, upper, np.where(x.numpy() > 0.999, 1 - lower, upper - lower))
        return np.log(np.maximum(prob, 1e-12))

    np.testing.assert_allclose(log_p, log_bins(recipe_cdf), rtol=1e-9, atol=1e-12)
    assert np.abs(log_p - log_bins(normal_cdf)).max() > 1e-4  # not the exact CDF
    far = discretized_gaussian_log_likelihood(torch.tensor([0.0]), torch.tensor([50.0]), torch.tensor([-3.0]))
    assert far.item() == pytest.approx(math.log(1e-12))  # an empty bin is clamped, not -inf


def test_vb_trains_only_the_variance_and_mse_only_the_mean(diffusion):
    x0, noise = quantised_images(4), torch.randn(4, 2, 4, 4)
    t = torch.tensor([0, 3, 400, 999])
    out = torch.cat([torch.randn(4, 2, 4, 4), torch.rand(4, 2, 4, 4) * 2 - 1], dim=1).requires_grad_()
    diffusion.loss_terms(out, x0, t, noise)["vb"].sum().backward()
    assert out.grad[:, :2].abs().max() == 0 and out.grad[:, 2:].abs().min() > 0
    out.grad = None
    diffusion.loss_terms(out, x0, t, noise)["mse"].sum().backward()
    assert out.grad[:, 2:].abs().max() == 0 and out.grad[:, :2].abs().sum() > 0


def test_loss_is_float32_for_half_precision_outputs(diffusion):
    x0, noise = quantised_images(2), torch.randn(2, 2, 4, 4)
    out = torch.cat([noise, torch.zeros_like(noise)], dim=1)
    terms = diffusion.loss_terms(out.bfloat16(), x0, torch.tensor([5, 700]), noise)
    assert terms["loss"].dtype == torch.float32 and torch.isfinite(terms["loss"]).all()


def test_training_losses_draws_t_and_noise_from_the_generator(diffusion):
    x0, y = quantised_images(6), torch.arange(6)
    seen = {}

    def model_fn(x_t, t, labels):
        seen["t"], seen["y"] = t, labels
        return torch.cat([0.5 * x_t, torch.tanh(x_t)], dim=1)

    first = diffusion.training_losses(model_fn, x0, y, generator=torch.Generator().manual_seed(7))
    again = diffusion.training_losses(model_fn, x0, y, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first["loss"], again["loss"]) and torch.equal(first["t"], again["t"])
    assert torch.equal(seen["t"], first["t"]) and torch.equal(seen["y"], y)
    t, noise = torch.tensor([0, 1, 2, 300, 600, 999]), torch.randn(x0.shape)
    given = diffusion.training_losses(model_fn, x0, y, t=t, noise=noise)
    expected = diffusion.loss_terms(model_fn(diffusion.q_sample(x0, t, noise), t, y), x0, t, noise)
    torch.testing.assert_close(given["loss"], expected["loss"])


# --- respacing ------------------------------------------------------------------------------------------


def test_spacings():
    even = spaced_timesteps(1000, 250)
    assert len(even) == 250 and even[:3] == [0, 4, 8] and even[-1] == 999
    assert spaced_timesteps(1000, 50, "leading") == list(range(0, 1000, 20))
    assert spaced_timesteps(1000, 1000) == list(range(1000))
    with pytest.raises(UserError, match="from 2 to 1000"):
        spaced_timesteps(1000, 1)
    with pytest.raises(UserError, match="spacing"):
        spaced_timesteps(1000, 10, "trailing")


def test_even_spacing_accumulates_the_stride_as_the_original_respacing_does():
    """ADM/DiT add the stride to a float position once per kept step; i * stride rounds exact .5 ties the
    other way for 278 of the 999 step counts (never 25, 50, 100, 250 or 500)."""

    def accumulated(num_steps: int) -> list[int]:
        stride, position, kept = 999 / (num_steps - 1), 0.0, []
        for _ in range(num_steps):
            kept.append(round(position))
            position += stride
        return sorted(set(kept))

    def product(num_steps: int) -> list[int]:  # what dit-accel computed before
        stride = 999 / (num_steps - 1)
        return sorted({round(i * stride) for i in range(num_steps)})

    assert 499 in spaced_timesteps(1000, 21) and 500 not in spaced_timesteps(1000, 21)  # 10 x 49.95
    assert all(spaced_timesteps(1000, n) == accumulated(n) for n in range(2, 1001))
    differ = [n for n in range(2, 1001) if accumulated(n) != product(n)]
    assert len(differ) == 278 and not {25, 50, 100, 250, 500} & set(differ)


def test_respaced_chain_keeps_the_marginals(diffusion):
    chain = respaced(diffusion, 250)
    kept = spaced_timesteps(1000, 250)
    np.testing.assert_allclose(chain.table("alphas_cumprod").numpy(), ALPHAS_CUMPROD[kept], rtol=1e-12)
    assert chain.timestep_map.tolist() == kept
    full = diffusion.respace(range(1000))
    np.testing.assert_allclose(full.table("betas").numpy(), BETAS, rtol=1e-9)


def test_samplers_call_the_model_with_original_timesteps(diffusion):
    calls = []

    def model_fn(x, t, y):
        calls.append(t[0].item())
        return torch.cat([torch.zeros_like(x), torch.zeros_like(x)], dim=1)

    ddpm_sample(model_fn, diffusion, (2, 1, 2, 2), torch.zeros(2, dtype=torch.long), num_steps=25)
    assert calls == spaced_timesteps(1000, 25)[::-1]
    calls.clear()
    ddim_sample(
        model_fn, diffusion, (2, 1, 2, 2), torch.zeros(2, dtype=torch.long), num_steps=10, spacing="leading"
    )
    assert calls == list(range(0, 1000, 100))[::-1]


# --- samplers against known answers --------------------------------------------------------------------------


def point_mass_denoiser(target):
    """The exact eps-prediction for data that is always `target` (uses the ORIGINAL schedule)."""

    def model_fn(x, t, y):
        a = torch.from_numpy(ALPHAS_CUMPROD).float()[t].view(-1, 1, 1, 1)
        eps = (x - a.sqrt() * target) / (1 - a).sqrt()
        return torch.cat([eps, torch.zeros_like(x)], dim=1)

    return model_fn


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_samplers_recover_a_point_mass(diffusion, sampler):
    target = torch.tensor([0.7, -0.3]).view(1, 2, 1, 1)
    y = torch.zeros(8, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    if sampler == "ddpm":
        x = ddpm_sample(
            point_mass_denoiser(target), diffusion, (8, 2, 1, 1), y, num_steps=50, generator=generator
        )
    else:
        x = ddim_sample(
            point_mass_denoiser(target), diffusion, (8, 2, 1, 1), y, num_steps=20, generator=generator
        )
    torch.testing.assert_close(x, target.expand(8, 2, 1, 1), atol=1e-4, rtol=0)


def gaussian_eps(s):
    """The exact eps-prediction for data N(0, s^2): E[eps | x_t] = sqrt(1 - a) x_t / (a s^2 + 1 - a)."""

    def eps(x, t):
        a = torch.from_numpy(ALPHAS_CUMPROD)[t].view(-1, 1, 1, 1)
        return ((1 - a).sqrt() * x / (a * s**2 + 1 - a)).float()

    return eps


def test_ddpm_with_the_exact_variance_samples_a_gaussian(diffusion):
    """Data N(0, s^2): the true reverse step is Gaussian with mean = posterior mean at E[x0|x_t] and variance
    posterior_var + coef1^2 Var(x0|x_t). Feeding the sampler that variance through v must give std s."""
    s, steps = 0.5, 100
    chain = respaced(diffusion, steps)
    to_step = {orig: k for k, orig in enumerate(chain.timestep_map.tolist())}
    eps = gaussian_eps(s)

    def model_fn(x, t, y):
        k = torch.tensor([to_step[i] for i in t.tolist()])
        a = torch.from_numpy(ALPHAS_CUMPROD)[t].view(-1, 1, 1, 1)
        var_x0 = s**2 * (1 - a) / (a * s**2 + 1 - a)
        coef1 = chain.table("posterior_mean_coef1")[k].view(-1, 1, 1, 1)
        log_min = chain.table("posterior_log_variance_clipped")[k].view(-1, 1, 1, 1)
        log_max = chain.table("log_betas")[k].view(-1, 1, 1, 1)
        true_log_var = torch.log(chain.table("posterior_variance")[k].view(-1, 1, 1, 1) + coef1**2 * var_x0)
        v = 2 * (true_log_var - log_min) / (log_max - log_min) - 1
        assert v.min() >= -1 and v.max() <= 1  # the truth lies in the learned range
        return torch.cat([eps(x, t), v.float().expand_as(x)], dim=1)

    n = 8192
    x = ddpm_sample(
        model_fn,
        diffusion,
        (n, 1, 1, 1),
        torch.zeros(n, dtype=torch.long),
        num_steps=steps,
        generator=torch.Generator().manual_seed(0),
    )
    assert abs(x.mean().item()) < 0.02 and x.std().item() == pytest.approx(s, rel=0.03)


def test_ddim_is_the_deterministic_linear_map_for_gaussian_data(diffusion):
    """With the exact eps for N(0, s^2) data each DDIM step multiplies x by
    m = sqrt(a_prev) sqrt(a) s^2 / (a s^2 + 1 - a) + sqrt(1 - a_prev) sqrt(1 - a) / (a s^2 + 1 - a)."""
    s, steps = 0.5, 20
    eps = gaussian_eps(s)
    kept = spaced_timesteps(1000, steps)
    expected = 1.0
    for k, step in enumerate(kept):
        a, a_prev = ALPHAS_CUMPROD[step], (ALPHAS_CUMPROD[kept[k - 1]] if k > 0 else 1.0)
        expected *= (math.sqrt(a_prev * a) * s**2 + math.sqrt((1 - a_prev) * (1 - a))) / (a * s**2 + 1 - a)
    x = ddim_sample(
        lambda x, t, y: torch.cat([eps(x, t), torch.zeros_like(x)], dim=1),
        diffusion,
        (2, 1, 1, 1),
        torch.zeros(2, dtype=torch.long),
        num_steps=steps,
        noise=torch.ones(2, 1, 1, 1),
    )
    torch.testing.assert_close(x, torch.full((2, 1, 1, 1), expected, dtype=torch.float32), rtol=1e-5, atol=0)
    assert 0.3 < expected < 0.5  # a first-order solver: below s at 20 steps


def test_samplers_are_deterministic_under_a_generator(diffusion):
    model_fn = point_mass_denoiser(torch.zeros(1, 1, 1, 1))
    y = torch.zeros(4, dtype=torch.long)

    def draw(seed, sampler, **kwargs):
        return sampler(
            lambda x, t, yy: model_fn(x, t, yy) + 0.1,
            diffusion,
            (4, 1, 1, 1),
            y,
            num_steps=10,
            generator=torch.Generator().manual_seed(seed),
            **kwargs,
        )

    assert torch.equal(draw(0, ddpm_sample), draw(0, ddpm_sample))
    assert not torch.equal(draw(0, ddpm_sample), draw(1, ddpm_sample))
    assert torch.equal(draw(0, ddim_sample, eta=1.0), draw(0, ddim_sample, eta=1.0))
    assert not torch.equal(draw(0, ddim_sample, eta=1.0), draw(1, ddim_sample, eta=1.0))


def test_per_sample_generators_make_samples_independent_of_the_batch(diffusion):
    model_fn = point_mass_denoiser(torch.zeros(1, 1, 1, 1))
    shifted = lambda x, t, y: model_fn(x, t, y) + 0.1  # noqa: E731  (so the chain is not a point mass)
    y = torch.zeros(3, dtype=torch.long)
    seeds = [5, 6, 7]
    batch = ddpm_sample(
        shifted,
        diffusion,
        (3, 1, 2, 2),
        y,
        num_steps=10,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
    )
    alone = ddpm_sample(
        shifted, diffusion, (1, 1, 2, 2), y[:1], num_steps=10, generator=[torch.Generator().manual_seed(6)]
    )
    torch.testing.assert_close(batch[1:2], alone, rtol=0, atol=0)


# --- classifier-free guidance -----------------------------------------------------------------------------


def labelled_model():
    calls = []

    def model_fn(x, t, y):
        calls.append(len(x))
        scale = (y.float() + 1).view(-1, 1, 1, 1)
        return torch.cat([x * scale, torch.tanh(x + scale)], dim=1)

    return model_fn, calls


@pytest.mark.parametrize("channels", ["all", "first3"])
def test_guidance_formula_and_channels(channels):
    model_fn, calls = labelled_model()
    x, t, y = torch.randn(2, 4, 3, 3), torch.tensor([5, 5]), torch.tensor([1, 2])
    out = classifier_free_guidance(model_fn, 4.0, null_class=9, channels=channels)(x, t, y)
    assert calls == [4]  # one doubled batch
    cond, uncond = model_fn(x, t, y), model_fn(x, t, torch.full_like(y, 9))
    guided = uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4])
    n = 4 if channels == "all" else 3
    torch.testing.assert_close(out[:, :n], guided[:, :n])
    torch.testing.assert_close(out[:, n:], cond[:, n:])  # rest of eps and the variance: conditional half
    assert classifier_free_guidance(model_fn, 1.0, null_class=9) is model_fn
    with pytest.raises(UserError, match="first3"):
        classifier_free_guidance(model_fn, 4.0, 9, channels="last")


# --- DiTPipeline parity --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pipeline_parts():
    torch.manual_seed(0)
    model = build_model(custom_spec(2, 32, 2, 2, 64, num_classes=1000), init="torch").eval()
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=8,
    ).eval()
    return model, vae


@pytest.mark.parametrize(
    "scheduler_class, guidance_scale",
    [(DDIMScheduler, 4.0), (DPMSolverMultistepScheduler, 1.5), (DDIMScheduler, 1.0)],
)
def test_sample_with_scheduler_matches_dit_pipeline(tiny_pipeline_parts, scheduler_class, guidance_scale):
    model, vae = tiny_pipeline_parts
    pipe = DiTPipeline(
        transformer=model, vae=vae, scheduler=scheduler_class.from_config(DIT_SCHEDULER_CONFIG)
    )
    images = pipe(
        class_labels=[3, 999],
        guidance_scale=guidance_scale,
        num_inference_steps=6,
        generator=torch.Generator().manual_seed(11),
        output_type="pt",
    ).images
    latents = sample_with_scheduler(
        as_model_fn(model),
        scheduler_class.from_config(DIT_SCHEDULER_CONFIG),
        torch.tensor([3, 999]),
        latent_channels=4,
        latent_size=8,
        num_inference_steps=6,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(11),
    )
    with torch.no_grad():
        ours = (vae.decode(latents / vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
    assert images.std() > 0.01
    torch.testing.assert_close(ours, images, rtol=0, atol=1e-6)


def test_guided_ddpm_on_a_real_tiny_dit(tiny_pipeline_parts):
    model, _ = tiny_pipeline_parts
    diffusion = Diffusion.linear()
    fn = classifier_free_guidance(as_model_fn(model), 4.0, null_class=1000, channels="first3")
    y = torch.tensor([1, 2])
    a = ddpm_sample(fn, diffusion, (2, 4, 8, 8), y, num_steps=5, generator=torch.Generator().manual_seed(0))
    b = ddpm_sample(fn, diffusion, (2, 4, 8, 8), y, num_steps=5, generator=torch.Generator().manual_seed(0))
    assert a.shape == (2, 4, 8, 8) and torch.isfinite(a).all() and torch.equal(a, b)
