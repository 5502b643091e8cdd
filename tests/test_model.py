"""The DiT network: tying, parameter counts, the timestep shift rule, checkpointing, and every weight format.

The original DiT is represented by `reference_dit_forward` below: an independent, plain-torch forward of the
original architecture written from its documented key layout (fused qkv, adaLN-Zero modulation, gated
residuals, final layer, unpatchify). `load_original_dit` is held to it with all weights random.
"""

from __future__ import annotations

import argparse
import json
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel
from diffusers.models.attention_processor import AttnProcessor2_0
from torch.utils._python_dispatch import TorchDispatchMode

from dit_accel.errors import UserError
from dit_accel.models.diffusers_format import SIDECAR_NAME, export_diffusers, load_model, save_model
from dit_accel.models.dit import (
    as_model_fn,
    build_model,
    checkpointed_blocks,
    conditioning_embedder,
    count_trainable_params,
    drop_labels,
    embedders_tied,
    null_class,
    set_checkpointed_blocks,
    spec_from_config,
    spec_from_model,
    timestep_freq_shift,
)
from dit_accel.models.original_dit import load_original_dit
from planner.spec import FAMILY, PATCH_SIZES, custom_spec, model_spec

TINY = dict(depth=2, hidden=64, heads=4, patch=2, resolution=64)  # 8x8 latents, 16 tokens


def tiny_spec(**overrides):
    fields = {**TINY, "num_classes": 10, **overrides}
    return custom_spec(**fields)


def tiny_model(shift=1, seed=0, **overrides):
    """PyTorch's default init: every weight non-zero, unlike the DiT init (which zeroes the output)."""
    torch.manual_seed(seed)
    return build_model(tiny_spec(**overrides), timestep_freq_shift=shift, init="torch").eval()


def inputs(batch=3, channels=4, size=8, num_classes=10, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, size, size, generator=generator)
    t = torch.tensor([0, 417, 999][:batch])
    y = torch.tensor([3, num_classes, 7][:batch])  # includes the null class
    return x, t, y


def run(model, x, t, y):
    with torch.no_grad():
        return model(x, timestep=t, class_labels=y).sample


# --- building --------------------------------------------------------------------------------------------


def _family_specs():
    for size in FAMILY:
        for patch in PATCH_SIZES:
            yield model_spec(f"DiT-{size}/{patch}", 256)
            yield model_spec(f"DiT-{size}/{patch}", 512, latents="online")
    yield model_spec("DiT-S/2", 64, latents="pixel")
    yield model_spec("DiT-B/4", 128, latents="pixel")
    yield model_spec("DiT-XL/2", 256, num_classes=10)
    yield tiny_spec()


@pytest.mark.parametrize(
    "spec", list(_family_specs()), ids=lambda s: f"{s.name}@{s.resolution}-{s.latents}-{s.num_classes}"
)
def test_trainable_params_equal_the_planner_for_the_family(spec):
    with torch.device("meta"):
        model = build_model(spec)
    assert embedders_tied(model)
    assert count_trainable_params(model) == spec.params_trainable
    # The stock layout would hold one embedder copy per block.
    assert sum(t.numel() for t in model.state_dict().values()) == spec.params_untied
    assert spec_from_config(model.config).params_trainable == spec.params_trainable


def test_xl2_has_the_paper_count():
    assert model_spec("DiT-XL/2", 256).params_trainable == 674_834_720


def test_attention_is_sdpa_and_the_null_class_has_a_row():
    model = tiny_model()
    assert all(isinstance(block.attn1.processor, AttnProcessor2_0) for block in model.transformer_blocks)
    table = conditioning_embedder(model).class_embedder.embedding_table
    assert table.num_embeddings == 11 and null_class(model) == 10 == null_class(spec_from_model(model))


def test_training_mode_does_not_drop_labels_inside_the_model():
    model = tiny_model()
    x, t, y = inputs()
    model.train()
    torch.manual_seed(0)
    first = model(x, timestep=t, class_labels=y).sample.detach()
    second = model(x, timestep=t, class_labels=y).sample.detach()
    model.eval()
    assert torch.equal(first, second) and torch.equal(first, run(model, x, t, y))


