"""The planner's activation model held to a real trace of what autograd saves in diffusers' DiT.

The traced network is the trainer's: DiTTransformer2DModel with one embedder shared by all blocks. The trace
records every tensor packed for backward (storages de-duplicated, parameters excluded), exactly the set the
planner's `saved_activation_bytes` counts. CPU only: fp32, and bf16 under CPU autocast (whose op lists keep
layer_norm in bf16; the CUDA variant is the planner's default and needs a GPU to trace); and pure bf16, the
compute of one FSDP2 rank in a sharded plan (bf16 parameters, the input cast to bf16, no autocast), which
runs every op in bf16 on either device.
"""

import pytest
import torch
from diffusers import DiTTransformer2DModel
from torch.utils.checkpoint import checkpoint

from planner.activations import (
    block_matrix_params,
    element_bytes,
    outer_matrix_params,
    saved_activation_bytes,
)
from planner.spec import custom_spec


def tied_dit(spec):
    torch.manual_seed(0)
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
    shared = model.transformer_blocks[0].norm1.emb
    for block in model.transformer_blocks[1:]:
        block.norm1.emb = shared
    return model.train()


def checkpoint_blocks(model, count):
    """Checkpoint the first `count` blocks through diffusers' own hook. Reentrant checkpointing saves the
    block inputs with save_for_backward, so the trace sees what a checkpoint keeps alive."""
    chosen = set(map(id, model.transformer_blocks[:count]))

    def run(block, *args):
        if id(block) in chosen:
            return checkpoint(block.__call__, *args, use_reentrant=True)
        return block(*args)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=run)


def trace_saved(model, spec, micro_batch, autocast, pure=False):
    """Bytes autograd saves for backward in one forward: (activation bytes, bf16 weight-copy bytes).

    `pure`: the model's parameters in bf16 and no autocast, as FSDP2's MixedPrecisionPolicy runs a sharded
    plan's step (it gathers bf16 parameters and casts the root's floating inputs to bf16)."""
    if pure:
        model = model.to(torch.bfloat16)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_casts = [p.detach().to(torch.bfloat16) for p in model.parameters() if p.ndim >= 2]
    seen = {}

    def is_weight_copy(tensor):
        """A bf16 tensor equal to a parameter's cast (possibly as the transposed view a linear saves)."""
        if tensor.dtype != torch.bfloat16:
            return False
        for cast in weight_casts:
            for candidate in (cast, cast.t()) if cast.ndim == 2 else (cast,):
                if candidate.shape == tensor.shape and torch.equal(candidate, tensor):
                    return True
        return False

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (storage.nbytes(), is_weight_copy(tensor.detach()))
        return tensor

    size = spec.latent_size
    x = torch.randn(micro_batch, spec.in_channels, size, size, requires_grad=False)
    if pure:
        x = x.to(torch.bfloat16)
    t = torch.randint(0, 1000, (micro_batch,))
    y = torch.randint(0, spec.num_classes, (micro_batch,))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        out = model(x, t, y).sample
    assert out.requires_grad
    activations = sum(n for n, weight in seen.values() if not weight)
    weights = sum(n for n, weight in seen.values() if weight)
    return activations, weights


SPECS = [
    custom_spec(depth=2, hidden=64, heads=4, patch=2, resolution=128, num_classes=10),  # 64 tokens
    custom_spec(depth=3, hidden=48, heads=3, patch=2, resolution=64, num_classes=4),  # 16 tokens
    custom_spec(
        depth=2, hidden=32, heads=2, patch=4, resolution=64, latents="pixel", num_classes=4
    ),  # 256 tokens
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"d{s.depth}h{s.hidden}s{s.tokens}{s.latents[0]}")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_activations_match_a_real_trace(spec, precision):
    model = tied_dit(spec)
    traced, weight_copies = trace_saved(model, spec, micro_batch=3, autocast=precision == "bf16")
    predicted = saved_activation_bytes(spec, 3, element_bytes(precision, autocast_device="cpu"))
    # The brief asks for 5%; the op-by-op count is exact on CPU today, so hold it to 1%.
    assert predicted == pytest.approx(traced, rel=0.01)
    if precision == "bf16":
        # Every weight matrix whose input needs a gradient keeps its bf16 copy alive into backward.
        assert weight_copies == 2 * (outer_matrix_params(spec) + spec.depth * block_matrix_params(spec))
    else:
        assert weight_copies == 0


@pytest.mark.parametrize("checkpointed", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointed_blocks_keep_only_their_inputs(checkpointed, precision):
    spec = SPECS[1]
    model = tied_dit(spec)
    checkpoint_blocks(model, checkpointed)
    traced, weight_copies = trace_saved(model, spec, micro_batch=4, autocast=precision == "bf16")
    eb = element_bytes(precision, autocast_device="cpu")
    predicted = saved_activation_bytes(spec, 4, eb, checkpointed_blocks=checkpointed)
    assert predicted == pytest.approx(traced, rel=0.01)
    stored_blocks = spec.depth - checkpointed
    expected_copies = 2 * (outer_matrix_params(spec) + stored_blocks * block_matrix_params(spec))
    assert weight_copies == (expected_copies if precision == "bf16" else 0)
    # and checkpointing really saves: each checkpointed block is cheaper than a stored one
    assert predicted < saved_activation_bytes(spec, 4, eb, checkpointed_blocks=checkpointed - 1)


@pytest.mark.parametrize("checkpointed", [0, 1, 3])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"d{s.depth}h{s.hidden}s{s.tokens}{s.latents[0]}")
def test_pure_bf16_of_a_sharded_plan_matches_a_real_trace(spec, checkpointed):
    """Sharded plans: every saved tensor in bf16 (layer norms too, on the CPU and CUDA alike), the conditioning
    and the class table in bf16, no weight copies. To the byte."""
    checkpointed = min(checkpointed, spec.depth)
    model = tied_dit(spec)
    if checkpointed:
        checkpoint_blocks(model, checkpointed)
    traced, weight_copies = trace_saved(model, spec, micro_batch=3, autocast=False, pure=True)
    pure = element_bytes("bf16", autocast_device="cuda", pure=True)
    assert pure == element_bytes("bf16", autocast_device="cpu", pure=True)
    assert saved_activation_bytes(spec, 3, pure, checkpointed_blocks=checkpointed) == traced
    assert weight_copies == 0  # the parameters are bf16 themselves: nothing is cast
    # the autocast figures the planner used for sharded plans before: fp32 conditioning (and on CUDA fp32 norms)
    assert (
        saved_activation_bytes(spec, 3, element_bytes("bf16", "cpu"), checkpointed_blocks=checkpointed)
        > traced
    )


def test_saved_activations_scale_with_micro_batch_like_the_trace():
    spec = SPECS[0]
    model = tied_dit(spec)
    one, _ = trace_saved(model, spec, 1, autocast=False)
    five, _ = trace_saved(model, spec, 5, autocast=False)
    eb = element_bytes("fp32")
    assert five / one == pytest.approx(
        saved_activation_bytes(spec, 5, eb) / saved_activation_bytes(spec, 1, eb), rel=0.01
    )
