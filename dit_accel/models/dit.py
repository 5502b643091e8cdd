"""The DiT network: diffusers' `DiTTransformer2DModel`, built from the planner's spec, with ONE conditioning
embedder (timestep MLP + class table) shared by every block.

Stock diffusers gives each block its own copy of that embedder; trained separately the copies would drift
apart and the model would no longer be the DiT of the paper (nor match the planner's parameter count). Here
they are tied. This module builds the tied model (`build_model`: the DiT initialisation, adaLN-Zero) and
says what a built one is (`spec_from_model`, `network_mismatch`); weights enter and leave it through
`models.diffusers_format` (the diffusers layout) and `models.original_dit` (the original repository's `.pt`).

Two rules the rest of dit-accel relies on (docs/model.md has the reasoning):
  * Class dropout for classifier-free guidance is NOT done inside the model (diffusers would redraw it in
    every block); the trainer's micro-step (`train.step`) swaps in the null class once per sample before the
    forward, from the sample's keyed draw; `drop_labels` does the same for other callers.
  * The timestep-frequency shift: models dit-accel builds use diffusers' shift (1), so the diffusers layout
    is exact for stock diffusers. Models imported from original DiT checkpoints keep the original's shift
    (0); it is stored in `dit_accel.json` beside the weights so dit-accel reloads it, and exporting such a
    model for stock diffusers is refused unless explicitly allowed.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.attention_processor import AttnProcessor2_0
from torch import nn
from torch.utils.checkpoint import checkpoint

from dit_accel.errors import UserError
from planner.spec import FAMILY, LATENT_CHANNELS, PIXEL_CHANNELS, VAE_DOWNSAMPLE, DiTSpec

DIFFUSERS_FREQ_SHIFT = 1  # diffusers' Timesteps(downscale_freq_shift=1)
ORIGINAL_DIT_FREQ_SHIFT = 0  # the original DiT: frequencies exp(-ln(10000) * i / 128)
LAYER_NORM_EPS = 1e-6  # the DiT's value for every layer norm (diffusers' default for norm3 is 1e-5)

EMBEDDER_PREFIX = "norm1.emb."  # inside each transformer block


# --- building ----------------------------------------------------------------------------------------


def build_model(
    spec: DiTSpec, timestep_freq_shift: int = DIFFUSERS_FREQ_SHIFT, init: str = "dit"
) -> DiTTransformer2DModel:
    """A DiT of the planner's family as a diffusers model with the conditioning embedder tied across blocks.

    `init="dit"` applies the DiT paper's initialisation (adaLN-Zero: every block starts as the identity and
    the output as zero); `init="torch"` keeps PyTorch's defaults (e.g. to overwrite with loaded weights).
    Works under `torch.device("meta")` for parameter counting without memory.
    """
    if init not in ("dit", "torch"):
        raise UserError(f"init must be 'dit' or 'torch', got {init!r}")
    if spec.family == "lightningdit":  # its own module; its timestep features are fixed (the original DiT's)
        from dit_accel.models.lightningdit import build_lightningdit

        return build_lightningdit(spec, init)
    model = DiTTransformer2DModel(
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=spec.in_channels,
        out_channels=spec.out_channels,
        num_layers=spec.depth,
        sample_size=spec.latent_size,
        patch_size=spec.patch,
        num_embeds_ada_norm=spec.num_classes,
        activation_fn="gelu-approximate",
        attention_bias=True,
        norm_type="ada_norm_zero",
        norm_elementwise_affine=False,
        norm_eps=LAYER_NORM_EPS,
    )
    _make_dit_accel_model(model, spec, timestep_freq_shift)
    if init == "dit":
        initialize_dit_weights(model)
    return model


def _make_dit_accel_model(model: DiTTransformer2DModel, spec: DiTSpec, timestep_freq_shift: int) -> None:
    """Tie the embedders, switch off in-model label dropout, pin SDPA attention, remember the spec."""
    shared = model.transformer_blocks[0].norm1.emb
    for block in model.transformer_blocks[1:]:
        block.norm1.emb = shared
    # The table keeps its null row (index num_classes); only the per-block random drop is disabled.
    shared.class_embedder.dropout_prob = 0.0
    set_timestep_freq_shift(model, timestep_freq_shift)
    for block in model.transformer_blocks:  # PyTorch SDPA (diffusers' default today; pinned, not assumed)
        block.attn1.set_processor(AttnProcessor2_0())
    model.dit_spec = spec


def initialize_dit_weights(model: DiTTransformer2DModel) -> None:
    """The DiT paper's initialisation, written for diffusers' module names.

    Linear layers: Xavier-uniform weights, zero biases; q, k and v as the one fused (3 x hidden, hidden)
    projection the paper's network has (diffusers splits it in three, and Xavier on each D x D part would
    start them 1.41x larger, doubling the spread of the attention logits). Patch embedding: Xavier-uniform
    over the flattened kernel. Class table and timestep MLP: normal(0, 0.02). adaLN-Zero: every block's modulation layer and
    the final layer's modulation and projection start at zero, so each block is the identity at step 0.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    for block in model.transformer_blocks:
        attention = block.attn1
        projections = (attention.to_q, attention.to_k, attention.to_v)
        weight = attention.to_q.weight
        fused = weight.new_empty(3 * weight.shape[0], weight.shape[1])  # on the weights' device and generator
        nn.init.xavier_uniform_(fused)
        with torch.no_grad():
            for projection, part in zip(projections, fused.chunk(3, dim=0)):
                projection.weight.copy_(part)
    conv = model.pos_embed.proj
    nn.init.xavier_uniform_(conv.weight.view(conv.weight.shape[0], -1))
    nn.init.zeros_(conv.bias)
    embedder = conditioning_embedder(model)
    nn.init.normal_(embedder.class_embedder.embedding_table.weight, std=0.02)
    nn.init.normal_(embedder.timestep_embedder.linear_1.weight, std=0.02)
    nn.init.normal_(embedder.timestep_embedder.linear_2.weight, std=0.02)
    for block in model.transformer_blocks:
        nn.init.zeros_(block.norm1.linear.weight)
        nn.init.zeros_(block.norm1.linear.bias)
    for layer in (model.proj_out_1, model.proj_out_2):
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