def test_drop_labels_once_per_sample_and_seeded():
    labels = torch.arange(20_000) % 10
    dropped = drop_labels(labels, 0.1, 10, torch.Generator().manual_seed(0))
    again = drop_labels(labels, 0.1, 10, torch.Generator().manual_seed(0))
    assert torch.equal(dropped, again)
    is_null = dropped == 10
    assert abs(is_null.float().mean().item() - 0.1) < 0.01
    assert torch.equal(dropped[~is_null], labels[~is_null])
    assert torch.equal(drop_labels(labels, 0.0, 10), labels)
    assert bool((drop_labels(labels, 1.0, 10) == 10).all())
    with pytest.raises(UserError):
        drop_labels(labels, 1.5, 10)


def test_dit_initialisation_is_adaln_zero():
    torch.manual_seed(0)
    model = build_model(tiny_spec()).eval()
    x, t, y = inputs()
    assert torch.equal(run(model, x, t, y), torch.zeros(3, 8, 8, 8))
    tokens = torch.randn(3, 16, 64)
    with torch.no_grad():
        out = model.transformer_blocks[0](tokens, timestep=t, class_labels=y)
    assert torch.equal(out, tokens)  # each block starts as the identity
    # ...but the layers that must learn are not zero
    assert model.transformer_blocks[0].attn1.to_q.weight.abs().sum() > 0
    assert conditioning_embedder(model).class_embedder.embedding_table.weight.std().item() == pytest.approx(
        0.02, rel=0.1
    )


def test_q_k_v_start_as_one_fused_xavier_projection():
    """The paper's network has one (3D, D) qkv linear; Xavier over it bounds each weight by sqrt(6 / 4D),
    1/sqrt(2) of what Xavier on each of diffusers' separate D x D projections would give."""
    torch.manual_seed(0)
    hidden = 256
    model = build_model(custom_spec(depth=2, hidden=hidden, heads=4, patch=2, resolution=64))
    fused_bound, separate_bound = math.sqrt(6 / (4 * hidden)), math.sqrt(6 / (2 * hidden))
    for block in model.transformer_blocks:
        parts = [getattr(block.attn1, name).weight for name in ("to_q", "to_k", "to_v")]
        for weight in parts:
            assert 0.99 * fused_bound < weight.abs().max().item() <= fused_bound < separate_bound
            assert weight.var().item() == pytest.approx(1 / (2 * hidden), rel=0.05)  # bound^2 / 3
        assert not torch.equal(parts[0], parts[1])  # three rows of one draw, not one row three times
    out = (
        model.transformer_blocks[0].attn1.to_out[0].weight
    )  # the other linears keep Xavier on their own shape
    assert out.abs().max().item() > 0.99 * separate_bound


def test_every_layer_starts_as_the_dit_recipe_draws_it():
    """Layer by layer, the distribution the DiT recipe draws: Xavier-uniform linears (q, k, v as one fused draw,
    tested above) and patch kernel (flattened), normal(0, 0.02) for the class table and the timestep MLP,
    zero biases, zero adaLN-Zero and final layers, a fixed (untrained) positional table. The original code's
    model was held to this tensor by tensor in docs/digits-comparison.md."""
    torch.manual_seed(0)
    spec = custom_spec(depth=2, hidden=128, heads=4, patch=2, resolution=64)
    model = build_model(spec)
    embedder = conditioning_embedder(model)
    normal = {embedder.timestep_embedder.linear_1, embedder.timestep_embedder.linear_2}
    zero = {model.proj_out_1, model.proj_out_2, *(block.norm1.linear for block in model.transformer_blocks)}
    fused = {getattr(b.attn1, n) for b in model.transformer_blocks for n in ("to_q", "to_k", "to_v")}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 + 2 * 7 + 2  # timestep MLP, per block q k v out ff1 ff2 adaLN, final two
    for layer in linears:
        assert torch.count_nonzero(layer.bias) == 0
        weight = layer.weight.detach()
        if layer in zero:
            assert torch.count_nonzero(weight) == 0
        elif layer in normal:
            assert weight.std().item() == pytest.approx(0.02, rel=0.05) and abs(weight.mean().item()) < 1e-3
        elif layer not in fused:
            bound = math.sqrt(6 / (weight.shape[0] + weight.shape[1]))
            assert 0.98 * bound < weight.abs().max().item() <= bound
            assert weight.var().item() == pytest.approx(bound**2 / 3, rel=0.05)
    conv = model.pos_embed.proj
    bound = math.sqrt(6 / (conv.weight[0].numel() + conv.weight.shape[0]))  # fan in C*p*p, fan out hidden
    assert 0.98 * bound < conv.weight.abs().max().item() <= bound and torch.count_nonzero(conv.bias) == 0
    table = embedder.class_embedder.embedding_table.weight
    assert table.shape == (spec.num_classes + 1, 128)  # the null class's row too
    assert table.std().item() == pytest.approx(0.02, rel=0.05)
    assert "pos_embed.pos_embed" not in dict(model.named_parameters())  # fixed sin-cos, never trained


