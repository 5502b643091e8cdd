"""REPA: the DINOv2-layout encoder read offline, its input, the projector, the alignment term and where its
gradient goes, on a tiny DiT and a tiny randomly initialised encoder the tests save themselves."""

from __future__ import annotations

import json

import pytest
import torch

from dit_accel.errors import UserError
from dit_accel.models.dit import build_model, set_checkpointed_blocks
from dit_accel.repa.align import (
    PROJECTOR_PREFIX,
    Repa,
    TokenCapture,
    alignment_loss,
    attach_projector,
    without_projector,
)
from dit_accel.repa.encoder import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DinoV2,
    architecture_of,
    load_encoder,
    preprocess,
)
from dit_accel.run.weights import load_for_inference
from planner.repa import ENCODERS, encoder_by_shape, projector_params
from planner.spec import DiTSpec

TINY = dict(dim=64, depth=2, mlp_hidden=128)
SPEC = DiTSpec(name="DiT-S/2", depth=3, hidden=32, heads=2, patch=2, resolution=64, num_classes=4)
GRID = SPEC.latent_size // SPEC.patch  # 4 x 4 tokens: the encoder sees 56 px


def save_tiny_encoder(path, **overrides) -> dict:
    """A random DINOv2-layout encoder written as torch.hub's .pth would be; returns its state dict."""
    torch.manual_seed(0)
    encoder = DinoV2(**{**TINY, **overrides})
    with torch.no_grad():
        for param in encoder.parameters():
            param.normal_(0, 0.2)
    state = {key: value.clone() for key, value in encoder.state_dict().items()}
    torch.save(state, path)
    return state


@pytest.mark.parametrize("overrides", [{}, {"registers": 4}, {"swiglu": True}])
def test_the_architecture_is_read_from_the_weights_and_loads_strictly_frozen(tmp_path, overrides):
    state = save_tiny_encoder(tmp_path / "enc.pth", **overrides)
    assert architecture_of(state) == {**TINY, "swiglu": False, "registers": 0, "pos_grid": 37, **overrides}
    encoder = load_encoder(tmp_path, grid=GRID)  # a folder holding one file
    assert encoder.pos_embed.shape == (1, 1 + GRID * GRID, TINY["dim"])
    assert not any(p.requires_grad for p in encoder.parameters()) and not encoder.training
    loaded = encoder.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items() if key != "pos_embed")
    assert torch.equal(loaded["pos_embed"][:, 0], state["pos_embed"][:, 0])  # the class position kept
    tokens = encoder(preprocess(torch.rand(2, 3, 64, 64) * 2 - 1, GRID))
    assert tokens.shape == (2, GRID * GRID, TINY["dim"])  # patch tokens only: no class, no registers


def test_the_positions_resample_a_smooth_table_smoothly(tmp_path):
    """A table that is constant over the patches stays that constant at any grid; at 37 it is untouched."""
    encoder = DinoV2(**TINY)
    with torch.no_grad():
        encoder.pos_embed[:, 1:] = torch.linspace(-1, 1, TINY["dim"])
    native = encoder.pos_embed.detach().clone()
    encoder.resample_positions(37)
    assert torch.equal(encoder.pos_embed, native)
    encoder.resample_positions(16)
    torch.testing.assert_close(encoder.pos_embed[0, 1:], native[0, 1:257], atol=1e-5, rtol=0)


def test_the_planner_counts_every_published_encoder_exactly():
    """planner.repa's parameter counts equal the torch modules' for all eight DINOv2 backbones (on meta)."""
    for spec in ENCODERS.values():
        with torch.device("meta"):
            encoder = DinoV2(spec.dim, spec.depth, spec.mlp_hidden, spec.swiglu, spec.registers)
        assert sum(p.numel() for p in encoder.parameters()) == spec.params, spec.name
        assert encoder_by_shape(spec.dim, spec.depth, spec.registers) == spec
    assert round(ENCODERS["dinov2-b"].params / 1e6) == 87  # ViT-B/14 with its 37 x 37 table
    assert ENCODERS["dinov2-b"].resolution(16) == 224  # REPA's 256 px XL/2