def conditioning_embedder(model: DiTTransformer2DModel) -> nn.Module:
    """The (shared) CombinedTimestepLabelEmbeddings: timestep MLP + class table."""
    return model.transformer_blocks[0].norm1.emb


def embedders_tied(model: DiTTransformer2DModel) -> bool:
    shared = conditioning_embedder(model)
    return all(block.norm1.emb is shared for block in model.transformer_blocks)


def count_trainable_params(model: nn.Module) -> int:
    """Shared parameters counted once (nn.Module.parameters() de-duplicates them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_lightningdit(model: nn.Module) -> bool:
    return spec_from_model(model).family == "lightningdit"


def timestep_freq_shift(model: DiTTransformer2DModel) -> int:
    if is_lightningdit(model):
        return ORIGINAL_DIT_FREQ_SHIFT  # its timestep features are the original DiT's, by construction
    return int(conditioning_embedder(model).time_proj.downscale_freq_shift)


def set_timestep_freq_shift(model: DiTTransformer2DModel, shift: int) -> None:
    """1: diffusers' timestep frequencies; 0: the original DiT's. See docs/model.md, "The shift rule".
    A LightningDiT's are fixed; any recorded value leaves them so."""
    if shift not in (DIFFUSERS_FREQ_SHIFT, ORIGINAL_DIT_FREQ_SHIFT):
        raise UserError(f"timestep_freq_shift must be 1 (diffusers) or 0 (original DiT), got {shift!r}")
    if is_lightningdit(model):
        return
    for block in model.transformer_blocks:  # one module when tied; every copy when not
        block.norm1.emb.time_proj.downscale_freq_shift = shift


def null_class(model_or_spec) -> int:
    """The class index that means "no class" (classifier-free guidance): the last row of the table."""
    spec = model_or_spec if isinstance(model_or_spec, DiTSpec) else spec_from_model(model_or_spec)
    return spec.num_classes