# --- the timestep shift rule ------------------------------------------------------------------------------


def original_timestep_features(t: torch.Tensor) -> torch.Tensor:
    """The original DiT's 256 timestep features: half = 128, cos then sin, frequencies exp(-ln 1e4 * i / 128)."""
    half = 128
    freqs = np.exp(-math.log(10000.0) * np.arange(half) / half)
    args = t.double().numpy()[:, None] * freqs[None]
    return torch.from_numpy(np.concatenate([np.cos(args), np.sin(args)], axis=1)).float()


def diffusers_timestep_features(t: torch.Tensor) -> torch.Tensor:
    """diffusers' Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1): frequencies exp(-ln 1e4 * i / 127)."""
    half = 128
    freqs = np.exp(-math.log(10000.0) * np.arange(half) / (half - 1))
    args = t.double().numpy()[:, None] * freqs[None]
    return torch.from_numpy(np.concatenate([np.cos(args), np.sin(args)], axis=1)).float()


def test_shift_rule_both_directions():
    t = torch.tensor([0, 1, 250, 999])
    built = tiny_model()
    assert timestep_freq_shift(built) == 1
    # float32 angles up to 999 round by ~6e-5; the two rules differ by up to ~1 at t = 999
    torch.testing.assert_close(
        conditioning_embedder(built).time_proj(t), diffusers_timestep_features(t), atol=1e-4, rtol=0
    )
    imported = tiny_model(shift=0)
    assert timestep_freq_shift(imported) == 0
    torch.testing.assert_close(
        conditioning_embedder(imported).time_proj(t), original_timestep_features(t), atol=1e-4, rtol=0
    )
    assert (original_timestep_features(t) - diffusers_timestep_features(t)).abs().max() > 0.5
    # The difference is real: same weights, different outputs.
    x, tt, y = inputs()
    assert not torch.allclose(run(built, x, tt, y), run(imported, x, tt, y), atol=1e-4)
    with pytest.raises(UserError, match="timestep_freq_shift"):
        tiny_model(shift=2)


# --- selective activation checkpointing ------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3])
def test_checkpointing_first_n_blocks_keeps_gradients(n):
    reference, model = tiny_model(depth=3), tiny_model(depth=3)
    set_checkpointed_blocks(model, n)
    assert checkpointed_blocks(model) == n
    assert list(model.state_dict()) == list(reference.state_dict())  # names unchanged
    calls = [0] * 3
    for index, block in enumerate(model.transformer_blocks):
        block.attn1.register_forward_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    x, t, y = inputs()
    for net in (reference, model):
        net.train()
        (net(x, timestep=t, class_labels=y).sample ** 2).mean().backward()
    # Each checkpointed block ran its attention twice (forward + recompute); the others once.
    assert calls == [2 if i < n else 1 for i in range(3)]
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-7, msg=name)