def test_missing_or_unreadable_weights_are_one_line_naming_how_to_get_them(tmp_path):
    with pytest.raises(UserError, match="do not exist.*dinov2_vitb14_pretrain.pth"):
        load_encoder(tmp_path / "nope.pth", grid=GRID)
    with pytest.raises(UserError, match="holds no weights file"):
        load_encoder(tmp_path, grid=GRID)
    (tmp_path / "enc.pth").write_bytes(b"truncated")
    with pytest.raises(UserError, match="cannot be read"):
        load_encoder(tmp_path / "enc.pth", grid=GRID)
    torch.save({"something": torch.zeros(1)}, tmp_path / "enc.pth")
    with pytest.raises(UserError, match="not a DINOv2"):
        load_encoder(tmp_path / "enc.pth", grid=GRID)


def test_preprocess_maps_minus_one_to_one_onto_imagenet_statistics_at_the_encoders_side():
    gray = torch.zeros(1, 3, 64, 64)  # 0 in [-1, 1] is 0.5 in [0, 1]
    out = preprocess(gray, GRID)
    assert out.shape == (1, 3, 56, 56)
    expected = [(0.5 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    torch.testing.assert_close(out[0, :, 10, 10], torch.tensor(expected), rtol=0, atol=1e-6)


def test_alignment_loss_is_minus_the_mean_cosine_per_sample():
    target = torch.randn(2, 5, 8)
    torch.testing.assert_close(alignment_loss(3 * target, target), torch.full((2,), -1.0))
    torch.testing.assert_close(alignment_loss(-target, target), torch.full((2,), 1.0))
    a, b = torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)
    a[0, :, 0], b[0, 0, 0], b[0, 1, 1] = 1, 1, 1  # token 0 aligned (-1), token 1 orthogonal (0)
    torch.testing.assert_close(alignment_loss(a, b), torch.tensor([-0.5]))


def _dit_with_repa(tmp_path, depth: int):
    save_tiny_encoder(tmp_path / "enc.pth")
    torch.manual_seed(0)
    model = build_model(SPEC, init="torch")  # nonzero adaLN: every block's output depends on its weights
    repa = Repa.build(model, str(tmp_path / "enc.pth"), depth, 0.5, 48, GRID, "cpu")
    return model, repa


def _alignment_grads(model, repa, checkpointed: int) -> dict[str, torch.Tensor | None]:
    set_checkpointed_blocks(model, checkpointed)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    images, x = torch.rand(2, 3, 64, 64) * 2 - 1, torch.randn(2, 4, 8, 8)
    targets = repa.targets(images, torch.autocast("cpu", enabled=False))
    model(x, timestep=torch.tensor([3, 700]), class_labels=torch.tensor([0, 4]), return_dict=False)
    repa.loss(targets).mean().backward()
    return {name: param.grad for name, param in model.named_parameters()}


def test_the_gradient_reaches_blocks_up_to_k_and_the_projector_never_the_encoder(tmp_path):
    model, repa = _dit_with_repa(tmp_path, depth=2)
    grads = _alignment_grads(model, repa, checkpointed=0)
    nonzero = {name for name, grad in grads.items() if grad is not None and grad.abs().sum() > 0}
    assert {n for n in grads if n.startswith(PROJECTOR_PREFIX)} <= nonzero
    assert any(n.startswith("transformer_blocks.0.") for n in nonzero)
    assert any(n.startswith("transformer_blocks.1.attn1") for n in nonzero)
    assert any(n.startswith("pos_embed.") for n in nonzero)  # the patch embedding is before block 1
    assert not any(n.startswith(("transformer_blocks.2.", "proj_out")) for n in nonzero)  # after block K
    assert all(p.grad is None for p in repa.encoder.parameters())
    # Checkpointed blocks (the recompute does not fire the hook again) give the same gradients.
    again = _alignment_grads(model, repa, checkpointed=3)
    for name in nonzero:
        torch.testing.assert_close(again[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_capture_refuses_a_block_the_network_lacks_and_forgets_what_it_gave(tmp_path):
    model, repa = _dit_with_repa(tmp_path, depth=3)
    with pytest.raises(UserError, match="--repa-depth 4 is not a block of this 3-block network"):
        TokenCapture(model, 4)
    with torch.no_grad():
        model(torch.randn(1, 4, 8, 8), timestep=torch.tensor([1]), class_labels=torch.tensor([0]))
    assert repa.capture.take().shape == (1, GRID * GRID, TINY["dim"])
    with pytest.raises(RuntimeError, match="did not run"):
        repa.capture.take()


def test_the_projector_is_the_papers_mlp_and_sampling_weights_leave_it_out():
    torch.manual_seed(0)
    model = build_model(SPEC)
    plain = set(model.state_dict())
    attach_projector(model, encoder_dim=64, width=48)
    added = {n: p.numel() for n, p in model.named_parameters() if n.startswith(PROJECTOR_PREFIX)}
    assert sum(added.values()) == projector_params(SPEC.hidden, 64, 48)
    assert [type(m).__name__ for m in model.repa_projector] == ["Linear", "SiLU", "Linear", "SiLU", "Linear"]
    assert set(without_projector(model.state_dict())) == plain
    assert set(without_projector({"module." + n: 0 for n in model.state_dict()})) == {
        "module." + n for n in plain
    }


def test_the_ema_and_the_inference_weights_are_the_dit_alone():
    from dit_accel.train.ema import EMA

    torch.manual_seed(0)
    model = build_model(SPEC)
    attach_projector(model, encoder_dim=64, width=48)
    ema = EMA(model, decay=0.5)
    assert ema.shadow and not any(name.startswith(PROJECTOR_PREFIX) for name in ema.shadow)
    ema.update(model)
    sampling = build_model(SPEC)
    ema.copy_to(sampling)  # every parameter of the plain DiT has its EMA
    assert set(ema.shadow) == {n for n, p in sampling.named_parameters() if p.requires_grad}


# --- the planner ---------------------------------------------------------------------------------------


def test_the_plan_counts_the_encoder_the_projector_and_their_flops(tmp_path):
    from planner.errors import PlanError
    from planner.plan import make_plan
    from planner.planfile import parse_plan
    from planner.repa import ENCODERS, projector_fwd_macs_per_image
    from planner.search import repa_image_flops

    common = dict(gpus=1, vram="80G", global_batch=32, latents="online", sharding="ddp", max_micro_batch=32)
    plain, aligned = make_plan(**common), make_plan(**common, repa="dinov2-b")
    encoder, projector = ENCODERS["dinov2-b"], projector_params(1152, 768, 2048)
    assert aligned["decision"]["repa"] == "dinov2-b" and aligned["decision"]["repa_projector_dim"] == 2048
    assert parse_plan(aligned).decision.repa == "dinov2-b"  # plan.json reads back with its recipe
    assert plain["memory"]["repa"] == 0 and "repa_encode" not in plain["memory"]["phases"]
    at_step = aligned["memory"]["phases"]["optimizer_step"]["repa"]
    assert at_step == 4 * encoder.params + 4 * 4 * projector  # frozen fp32 encoder; projector w + g + AdamW
    encode = aligned["memory"]["phases"]["repa_encode"]["repa"]
    assert (
        encode - 4 * encoder.params - 3 * 4 * projector
        == encoder.activation_bytes(16, 32, 2) + 2 * encoder.largest_matrix_params()
    )  # a frozen weight's bf16 cast lives one op at a time (autocast caches only weights with gradients)
    decision = parse_plan(aligned).decision
    spec = parse_plan(aligned).spec()
    flops = 2 * encoder.fwd_macs_per_image(16) + 6 * projector_fwd_macs_per_image(256, 1152, 768, 2048)
    assert repa_image_flops(spec, decision) == flops
    # ViT-B/14 at 224 px: about 2 FLOPs per weight per token, 2 x 86M x 257 (its 22 GMACs)
    assert 40e9 < 2 * encoder.fwd_macs_per_image(16) < 48e9
    with pytest.raises(PlanError, match="unknown REPA encoder 'dinov2-q'"):
        make_plan(**common, repa="dinov2-q")


# --- the trainer's step --------------------------------------------------------------------------------


def _repa_plan(**overrides) -> dict:
    from planner.plan import make_plan

    tiny = dict(model="DiT-S/2", depth=3, hidden=32, heads=2, num_classes=4, resolution=32, latents="pixel")
    args = dict(gpus=1, vram="8G", global_batch=2, sharding="ddp", precision="fp32", repa="dinov2-s")
    return make_plan(**{**tiny, **args, "repa_projector_dim": 48, **overrides})


def test_the_micro_step_adds_coeff_times_the_alignment_to_the_objectives_loss(tmp_path, caplog):
    from dit_accel.models.dit import as_model_fn
    from dit_accel.train.config import TrainConfig
    from dit_accel.train.step import build_components, train_micro_step
    from planner.planfile import parse_plan

    save_tiny_encoder(tmp_path / "enc.pth")
    config = TrainConfig(plan="p", output_dir="o", data_path="d", repa_encoder=str(tmp_path / "enc.pth"))
    config.repa_depth, config.repa_projector_dim, config.repa_coeff = 2, 48, 0.25
    components = build_components(parse_plan(_repa_plan()), config, device="cpu")
    assert "no published DINOv2 backbone; the plan counted dinov2-s" in caplog.text
    model = components.model
    assert model.repa_projector[0].in_features == 32 and model.repa_projector[-1].out_features == 64
    assert any(
        group
        for group in components.optimizer.param_groups
        for p in group["params"]
        if p is model.repa_projector[0].weight
    )
    torch.manual_seed(3)
    batch = dict(
        x=torch.rand(2, 3, 32, 32) * 2 - 1,
        y=torch.tensor([1, 2]),
        drop=torch.tensor([False, True]),
        t=torch.tensor([10, 900]),
        noise=torch.randn(2, 3, 32, 32),
    )
    loss = train_micro_step(components, batch)
    assert model.repa_projector[0].weight.grad is not None
    with torch.no_grad():  # the same forward again: the objective's loss and the alignment, apart
        labels = torch.tensor([1, 4])
        targets = components.repa.targets(batch["x"], torch.autocast("cpu", enabled=False))
        terms = components.objective.training_losses(
            as_model_fn(model), batch["x"], labels, t=batch["t"], noise=batch["noise"]
        )
        align = alignment_loss(components.repa.capture.take(), targets)
    expected = terms["loss"].float().mean() + 0.25 * align.mean()
    torch.testing.assert_close(loss, expected)
    assert abs(0.25 * align.mean().item()) > 1e-4  # the term is there, not lost in rounding


@pytest.mark.parametrize(
    "plan, flags, message",
    [
        ({}, {}, "the plan was made for REPA with dinov2-s but --repa-encoder is not given"),
        ({"repa": ""}, {"repa_encoder": "E"}, "the plan counts no REPA encoder"),
        ({}, {"repa_encoder": "E", "repa_projector_dim": 2048}, "the plan counts a projector of width 48"),
        ({"repa": "dinov2-b"}, {"repa_encoder": "E", "repa_projector_dim": 48}, "holds dinov2-s's weights"),
    ],
)
def test_a_launch_that_contradicts_the_plans_repa_is_refused(tmp_path, plan, flags, message):
    from dit_accel.repa.training import build_for_run
    from planner.planfile import parse_plan

    class Flags:
        repa_encoder, repa_depth, repa_coeff, repa_projector_dim = None, 1, 0.5, 48

    if "repa_encoder" in flags:
        flags = {**flags, "repa_encoder": str(tmp_path / "enc.pth")}
    if "weights" in message:  # the others are refused before the encoder is read
        with torch.device("meta"):
            spec = ENCODERS["dinov2-s"]
            shaped = DinoV2(spec.dim, spec.depth, spec.mlp_hidden)  # a published shape, without its memory
        torch.save({k: torch.zeros(v.shape) for k, v in shaped.state_dict().items()}, tmp_path / "enc.pth")
    config = Flags()
    for name, value in flags.items():
        setattr(config, name, value)
    parsed = parse_plan(_repa_plan(**plan))
    with pytest.raises(UserError, match=message):
        build_for_run(build_model(parsed.spec()), config, parsed, parsed.spec(), "cpu")


# --- launched: 2 processes x zero2 x accumulation equal 1 process, and resume exactly -------------------

LAUNCH_STEPS = 4
LAUNCH_TINY = [
    *("--model", "DiT-S/4", "--depth", "2", "--hidden", "32", "--heads", "2", "--num-classes", "4"),
    *(
        "--resolution",
        "32",
        "--latents",
        "pixel",
        "--vram",
        "8G",
        "--global-batch",
        "8",
        "--precision",
        "fp32",
    ),
    *("--repa", "dinov2-s", "--repa-projector-dim", "16"),
]


def _projector(checkpoint) -> dict[str, torch.Tensor]:
    """The projector's trained weights in a checkpoint, DDP's model.safetensors or FSDP2's sharded save."""
    from safetensors.torch import load_file
    from test_train_fsdp import _dcp

    from dit_accel.run import checkpoint as ckpt

    if (checkpoint / ckpt.SHARDED_MODEL).is_dir():
        state = _dcp(checkpoint / ckpt.SHARDED_MODEL)
    else:
        state = load_file(str(checkpoint / ckpt.MODEL_WEIGHTS))
    found = {k.split(PROJECTOR_PREFIX, 1)[1]: v for k, v in state.items() if PROJECTOR_PREFIX in k}
    assert len(found) == 6, sorted(state)[:8]  # three linears, weight and bias
    return found


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One REPA run of 4 steps three ways: 1 process (micro 4 x accumulation 2), 2 processes under zero2
    (micro 2 x accumulation 2), and the 2-process run resumed from its step-2 checkpoint."""
    from test_train_e2e import run_in_process
    from test_train_fsdp import QUIET, _finish, _start

    from dit_accel.data.demo import write_demo_data
    from planner.cli import main as dit_plan

    root = tmp_path_factory.mktemp("repa")
    write_demo_data(root / "images", classes=4, per_class=8, resolution=32, seed=0)
    save_tiny_encoder(root / "enc.pth")
    plans = {}
    for name, shape in (
        ("one", ["--gpus", "1", "--sharding", "ddp", "--max-micro-batch", "4"]),
        ("two", ["--gpus", "2", "--sharding", "zero2", "--max-micro-batch", "2"]),
    ):
        assert dit_plan([*LAUNCH_TINY, *shape, "--out", str(root / f"plan_{name}")]) == 0
        plans[name] = root / f"plan_{name}"
    flags = ["--repa-encoder", root / "enc.pth", "--repa-depth", 1, "--repa-projector-dim", 16]
    flags += ["--max-steps", LAUNCH_STEPS]
    two = _start(plans["two"], root / "images", root / "run_two", *flags)  # in the background
    one = root / "run_one"  # meanwhile in this process: no launcher, no second interpreter to start
    args = ["--plan", plans["one"] / "plan.json", "--data-path", root / "images", "--output-dir", one]
    assert run_in_process([*args, *QUIET, *flags]) == 0
    out = {"one": one, "two": _finish(two)}
    checkpoint = out["two"] / "checkpoints" / "step_00000002"
    out["resumed"] = _finish(
        _start(plans["two"], root / "images", root / "run_resumed", *flags, "--resume", checkpoint)
    )
    out["plans"] = plans
    return out


@pytest.mark.launched
def test_two_zero2_processes_with_accumulation_equal_one_process(launched):
    from equivalence import layout_atol
    from test_train_fsdp import LR, _assert_close, _losses, _weights

    one, two = launched["one"], launched["two"]
    assert json.loads((launched["plans"]["two"] / "plan.json").read_text())["decision"]["grad_accum"] == 2
    assert (
        "no published DINOv2 backbone; the plan counted dinov2-s" in (two / "logs" / "rank0.log").read_text()
    )
    assert _losses(two) == pytest.approx(_losses(one), abs=1e-5)
    final = "checkpoints/step_00000004"
    # micro 2 x 2 ranks vs micro 4: the same sums in another order (tests/equivalence.py)
    atol = layout_atol(LR, LAUNCH_STEPS)
    _assert_close(_weights(two / final), _weights(one / final), atol, "network", layouts_differ=True)
    projector = _projector(two / final)
    _assert_close(projector, _projector(one / final), 1e-6, "projector")
    trained = _projector(two / "checkpoints/step_00000002")
    assert any(not torch.equal(projector[k], trained[k]) for k in projector)  # it trains with the model


@pytest.mark.launched
def test_a_resumed_repa_run_is_the_straight_run_and_its_ema_is_the_dit_alone(launched):
    from safetensors.torch import load_file
    from test_train_fsdp import _dcp

    from dit_accel.run import checkpoint as ckpt

    straight, resumed = (launched[name] / "checkpoints" / "step_00000004" for name in ("two", "resumed"))
    for folder in (ckpt.SHARDED_MODEL, "optimizer_0"):
        a, b = _dcp(straight / folder), _dcp(resumed / folder)
        assert a.keys() == b.keys() and any(PROJECTOR_PREFIX in k for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)), folder
    ema, resumed_ema = load_file(str(straight / ckpt.EMA_WEIGHTS)), load_file(str(resumed / ckpt.EMA_WEIGHTS))
    assert ema.keys() == resumed_ema.keys() and all(torch.equal(ema[k], resumed_ema[k]) for k in ema)
    assert not any(PROJECTOR_PREFIX in k for k in ema)
    model, _spec, info = load_for_inference(straight)  # sampling's network: the DiT alone
    assert info["weights"] == "ema" and not hasattr(model, "repa_projector")


def test_verify_traces_a_repa_step_and_the_planner_holds_to_it():
    """`dit-accel verify` on a REPA plan: the encoder (of the plan's published shape, on fake tensors), its
    working set and the projector's weights, gradients, AdamW state and saved tensors are the trace's "repa",
    the planner's component of the same name; every component and the peak within the usual tolerances."""
    from dit_accel.memtrace import comparison as memtrace_compare
    from dit_accel.memtrace import trace_training_step
    from planner.plan import make_plan
    from planner.planfile import parse_plan

    plan = parse_plan(
        make_plan(
            **dict(model="DiT-S/2", resolution=256, gpus=1, vram="80G", global_batch=16, sharding="ddp"),
            **dict(precision="bf16", max_micro_batch=16, objective="flow", repa="dinov2-b"),
        )
    )
    result = trace_training_step(plan, autocast_device="cpu")
    encoder = ENCODERS["dinov2-b"]
    projector = projector_params(384, encoder.dim, 2048)
    persistent = 4 * encoder.params + 3 * 4 * projector  # frozen fp32 encoder; projector w + AdamW's 2
    assert result.components["repa"] >= persistent
    assert result.components["weights"] == 4 * plan.spec().params_trainable  # the projector is not the DiT's
    comparison = memtrace_compare.compare(result, plan)
    assert comparison.outside_tolerance("bf16") == []
    assert abs(comparison.component_error("repa")) < 0.05  # held to 5% itself, beyond the 64 MiB floor