def drop_labels(
    labels: torch.Tensor, prob: float, num_classes: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Replace each label by the null class (`num_classes`) with probability `prob`, once per sample.

    Call this in the training step, before the forward. (diffusers' LabelEmbedding would drop labels itself
    in train mode, but every block calls the embedder, so each block would drop different labels.)
    """
    if not 0.0 <= prob <= 1.0:
        raise UserError(f"class dropout probability must be in [0, 1], got {prob}")
    device = generator.device if generator is not None else labels.device
    dropped = torch.rand(labels.shape, generator=generator, device=device).to(labels.device) < prob
    return torch.where(dropped, torch.full_like(labels, num_classes), labels)


def as_model_fn(model: nn.Module):
    """`(x_t, t, y) -> output` for the objective and the samplers (any wrapped model: DDP, compiled...)."""

    def model_fn(x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x_t, timestep=t, class_labels=y, return_dict=False)[0]

    return model_fn


# --- the spec a model was built from ----------------------------------------------------------------


def spec_from_config(config) -> DiTSpec:
    """The planner spec that a diffusers DiT config describes (latent mode from the input channels)."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    in_channels = get("in_channels", 4)
    heads, head_dim = get("num_attention_heads", 16), get("attention_head_dim", 72)
    return spec_from_shapes(
        depth=get("num_layers", 28),
        hidden=heads * head_dim,
        heads=heads,
        patch=get("patch_size", 2),
        in_channels=in_channels,
        out_channels=get("out_channels", None) or in_channels,
        latent_size=get("sample_size", 32),
        num_classes=get("num_embeds_ada_norm", 1000),
    )


def spec_from_shapes(
    depth: int,
    hidden: int,
    heads: int,
    patch: int,
    in_channels: int,
    out_channels: int,
    latent_size: int,
    num_classes: int,
) -> DiTSpec:
    """The planner spec of a network's shapes: 4 input channels are VAE latents (x8 pixels), 3 are pixels."""
    if in_channels == LATENT_CHANNELS:
        latents, resolution = "precomputed", latent_size * VAE_DOWNSAMPLE
    elif in_channels == PIXEL_CHANNELS:
        latents, resolution = "pixel", latent_size
    else:
        raise UserError(
            f"a DiT with {in_channels} input channels is not supported: expected 4 (VAE latents) or 3 (pixels)"
        )
    if out_channels not in (in_channels, 2 * in_channels):
        raise UserError(
            f"the network outputs {out_channels} channels for {in_channels} inputs: a DiT outputs "
            "the same number, or twice it with learned sigma"
        )
    return DiTSpec(
        name=_family_name(depth, hidden, heads, patch),
        depth=depth,
        hidden=hidden,
        heads=heads,
        patch=patch,
        resolution=resolution,
        latents=latents,
        num_classes=num_classes,
        learn_sigma=out_channels == 2 * in_channels,
    )


def _family_name(depth: int, hidden: int, heads: int, patch: int) -> str:
    for size, shape in FAMILY.items():
        if shape == (depth, hidden, heads):
            return f"DiT-{size}/{patch}"
    return "DiT-custom"


def spec_from_model(model: nn.Module) -> DiTSpec:
    """The spec the model was built or loaded with (or, failing that, the one its config describes)."""
    model = getattr(model, "module", model)  # DDP's wrapper
    return getattr(model, "dit_spec", None) or spec_from_config(model.config)


# --- selective activation checkpointing -------------------------------------------------------------


def set_checkpointed_blocks(model: DiTTransformer2DModel, n: int) -> None:
    """Recompute the activations of exactly the first `n` blocks in backward (0 <= n <= depth).

    The first blocks are chosen because every block costs the same, and checkpointing is non-reentrant
    (`use_reentrant=False`): works with DDP, unused parameters and keyword arguments. The block's own
    `forward` is swapped per instance (as Accelerate does for autocast), so parameter names do not change.
    Under autocast a checkpointed block casts its weights without autocast's cache, so their copies do not
    live to the end of the forward; the shared embedder it calls stays cached (gradients stay bit-identical).
    """
    blocks = model.transformer_blocks
    if not isinstance(n, int) or not 0 <= n <= len(blocks):
        raise UserError(
            f"checkpointed_blocks must be an integer from 0 to {len(blocks)} (the depth), got {n!r}"
        )
    model.gradient_checkpointing = False  # diffusers' own switch is all-or-nothing: never both
    for index, block in enumerate(blocks):
        if index < n:
            block.forward = functools.partial(_checkpointed_forward, block)
        else:
            block.__dict__.pop("forward", None)
    for embedder in shared_embedders(model):  # DiT's: one when tied
        if n:
            embedder.forward = functools.partial(_forward_with_autocast_cache, embedder)
        else:
            embedder.__dict__.pop("forward", None)


def shared_embedders(model: nn.Module) -> list[nn.Module]:
    """The conditioning embedders the blocks call themselves (DiT's, one when tied); none for a LightningDiT,
    whose conditioning is made once before the blocks."""
    found = (getattr(getattr(block, "norm1", None), "emb", None) for block in model.transformer_blocks)
    return list({id(embedder): embedder for embedder in found if embedder is not None}.values())


def checkpointed_blocks(model: DiTTransformer2DModel) -> int:
    return sum("forward" in block.__dict__ for block in model.transformer_blocks)


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    if not torch.is_grad_enabled():
        return type(block).forward(block, *args, **kwargs)
    return checkpoint(_forward_without_autocast_cache, block, *args, use_reentrant=False, **kwargs)


def _forward_without_autocast_cache(block: nn.Module, *args, **kwargs):
    """The block's forward with autocast's weight cache off, in the first pass and in the recompute alike.

    Autocast caches the bf16/fp16 copy of every weight it casts until the outermost autocast exits (after the
    loss), so a checkpointed block, which saves nothing, would still keep its weights' copies through the
    whole forward. Uncached, each copy lives only while its op needs it (in the recompute, as long as backward
    saves it). The cast values are the same, so are the outputs. Outside autocast (fp32, FSDP's pure low
    precision, sampling) this is the plain forward.
    """
    with _autocast_cache(_first_tensor(args, kwargs).device.type, enabled=False):
        return type(block).forward(block, *args, **kwargs)


def _forward_with_autocast_cache(embedder: nn.Module, *args, **kwargs):
    """The shared embedder's forward with autocast's cache on, also when a checkpointed block calls it.

    Every block calls the one embedder. Cached, all calls read one cast copy of its weights, whose gradient
    autograd sums in the compute dtype before it reaches the fp32 weights, exactly as without checkpointing;
    cast anew in each checkpointed block, the sum would be taken in fp32 (different rounding) and the
    copies would be made again in every block."""
    with _autocast_cache(_first_tensor(args, kwargs).device.type, enabled=True):
        return type(embedder).forward(embedder, *args, **kwargs)


def _autocast_cache(device_type: str, enabled: bool):
    """The running autocast (same device type and dtype) with its weight cache switched on or off; nothing
    outside autocast. Nested, it neither clears the outer cache nor outlives it."""
    if not torch.is_autocast_enabled(device_type) or torch.is_autocast_cache_enabled() == enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=enabled)


def _first_tensor(args, kwargs) -> torch.Tensor:
    """The first tensor argument (a block's hidden states, the embedder's timesteps): autocast's device."""
    return next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))


# --- diffusers layout: load ---------------------------------------------------------------------------


# --- diffusers layout: save ---------------------------------------------------------------------------


# --- comparing networks ----------------------------------------------------------------------------------


NETWORK_FIELDS = (
    "depth",
    "hidden",
    "heads",
    "patch",
    "in_channels",
    "out_channels",
    "latent_size",
    "num_classes",
)


def network_mismatch(found: DiTSpec, wanted: DiTSpec) -> str | None:
    """The first network field in which two specs differ, as 'FIELD F (wanted W)'; None when the weights of one
    fit the other (resolution and latent mode may differ as long as the shapes agree)."""
    for field in NETWORK_FIELDS:
        if getattr(found, field) != getattr(wanted, field):
            return f"{field} {getattr(found, field)} (wanted {getattr(wanted, field)})"
    return None