class WeightCasts(TorchDispatchMode):
    """Every copy made of a parameter (autocast's casts), by parameter name, with a weak reference to its storage
    so a test can ask which copies are still alive (held by autocast's cache or by autograd)."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
        self.copies: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.copies.setdefault(name, []).append((out.dtype, weakref.ref(out.untyped_storage())))
        return out

    def alive(self) -> set[str]:
        return {name for name, copies in self.copies.items() if any(ref() is not None for _, ref in copies)}


def _block_of(name):
    """The block index of a block's own parameter (not the shared embedder's), else None."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "transformer_blocks" and ".norm1.emb." not in name else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_checkpointed_blocks_cast_weights_without_autocast_cache(dtype):
    """autocast caches every weight copy until it exits (after the loss): a checkpointed block's copies would
    outlive its forward although nothing of it is saved. The checkpointed blocks cast uncached, in the outer
    autocast's dtype; stored blocks, the shared embedder (also when a checkpointed block calls it) and the
    outer layers stay cached."""
    model = tiny_model(depth=3).train()
    set_checkpointed_blocks(model, 2)
    x, t, y = inputs()
    casts = WeightCasts(model)
    with casts, torch.autocast("cpu", dtype=dtype):
        out = model(x, timestep=t, class_labels=y).sample
        alive = casts.alive()  # still inside autocast, as at the loss
    assert out.dtype == dtype and {d for copies in casts.copies.values() for d, _ in copies} == {dtype}
    block_params = {name for name, _ in model.named_parameters() if _block_of(name) is not None}
    assert {name for name in block_params if _block_of(name) == 2} <= alive  # the stored block: cached
    assert not {name for name in alive if _block_of(name) in (0, 1)}  # checkpointed blocks: uncached, gone
    assert {
        "transformer_blocks.0.norm1.emb.timestep_embedder.linear_2.weight",
        "pos_embed.proj.weight",
        "proj_out_2.weight",
    } <= alive
    # each weight was cast once in the forward: the shared embedder's copy served all four calls (cached)
    assert all(len(copies) == 1 for copies in casts.copies.values())


def test_checkpointed_blocks_outside_autocast_cast_nothing():
    """fp32 training and sampling: the checkpointed forward enters no autocast of its own."""
    model = tiny_model(depth=2).train()
    set_checkpointed_blocks(model, 2)
    x, t, y = inputs()
    casts = WeightCasts(model)
    with casts:
        out = model(x, timestep=t, class_labels=y).sample
        (out**2).mean().backward()
    assert casts.copies == {} and out.dtype == torch.float32


@pytest.mark.parametrize("n", [1, 3])
def test_checkpointed_gradients_under_autocast_equal_the_unchecked_models_exactly(n):
    """The uncached casts give the same values as the cached ones, and the shared embedder's gradient is summed
    through its one cached copy as without checkpointing, so bf16 gradients are bit-identical."""
    reference, model = tiny_model(depth=3), tiny_model(depth=3)
    set_checkpointed_blocks(model, n)
    x, t, y = inputs()
    for net in (reference, model):
        net.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (net(x, timestep=t, class_labels=y).sample.float() ** 2).mean()
        loss.backward()
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert torch.equal(p.grad, p_ref.grad), name


def test_checkpointing_can_be_changed_and_is_validated():
    model = tiny_model(depth=3)
    set_checkpointed_blocks(model, 3)
    set_checkpointed_blocks(model, 1)
    assert checkpointed_blocks(model) == 1 and "forward" not in model.transformer_blocks[2].__dict__
    for bad in (-1, 4, 1.5):
        with pytest.raises(UserError, match="from 0 to 3"):
            set_checkpointed_blocks(model, bad)
    x, t, y = inputs()
    with torch.no_grad():  # no recompute without grad, same outputs
        torch.testing.assert_close(
            model(x, timestep=t, class_labels=y).sample, run(tiny_model(depth=3), x, t, y)
        )


# --- diffusers layout -------------------------------------------------------------------------------------


def test_save_model_loads_in_stock_diffusers_with_the_same_outputs(tmp_path):
    model = tiny_model()
    save_model(model, tmp_path / "dit")
    stock = DiTTransformer2DModel.from_pretrained(tmp_path / "dit").eval()
    assert stock.transformer_blocks[0].norm1.emb is not stock.transformer_blocks[1].norm1.emb
    x, t, y = inputs()
    torch.testing.assert_close(run(stock, x, t, y), run(model, x, t, y), rtol=0, atol=1e-6)
    again = load_model(tmp_path / "dit")
    assert embedders_tied(again) and spec_from_model(again) == spec_from_model(model)
    torch.testing.assert_close(run(again.eval(), x, t, y), run(model, x, t, y), rtol=0, atol=0)


def test_stock_untied_folder_and_pipeline_folder_load_tied(tmp_path):
    spec = tiny_spec()
    torch.manual_seed(3)
    stock = DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    ).eval()
    stock.transformer_blocks[1].norm1.emb.load_state_dict(stock.transformer_blocks[0].norm1.emb.state_dict())
    stock.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    model = load_model(tmp_path / "pipe")
    assert embedders_tied(model) and timestep_freq_shift(model) == 1
    assert count_trainable_params(model) == spec.params_trainable
    x, t, y = inputs()
    torch.testing.assert_close(run(model.eval(), x, t, y), run(stock, x, t, y), rtol=0, atol=0)


