"""The planner's architecture arithmetic, held to the paper's figures and to diffusers' real network."""

import itertools

import pytest
import torch
from diffusers import DiTTransformer2DModel

from planner.errors import PlanError
from planner.spec import FAMILY, PATCH_SIZES, custom_spec, model_spec, parse_model_name


def test_xl2_parameter_count_is_exact():
    spec = model_spec("DiT-XL/2", 256)
    assert spec.params_trainable == 674_834_720
    assert spec.params_untied == 749_826_464  # diffusers' per-block embedder copies
    assert spec.tokens == 256 and spec.latent_size == 32 and spec.out_channels == 8


@pytest.mark.parametrize("resolution, paper_gmacs", [(256, 118.6), (512, 524.6)])
def test_xl2_forward_macs_match_the_paper(resolution, paper_gmacs):
    spec = model_spec("DiT-XL/2", resolution)
    assert spec.fwd_macs_per_image / 1e9 == pytest.approx(paper_gmacs, rel=0.01)
    assert spec.fwd_flops_per_image == 2 * spec.fwd_macs_per_image


def _meta_diffusers_params(spec):
    """Unique trainable parameters of a meta-device DiTTransformer2DModel with its embedders tied."""
    with torch.device("meta"):
        model = DiTTransformer2DModel(
            num_attention_heads=spec.heads,
            attention_head_dim=spec.head_dim,
            in_channels=spec.in_channels,
            out_channels=spec.out_channels,
            num_layers=spec.depth,
            sample_size=spec.latent_size,
            patch_size=spec.patch,
            num_embeds_ada_norm=spec.num_classes,
        )
    untied = sum(p.numel() for p in model.parameters())
    shared = model.transformer_blocks[0].norm1.emb
    for block in model.transformer_blocks[1:]:
        block.norm1.emb = shared
    return untied, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "size, patch, resolution, latents",
    [(s, p, 256, "precomputed") for s, p in itertools.product(FAMILY, PATCH_SIZES)]
    + [("XL", 2, 512, "online"), ("S", 2, 64, "pixel"), ("B", 4, 128, "pixel")],
)
def test_parameter_count_equals_diffusers_network(size, patch, resolution, latents):
    spec = model_spec(f"DiT-{size}/{patch}", resolution, latents)
    untied, tied = _meta_diffusers_params(spec)
    assert tied == spec.params_trainable
    assert untied == spec.params_untied


def test_custom_tiny_network_count():
    spec = custom_spec(depth=2, hidden=32, heads=2, patch=2, resolution=64, num_classes=10)
    assert spec.latent_size == 8 and spec.tokens == 16
    _, tied = _meta_diffusers_params(spec)
    assert tied == spec.params_trainable


@pytest.mark.parametrize("name", ["DiT-XL/2", "XL/2", "dit-xl-2", "xl2", "DiT_S/8"])
def test_model_names_parse(name):
    family, size, patch = parse_model_name(name)
    assert family == "dit" and size in FAMILY and patch in PATCH_SIZES


@pytest.mark.parametrize("name", ["LightningDiT-XL/1", "lightningdit-b-2", "Lightning_DiT-L/1"])
def test_lightningdit_names_parse_to_their_own_family(name):
    family, size, patch = parse_model_name(name)
    assert family == "lightningdit" and size in ("B", "L", "XL") and patch in (1, 2)
    spec = model_spec(name, 256)
    assert spec.tokenizer == "va-vae" and spec.in_channels == 32 and spec.latent_size == 16
    assert spec.rope and spec.rmsnorm and spec.swiglu and not spec.learn_sigma


def test_a_lightningdit_name_the_release_does_not_have_suggests_one():
    with pytest.raises(PlanError, match="did you mean LightningDiT-XL/2"):
        model_spec("LightningDiT-XL/4")
    with pytest.raises(PlanError, match="multiple of 16 .16 x patch for LightningDiT-XL/1.: use 240 or 256"):
        model_spec("LightningDiT-XL/1", 250)


def test_unknown_model_suggests_the_closest():
    with pytest.raises(PlanError, match="did you mean DiT-XL/2"):
        model_spec("DiT-XXL/2")


def test_resolution_must_divide_by_eight_times_patch():
    with pytest.raises(PlanError, match="multiple of 16.*256 or 272"):
        model_spec("DiT-XL/2", 260)
    assert model_spec("DiT-XL/2", 260 - 4, "pixel").tokens == (256 // 2) ** 2


def test_overrides_make_a_custom_variant():
    spec = model_spec("DiT-XL/2", depth=2)
    assert spec.name == "DiT-XL/2-custom" and spec.depth == 2
    assert model_spec("DiT-XL/2", patch=4).name == "DiT-XL/4"
