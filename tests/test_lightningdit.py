"""LightningDiT (models.lightningdit) against the planner and against the released network.

The released network is read here by the test's own functional forward, written from hustvl/LightningDiT's
models/lightningdit.py (RMSNorm in fp32, SwiGLU, EVA's 2-D rotary embedding with its stored tables, MAE's
sin-cos table, adaLN, the unpatchify einsum) in its own time (t = 0 noise, the velocity data - noise). A
released-layout state dict with random weights, made here under the released key names, is imported
(models.original_lightningdit) and must give the same velocity, negated, at t = 1 - t.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dit_accel.errors import UserError
from dit_accel.models.dit import build_model, count_trainable_params, null_class, spec_from_model
from dit_accel.models.lightningdit import rope_tables
from dit_accel.models.original_lightningdit import load_lightningdit, spec_from_released
from planner.spec import LIGHTNINGDIT_PATCHES, LIGHTNINGDIT_SIZES, custom_spec, model_spec


def tiny(**options) -> object:
    fields = dict(depth=2, hidden=64, heads=4, patch=1, resolution=64, family="lightningdit", num_classes=10)
    fields.update(options)
    return custom_spec(name="LightningDiT-custom", **fields)


@pytest.mark.parametrize("size", sorted(LIGHTNINGDIT_SIZES))
@pytest.mark.parametrize("patch", LIGHTNINGDIT_PATCHES)
def test_the_built_network_has_the_planners_parameter_count(size, patch):
    spec = model_spec(f"LightningDiT-{size}/{patch}", 256)
    with torch.device("meta"):
        model = build_model(spec, init="torch")
    assert count_trainable_params(model) == spec.params_trainable
    assert spec_from_model(model) == spec and null_class(model) == 1000


def test_xl1_is_the_released_size_and_runs_at_the_flops_of_dit_xl2():
    spec, dit = model_spec("LightningDiT-XL/1", 256), model_spec("DiT-XL/2", 256)
    assert (spec.tokens, spec.in_channels, spec.latent_size, spec.mlp_hidden) == (256, 32, 16, 3072)
    assert spec.params_trainable == 674_961_824
    # SwiGLU's 3 x 1152 x 3072 multiply-adds per token equal GELU's 2 x 1152 x 4608: the same 256 tokens
    assert spec.block_fwd_macs_per_image() == dit.block_fwd_macs_per_image()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"qk_norm": True},
        {"swiglu": False},
        {"modulation_shift": False},
        {"rmsnorm": False},
        {"rope": False},
    ],
    ids=["released", "qk-norm", "gelu", "no-shift", "layernorm", "no-rope"],
)
def test_every_block_switch_counts_what_it_builds(options):
    spec = tiny(**options)
    assert count_trainable_params(build_model(spec, init="torch")) == spec.params_trainable


# --- the released network, read by the test ---------------------------------------------------------------


def released_sincos_table(width: int, side: int) -> np.ndarray:
    """MAE's table as the released get_2d_sincos_pos_embed makes it (numpy, float64, w coordinates first)."""

    def one_axis(dim, positions):
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        angles = positions.reshape(-1)[:, None] * omega[None, :]
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    w_coords, h_coords = np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32))
    return np.concatenate([one_axis(width // 2, w_coords), one_axis(width // 2, h_coords)], axis=1)


def released_rope_tables(head_dim: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EVA's VisionRotaryEmbeddingFast(dim=head_dim // 2, pt_seq_len=side): (side * side, head_dim) cos, sin."""
    dim = head_dim // 2
    frequencies = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    positions = torch.arange(side) / side * side
    per_axis = torch.einsum("i,f->if", positions, frequencies).repeat_interleave(2, dim=-1)  # (side, dim)
    table = torch.zeros(side, side, 2 * dim)
    for i in range(side):
        for j in range(side):
            table[i, j] = torch.cat([per_axis[i], per_axis[j]])
    return table.cos().reshape(-1, 2 * dim), table.sin().reshape(-1, 2 * dim)


def released_state_dict(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the released key names and shapes (LightningDiT(...).state_dict())."""
    g = torch.Generator().manual_seed(seed)
    d, p, c, h = spec.hidden, spec.patch, spec.in_channels, spec.mlp_hidden
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05
    state = {
        "pos_embed": torch.from_numpy(released_sincos_table(d, spec.latent_size // p)).float()[None],
        "x_embedder.proj.weight": r(d, c, p, p),
        "x_embedder.proj.bias": r(d),
        "t_embedder.mlp.0.weight": r(d, 256),
        "t_embedder.mlp.0.bias": r(d),
        "t_embedder.mlp.2.weight": r(d, d),
        "t_embedder.mlp.2.bias": r(d),
        "y_embedder.embedding_table.weight": r(spec.num_classes + 1, d),
        "final_layer.norm_final.weight": 1 + r(d),
        "final_layer.linear.weight": r(p * p * c, d),
        "final_layer.linear.bias": r(p * p * c),
        "final_layer.adaLN_modulation.1.weight": r(2 * d, d),
        "final_layer.adaLN_modulation.1.bias": r(2 * d),
    }
    if spec.rope:
        state["feat_rope.freqs_cos"], state["feat_rope.freqs_sin"] = released_rope_tables(
            spec.head_dim, spec.latent_size // p
        )
    for i in range(spec.depth):
        b = f"blocks.{i}."
        state.update(
            {
                b + "norm1.weight": 1 + r(d),
                b + "norm2.weight": 1 + r(d),
                b + "attn.qkv.weight": r(3 * d, d),
                b + "attn.qkv.bias": r(3 * d),
                b + "attn.proj.weight": r(d, d),
                b + "attn.proj.bias": r(d),
                b + "mlp.w12.weight": r(2 * h, d),
                b + "mlp.w12.bias": r(2 * h),
                b + "mlp.w3.weight": r(d, h),
                b + "mlp.w3.bias": r(d),
                b + "adaLN_modulation.1.weight": r(6 * d, d),
                b + "adaLN_modulation.1.bias": r(6 * d),
            }
        )
        if spec.qk_norm:
            state[b + "attn.q_norm.weight"] = 1 + r(spec.head_dim)
            state[b + "attn.k_norm.weight"] = 1 + r(spec.head_dim)
    return state


def released_forward(state, spec, x, t, y):
    """The released LightningDiT.forward (their time: t = 0 noise) on a released state dict."""

    def rms(v, weight):
        normed = v.float() * torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed.type_as(v) * weight

    def linear(v, key):
        return F.linear(v, state[key + ".weight"], state[key + ".bias"])

    def rotate_half(v):
        pairs = v.reshape(*v.shape[:-1], -1, 2)
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).reshape(v.shape)

    def modulate(v, shift, scale):
        return v * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)

    n, d, p, heads = x.shape[0], spec.hidden, spec.patch, spec.heads
    tokens = F.conv2d(x, state["x_embedder.proj.weight"], state["x_embedder.proj.bias"], stride=p)
    h = tokens.flatten(2).transpose(1, 2) + state["pos_embed"]
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    args = t[:, None].float() * freqs[None]
    t_emb = linear(
        F.silu(linear(torch.cat([args.cos(), args.sin()], -1), "t_embedder.mlp.0")), "t_embedder.mlp.2"
    )
    c = t_emb + state["y_embedder.embedding_table.weight"][y]
    for i in range(spec.depth):
        b = f"blocks.{i}."
        shift1, scale1, gate1, shift2, scale2, gate2 = linear(F.silu(c), b + "adaLN_modulation.1").chunk(6, 1)
        a = modulate(rms(h, state[b + "norm1.weight"]), shift1, scale1)
        qkv = linear(a, b + "attn.qkv").reshape(n, -1, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if spec.qk_norm:
            q, k = rms(q, state[b + "attn.q_norm.weight"]), rms(k, state[b + "attn.k_norm.weight"])
        cos, sin = state["feat_rope.freqs_cos"], state["feat_rope.freqs_sin"]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, -1, d)
        h = h + gate1.unsqueeze(1) * linear(attended, b + "attn.proj")
        m = modulate(rms(h, state[b + "norm2.weight"]), shift2, scale2)
        gate, value = linear(m, b + "mlp.w12").chunk(2, dim=-1)
        h = h + gate2.unsqueeze(1) * linear(F.silu(gate) * value, b + "mlp.w3")
    shift, scale = linear(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, 1)
    out = linear(modulate(rms(h, state["final_layer.norm_final.weight"]), shift, scale), "final_layer.linear")
    side = int(out.shape[1] ** 0.5)
    out = out.reshape(n, side, side, p, p, spec.in_channels)
    return torch.einsum("nhwpqc->nchpwq", out).reshape(n, spec.in_channels, side * p, side * p)


@pytest.mark.parametrize(
    "options", [{}, {"patch": 2, "resolution": 128}, {"qk_norm": True}], ids=["patch1", "patch2", "qk-norm"]
)
def test_a_released_checkpoint_imports_and_gives_the_released_velocity_in_dit_accels_time(options):
    spec = tiny(**options)
    state = released_state_dict(spec)
    model, notes = load_lightningdit(state)
    imported = spec_from_model(model)
    assert (imported.depth, imported.hidden, imported.heads, imported.patch, imported.qk_norm) == (
        spec.depth,
        spec.hidden,
        spec.heads,
        spec.patch,
        spec.qk_norm,
    )
    assert imported.rope and imported.rmsnorm and imported.swiglu and imported.num_classes == 10
    assert any("folded" in note for note in notes)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, spec.latent_size, spec.latent_size, generator=g)
    t = torch.tensor([0.05, 0.5, 0.93])
    y = torch.tensor([0, 7, 10])  # 10: the null class
    with torch.no_grad():
        ours = model(x, timestep=t, class_labels=y, return_dict=False)[0]
        theirs = released_forward(state, spec, x, 1 - t, y)
    assert ours.shape == theirs.shape == x.shape
    torch.testing.assert_close(ours, -theirs, rtol=1e-4, atol=1e-5)


def test_dit_accels_rotary_tables_are_evas():
    cos, sin = rope_tables(32, 4)
    want_cos, want_sin = released_rope_tables(32, 4)
    torch.testing.assert_close(cos, want_cos) and torch.testing.assert_close(sin, want_sin)


def test_what_is_not_a_released_lightningdit_is_one_line():
    spec = tiny()
    state = released_state_dict(spec)
    without = {k: v for k, v in state.items() if k != "blocks.1.mlp.w3.bias"}
    with pytest.raises(
        UserError, match="not the released network: it lacks transformer_blocks.1.mlp.w3.bias"
    ):
        load_lightningdit(without)
    misshapen = dict(state, **{"blocks.0.attn.proj.weight": torch.zeros(64, 32)})
    with pytest.raises(UserError, match=r"transformer_blocks.0.attn.proj.weight has shape \(64, 32\)"):
        load_lightningdit(misshapen)
    moved = dict(state, pos_embed=state["pos_embed"] + 0.01)
    with pytest.raises(UserError, match="pos_embed differs from the fixed sin-cos positional table"):
        load_lightningdit(moved)
    dit_like = dict(
        state,
        **{"final_layer.linear.weight": torch.zeros(64, 64), "final_layer.linear.bias": torch.zeros(64)},
    )
    with pytest.raises(UserError, match="learned sigma.*import-dit or import-sit"):
        spec_from_released(dit_like)


# --- the objective's and the sampler's additions -------------------------------------------------------------


def test_the_cosine_term_equals_hand_worked_values():
    from dit_accel.diffusion.flow import FlowMatching, cosine_distance

    # two positions (1 x 2 latents, 2 channels): orthogonal (cos 0) and parallel (cos 1)
    predicted = torch.tensor([[[[1.0, 1.0]], [[0.0, 1.0]]]])  # channel 0: (1, 1); channel 1: (0, 1)
    target = torch.tensor([[[[0.0, 2.0]], [[1.0, 2.0]]]])  # position 0: (0, 1) vs (1, 0); position 1: (2, 2)
    assert cosine_distance(predicted, target).item() == pytest.approx((1 - 0) / 2 + (1 - 1) / 2)
    flow = FlowMatching("linear", "lognormal", cosine_weight=1.0)
    x0, noise, t = torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), torch.tensor([0.5])
    terms = flow.loss_terms(predicted, x0, t, noise)  # the target velocity is 0 here: cos(v, 0) = 0
    assert terms["mse"].item() == pytest.approx((1 + 1 + 0 + 1) / 4)
    assert terms["cosine"].item() == pytest.approx(1.0)
    assert terms["loss"].item() == pytest.approx(0.75 + 1.0)
    assert flow.describe()["cosine_loss_weight"] == 1.0
    assert "cosine_loss_weight" not in FlowMatching().describe()  # what older runs recorded, unchanged


def test_the_time_shift_is_lightningdits_in_dit_accels_time():
    from dit_accel.diffusion.flow_sampling import shifted_time

    # theirs, u = 0 noise: u' = s u / (1 + (s - 1) u); ours t = 1 - u
    for s in (0.3, 1.0, 3.0):
        for u in (0.0, 0.1, 0.5, 0.9, 1.0):
            theirs = s * u / (1 + (s - 1) * u)
            assert shifted_time(1 - u, s) == pytest.approx(1 - theirs, abs=1e-12)
    assert shifted_time(0.5, 0.3) == pytest.approx(0.5 / 0.65)  # 0.76923..., hand-worked
    with pytest.raises(UserError, match="--time-shift must be a positive number"):
        shifted_time(0.5, 0.0)


def test_the_protocol_sets_the_flags_and_refuses_one_given_beside_it_unless_overridden():
    from dit_accel.sample.args import apply_protocol, build_parser

    args = build_parser().parse_args(
        ["--checkpoint", "x", "--npz", "s.npz", "--protocol", "lightningdit-xl1-800ep"]
    )
    assert apply_protocol(args) == []
    assert (args.sampler, args.steps, args.cfg_scale, args.guidance) == ("ode", 249, 6.7, "first3")
    assert (args.cfg_interval, args.time_shift, args.ode_solver) == ((0.0, 0.875), 0.3, "euler")
    assert (args.labels, args.tf32) == ("random", True)
    given = build_parser().parse_args(["--checkpoint", "x", "--protocol", "dit-xl2", "--cfg-scale", "4"])
    with pytest.raises(UserError, match="--cfg-scale is set by --protocol dit-xl2 .to 1.5., and given too"):
        apply_protocol(given)
    given = build_parser().parse_args(
        ["--checkpoint", "x", "--protocol", "dit-xl2", "--cfg-scale", "4", "--override"]
    )
    assert apply_protocol(given) == ["--cfg-scale"] and given.cfg_scale == 4
    plain = build_parser().parse_args(["--checkpoint", "x"])
    assert apply_protocol(plain) == [] and (plain.steps, plain.guidance, plain.labels) == (
        250,
        "all",
        "balanced",
    )


@pytest.mark.parametrize(
    "name", ["dit-xl2", "sit-xl2", "repa-sit-xl2", "lightningdit-xl1-64ep", "lightningdit-xl1-800ep"]
)
def test_every_protocol_passes_its_own_samplers_flag_check(name):
    """The command's two steps in its order (apply_protocol, then check_sampler_flags for the protocol's
    sampler): the DiT, SiT and REPA protocols once set LightningDiT's time shift too, which their samplers
    refuse ("--time-shift is read by --sampler ode only"), so `--protocol` never ran for them."""
    from dit_accel.sample.args import PROTOCOLS, apply_protocol, build_parser, check_sampler_flags

    args = build_parser().parse_args(["--checkpoint", "x", "--npz", "s.npz", "--protocol", name])
    apply_protocol(args)
    check_sampler_flags(args, PROTOCOLS[name].sampler)
    assert args.sampler == PROTOCOLS[name].sampler and args.cfg_scale == PROTOCOLS[name].cfg_scale
    if PROTOCOLS[name].sampler == "ddpm":
        assert args.time_shift == 1.0 and args.cfg_interval == (0.0, 1.0)  # the defaults, unread


def test_a_ddpm_run_samples_under_the_dit_protocol(tmp_path, capsys):
    """The real command on a DiT run: `--protocol dit-xl2` (250 DDPM steps, cfg 1.5 on channels 0-2)."""
    from test_evaluate import write_tiny_pixel_workspace
    from test_sample import fresh_accelerate_state

    from dit_accel.sample.command import main as sample
    from dit_accel.train.loop import main as train

    write_tiny_pixel_workspace(tmp_path)
    argv = ["--plan", tmp_path / "plan" / "plan.json", "--data-path", tmp_path / "images"]
    argv += ["--output-dir", tmp_path / "run", "--max-steps", 1, "--num-workers", 0, "--no-progress-bar"]
    with fresh_accelerate_state():
        assert train([str(a) for a in [*argv, "--no-tensorboard"]]) == 0
    flags = ["--checkpoint", tmp_path / "run", "--protocol", "dit-xl2", "--num-samples", 4, "--batch-size", 4]
    with fresh_accelerate_state():
        assert sample([str(a) for a in [*flags, "--npz", tmp_path / "s.npz", "--no-ema"]]) == 0
    assert "ddpm 250 steps, cfg 1.5" in capsys.readouterr().out
    with np.load(tmp_path / "s.npz") as made:
        assert made["arr_0"].shape == (4, 16, 16, 3)


def test_random_labels_are_one_list_whatever_the_processes():
    from dit_accel.sample.generate import random_labels

    labels = random_labels(1000, 7, seed=3)
    assert labels.min() >= 0 and labels.max() == 6 and len(set(labels.tolist())) == 7
    assert (labels == random_labels(1000, 7, seed=3)).all() and not (
        labels == random_labels(1000, 7, seed=4)
    ).all()
    counts = np.bincount(labels, minlength=7)
    assert counts.max() - counts.min() > 1  # not balanced: drawn


def released_sampler(state, spec, noise, y, cfg_scale, interval_start, shift, points):
    """hustvl/LightningDiT's ODE sampling (inference.py, transport.Sampler.sample_ode with torchdiffeq's euler
    on the shifted grid, forward_with_cfg guiding channels 0-2 where t >= cfg_interval_start), their time."""
    grid = torch.linspace(0, 1, points, dtype=torch.float64)
    grid = shift * grid / (1 + (shift - 1) * grid)
    x, null = noise.clone(), torch.full_like(y, spec.num_classes)
    for t, t_next in zip(grid[:-1].tolist(), grid[1:].tolist()):
        times = torch.full((2 * len(x),), t, dtype=torch.float32)
        out = released_forward(state, spec, torch.cat([x, x]), times, torch.cat([y, null]))
        cond, uncond = out.chunk(2)
        guided = uncond[:, :3] + cfg_scale * (cond[:, :3] - uncond[:, :3])
        velocity = torch.cat([guided if t >= interval_start else cond[:, :3], cond[:, 3:]], dim=1)
        x = x + (t_next - t) * velocity
    return x


def test_an_imported_checkpoint_samples_under_the_protocol_as_the_released_sampler_does():
    """The 64-epoch protocol (249 Euler steps on the 0.3-shifted grid, cfg 10 on channels 0-2 from their
    t = 0.10) through dit-accel's sampler on the imported network, against the released sampler on the released
    state dict, from the same noise."""
    from dit_accel.sample.args import apply_protocol, build_parser
    from dit_accel.sample.generate import SampleSettings, sample_generators, sample_latents

    spec = tiny(num_classes=10, resolution=32)
    state = released_state_dict(spec, seed=5)
    model, _ = load_lightningdit(state)
    args = build_parser().parse_args(["--checkpoint", "x", "--protocol", "lightningdit-xl1-64ep"])
    apply_protocol(args)
    settings = SampleSettings(
        cfg_scale=args.cfg_scale,
        steps=args.steps,
        sampler=args.sampler,
        guidance=args.guidance,
        ode_solver=args.ode_solver,
        cfg_low=args.cfg_interval[0],
        cfg_high=args.cfg_interval[1],
        time_shift=args.time_shift,
    )
    labels, indices = [3, 7], [0, 1]
    with torch.no_grad():
        ours = sample_latents(model.eval(), spec, labels, indices, settings)
        noise = torch.stack(
            [torch.randn(32, 2, 2, generator=g) for g in sample_generators(settings.seed, indices)]
        )
        theirs = released_sampler(state, spec, noise, torch.tensor(labels), 10.0, 0.10, 0.3, 250)
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)


def test_import_lightningdit_then_sample_under_the_protocol_through_the_vavae(tmp_path, capsys):
    """The commands a user types: a released checkpoint (made here) imported with its latent statistics,
    then an evaluation batch sampled under the 64-epoch protocol and decoded by a VA-VAE .pt."""
    import json

    from test_vavae import ldm_state

    from dit_accel.cli import main

    spec = tiny(num_classes=10, resolution=32)
    torch.save(released_state_dict(spec), tmp_path / "lightningdit.pt")
    torch.save(
        {"mean": torch.randn(1, 32, 1, 1), "std": torch.rand(1, 32, 1, 1) + 0.5}, tmp_path / "stats.pt"
    )
    torch.save({"state_dict": ldm_state()}, tmp_path / "vavae.pt")
    run = tmp_path / "run"
    argv = [
        "--checkpoint",
        tmp_path / "lightningdit.pt",
        "--latent-stats",
        tmp_path / "stats.pt",
        "--out",
        run,
    ]
    assert main(["import-lightningdit", *map(str, argv)]) == 0
    out = capsys.readouterr().out
    assert "time reversed" in out and "--protocol lightningdit-xl1-64ep" in out
    sidecar = json.loads((run / "checkpoints" / "step_00000000" / "dit_accel.json").read_text())
    assert sidecar["objective"]["cosine_loss_weight"] == 1.0 and sidecar["latent_norm"]["kind"] == "channel"
    npz = tmp_path / "samples.npz"
    argv = ["--checkpoint", run, "--vae", tmp_path / "vavae.pt", "--protocol", "lightningdit-xl1-64ep"]
    argv += ["--npz", npz, "--num-samples", "6", "--batch-size", "3"]
    assert main(["sample", *map(str, argv)]) == 0
    with np.load(npz) as batch:
        assert batch["arr_0"].shape == (6, 32, 32, 3) and batch["arr_0"].dtype == np.uint8
        from dit_accel.sample.generate import random_labels

        assert (batch["arr_1"] == random_labels(6, 10, seed=0)).all()  # the protocol's random labels
    assert main(["sample", *map(str, argv[:6]), "--cfg-scale", "4", "--npz", str(tmp_path / "x.npz")]) == 2
    assert "--cfg-scale is set by --protocol lightningdit-xl1-64ep" in capsys.readouterr().err


@pytest.mark.slow  # inductor compiles one block graph on the CPU: seconds
def test_compiled_checkpointed_blocks_give_the_eager_gradients():
    """The trainer's compile (one graph per block class, inside activation checkpointing) on a LightningDiT:
    the same loss and gradients as eager, one block checkpointed."""
    from dit_accel.models.compile import compile_blocks, compiled_blocks
    from dit_accel.models.dit import checkpointed_blocks, set_checkpointed_blocks

    spec = tiny(resolution=32)
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(4, 32, 2, 2, generator=g), torch.rand(4, generator=g), torch.tensor([0, 1, 2, 10])
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(spec)
        for layer in [b.adaLN_modulation[-1] for b in model.transformer_blocks] + [model.final_layer.linear]:
            torch.nn.init.normal_(layer.weight, std=0.02)  # past adaLN-Zero, so every block's gradient flows
        set_checkpointed_blocks(model, 1)
        if compiled:
            assert compile_blocks(model) == 2 and compiled_blocks(model) == 2
        assert checkpointed_blocks(model) == 1
        out = model(x, timestep=t, class_labels=y, return_dict=False)[0]
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager, eager_grads), (fast, fast_grads) = results
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