def test_deduplicated_state_dict_loads(tmp_path):
    """Accelerate's save_state drops shared tensors: only one block keeps the embedder."""
    from dit_accel.models.diffusers_format import load_diffusers_state_dict

    source, target = tiny_model(seed=0), tiny_model(seed=1)
    state = {
        k: v for k, v in source.state_dict().items() if not k.startswith("transformer_blocks.0.norm1.emb.")
    }
    load_diffusers_state_dict(target, state)
    assert embedders_tied(target)
    x, t, y = inputs()
    torch.testing.assert_close(run(target, x, t, y), run(source, x, t, y), rtol=0, atol=0)


def test_disagreeing_embedder_copies_are_refused_naming_the_block(tmp_path):
    torch.manual_seed(3)
    stock = DiTTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=3,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    for block in stock.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(stock.transformer_blocks[0].norm1.emb.state_dict())
    with torch.no_grad():
        stock.transformer_blocks[2].norm1.emb.timestep_embedder.linear_2.bias[0] += 1e-3
    stock.save_pretrained(tmp_path / "t")
    with pytest.raises(
        UserError, match=r"block 2's embedder copy \(norm1.emb.timestep_embedder.linear_2.bias\)"
    ):
        load_model(tmp_path / "t")


def test_shift_zero_round_trips_and_export_refuses_without_consent(tmp_path):
    model = tiny_model(shift=0)
    save_model(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / SIDECAR_NAME).read_text())["timestep_freq_shift"] == 0
    again = load_model(tmp_path / "m")
    assert timestep_freq_shift(again) == 0
    x, t, y = inputs()
    torch.testing.assert_close(run(again.eval(), x, t, y), run(model, x, t, y), rtol=0, atol=0)
    with pytest.raises(UserError, match="allow-freq-shift-change"):
        export_diffusers(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()  # nothing half-written
    with pytest.warns(UserWarning, match="shift"):
        export_diffusers(model, tmp_path / "export", allow_freq_shift_change=True)
    export_diffusers(tiny_model(), tmp_path / "export_ok")  # shift 1: no question asked


def test_saving_refuses_to_overwrite_unless_asked(tmp_path):
    save_model(tiny_model(seed=0), tmp_path / "m")
    with pytest.raises(UserError, match="not an empty folder"):
        save_model(tiny_model(seed=1), tmp_path / "m")
    save_model(tiny_model(seed=1), tmp_path / "m", overwrite=True)
    x, t, y = inputs()
    torch.testing.assert_close(
        run(load_model(tmp_path / "m").eval(), x, t, y), run(tiny_model(seed=1), x, t, y)
    )
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging folders left behind


def test_saved_model_folders_get_umask_permissions(tmp_path):
    """A reported bug: save_model left mkdtemp's 0700 folder (and 0600 files), unreadable by a cluster's other users."""
    from dit_accel.atomic import permissions

    folder = save_model(tiny_model(), tmp_path / "m")
    assert folder.stat().st_mode & 0o777 == permissions(0o777)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
        "dit_accel.json",
    ]
    assert all(p.stat().st_mode & 0o777 == permissions(0o666) for p in folder.iterdir())


def test_bad_folders_give_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model(tmp_path / "empty")
    save_model(tiny_model(), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_layers"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / SIDECAR_NAME).unlink()
    with pytest.raises(UserError, match="missing"):
        load_model(tmp_path / "m")


# --- original DiT checkpoints -----------------------------------------------------------------------------


def sincos_table(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sin-cos positional table (MAE style): first half encodes the column, second the row."""

    def one_axis(d, positions):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        angles = np.outer(positions, omega)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    table = np.concatenate([one_axis(dim // 2, cols.ravel()), one_axis(dim // 2, rows.ravel())], axis=1)
    return torch.from_numpy(table).float()[None]


def original_state_dict(
    depth=2, hidden=64, in_channels=4, out_channels=8, patch=2, latent=8, num_classes=10, seed=0
):
    """A random original-layout DiT state dict (no zero-init: every path carries signal)."""
    g = torch.Generator().manual_seed(seed)

    def lin(out_f, in_f, prefix):
        return {
            f"{prefix}.weight": torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f),
            f"{prefix}.bias": 0.1 * torch.randn(out_f, generator=g),
        }

    d = hidden
    sd = {
        "pos_embed": sincos_table(d, latent // patch),
        "x_embedder.proj.weight": torch.randn(d, in_channels, patch, patch, generator=g)
        / math.sqrt(in_channels * patch * patch),
        "x_embedder.proj.bias": 0.1 * torch.randn(d, generator=g),
        "y_embedder.embedding_table.weight": torch.randn(num_classes + 1, d, generator=g),
    }
    sd.update(lin(d, 256, "t_embedder.mlp.0"))
    sd.update(lin(d, d, "t_embedder.mlp.2"))
    for n in range(depth):
        sd.update(lin(3 * d, d, f"blocks.{n}.attn.qkv"))
        sd.update(lin(d, d, f"blocks.{n}.attn.proj"))
        sd.update(lin(4 * d, d, f"blocks.{n}.mlp.fc1"))
        sd.update(lin(d, 4 * d, f"blocks.{n}.mlp.fc2"))
        sd.update(lin(6 * d, d, f"blocks.{n}.adaLN_modulation.1"))
    sd.update(lin(2 * d, d, "final_layer.adaLN_modulation.1"))
    sd.update(lin(patch * patch * out_channels, d, "final_layer.linear"))
    return sd


def reference_dit_forward(sd, x, t, y, heads):
    """The original DiT architecture in plain torch, from the key layout alone."""
    weight = lambda name: sd[f"{name}.weight"]  # noqa: E731
    linear = lambda h, name: F.linear(h, sd[f"{name}.weight"], sd[f"{name}.bias"])  # noqa: E731
    layer_norm = lambda h: F.layer_norm(h, (h.shape[-1],), eps=1e-6)  # noqa: E731
    modulate = lambda h, shift, scale: h * (1 + scale[:, None]) + shift[:, None]  # noqa: E731
    d, _, p, _ = weight("x_embedder.proj").shape
    n, _, size, _ = x.shape
    h = (
        F.conv2d(x, weight("x_embedder.proj"), sd["x_embedder.proj.bias"], stride=p)
        .flatten(2)
        .transpose(1, 2)
    )
    h = h + sd["pos_embed"]
    c = linear(F.silu(linear(original_timestep_features(t), "t_embedder.mlp.0")), "t_embedder.mlp.2")
    c = c + sd["y_embedder.embedding_table.weight"][y]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    head_dim = d // heads
    for b in range(depth):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = linear(
            F.silu(c), f"blocks.{b}.adaLN_modulation.1"
        ).chunk(6, dim=1)
        q, k, v = (
            linear(modulate(layer_norm(h), shift_msa, scale_msa), f"blocks.{b}.attn.qkv")
            .reshape(n, -1, 3, heads, head_dim)
            .permute(2, 0, 3, 1, 4)
        )
        attention = torch.softmax(q @ k.transpose(-1, -2) * head_dim**-0.5, dim=-1) @ v
        h = h + gate_msa[:, None] * linear(
            attention.transpose(1, 2).reshape(n, -1, d), f"blocks.{b}.attn.proj"
        )
        hidden = F.gelu(
            linear(modulate(layer_norm(h), shift_mlp, scale_mlp), f"blocks.{b}.mlp.fc1"), approximate="tanh"
        )
        h = h + gate_mlp[:, None] * linear(hidden, f"blocks.{b}.mlp.fc2")
    shift, scale = linear(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    h = linear(modulate(layer_norm(h), shift, scale), "final_layer.linear")
    grid, out = size // p, h.shape[-1] // (p * p)
    h = h.reshape(n, grid, grid, p, p, out)
    return torch.einsum("nhwpqc->nchpwq", h).reshape(n, out, size, size)


@pytest.mark.parametrize("channels", [(4, 8), (3, 3)], ids=["latent-learned-sigma", "pixel-fixed-sigma"])
def test_original_checkpoint_reproduces_the_reference_forward(channels):
    in_channels, out_channels = channels
    sd = original_state_dict(in_channels=in_channels, out_channels=out_channels)
    model = load_original_dit(sd, heads=4).eval()
    spec = spec_from_model(model)
    assert (spec.depth, spec.hidden, spec.heads, spec.patch, spec.latent_size, spec.num_classes) == (
        2,
        64,
        4,
        2,
        8,
        10,
    )
    assert (
        spec.latents == ("pixel" if in_channels == 3 else "precomputed") and spec.out_channels == out_channels
    )
    assert timestep_freq_shift(model) == 0 and embedders_tied(model)
    x, t, y = inputs(channels=in_channels)
    expected = reference_dit_forward(sd, x, t, y, heads=4)
    assert expected.abs().mean() > 0.1  # a meaningful signal, not zeros
    torch.testing.assert_close(run(model, x, t, y), expected, rtol=1e-4, atol=1e-4)


def test_original_training_checkpoint_forms(tmp_path):
    ema, raw = original_state_dict(seed=1), original_state_dict(seed=2)
    x, t, y = inputs()
    expected_ema, expected_raw = (reference_dit_forward(sd, x, t, y, heads=4) for sd in (ema, raw))
    wrapped = {"model": {f"module.{k}": v for k, v in raw.items()}, "ema": ema}
    torch.testing.assert_close(
        run(load_original_dit(wrapped, heads=4), x, t, y), expected_ema, rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        run(load_original_dit(wrapped, heads=4, prefer="model"), x, t, y), expected_raw, rtol=1e-4, atol=1e-4
    )
    torch.save(ema, tmp_path / "plain.pt")
    torch.testing.assert_close(
        run(load_original_dit(tmp_path / "plain.pt", heads=4), x, t, y), expected_ema, rtol=1e-4, atol=1e-4
    )
    torch.save({**wrapped, "args": argparse.Namespace(model="DiT-XL/2")}, tmp_path / "train.pt")
    with pytest.raises(UserError, match="trust-checkpoint"):
        load_original_dit(tmp_path / "train.pt", heads=4)
    torch.testing.assert_close(
        run(load_original_dit(tmp_path / "train.pt", heads=4, trust_pickle=True), x, t, y),
        expected_ema,
        rtol=1e-4,
        atol=1e-4,
    )


def test_original_import_survives_save_and_load(tmp_path):
    sd = original_state_dict()
    save_model(load_original_dit(sd, heads=4), tmp_path / "imported")
    x, t, y = inputs()
    torch.testing.assert_close(
        run(load_model(tmp_path / "imported").eval(), x, t, y),
        reference_dit_forward(sd, x, t, y, heads=4),
        rtol=1e-4,
        atol=1e-4,
    )


def test_original_family_member_needs_no_heads():
    sd = original_state_dict(depth=12, hidden=384, latent=4, num_classes=3)  # DiT-S/2 shapes, 4x4 latents
    spec = spec_from_model(load_original_dit(sd))
    assert spec.name == "DiT-S/2" and spec.heads == 6 and spec.resolution == 32


def test_original_checkpoint_errors():
    sd = original_state_dict()
    with pytest.raises(UserError, match="--heads"):
        load_original_dit(sd)
    with pytest.raises(UserError, match=r"depth 3 \(wanted 2\)"):
        load_original_dit(original_state_dict(depth=3), spec=tiny_spec())
    bad_table = dict(sd, pos_embed=sd["pos_embed"] + 0.01)
    with pytest.raises(UserError, match="sin-cos"):
        load_original_dit(bad_table, heads=4)
    with pytest.raises(UserError, match="does not use: blocks.0.attn.q_norm.weight"):
        load_original_dit(dict(sd, **{"blocks.0.attn.q_norm.weight": torch.ones(16)}), heads=4)
    incomplete = {k: v for k, v in sd.items() if not k.startswith("blocks.1.mlp.fc2")}
    with pytest.raises(UserError, match="lacks blocks.1.mlp.fc2.weight"):
        load_original_dit(incomplete, heads=4)
    no_table = {k: v for k, v in sd.items() if k != "pos_embed"}
    with pytest.raises(UserError, match="latent size is unknown"):
        load_original_dit(no_table, heads=4)
    assert spec_from_model(load_original_dit(no_table, spec=tiny_spec())).latent_size == 8
    with pytest.raises(UserError, match="not an original DiT"):
        load_original_dit({"weight": torch.ones(1)})


def test_as_model_fn_calls_the_model():
    model = tiny_model()
    x, t, y = inputs()
    with torch.no_grad():
        torch.testing.assert_close(as_model_fn(model)(x, t, y), run(model, x, t, y), rtol=0, atol=0)
