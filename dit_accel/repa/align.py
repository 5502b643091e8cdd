"""REPA's alignment term: block K's output tokens, projected, pulled towards the frozen encoder's patch tokens.

    loss = objective's loss + coeff * mean over batch and tokens of -cos(projector(h_K), encoder(clean image))

Design (docs/training.md, "REPA"):
  * The projector is a submodule of the network named `repa_projector` (PROJECTOR_PREFIX), so it is in the
    optimizer, DDP's buckets, FSDP2's root unit and every checkpoint with no code of its own; the EMA and the
    inference weights (sample, export) skip that prefix, since sampling never runs it.
  * Block K's output is captured by a forward hook on the K-th transformer block (`TokenCapture`), which also
    applies the projector there, inside the network's forward: under DDP every trained parameter is then used
    by the forward, under FSDP2 the projector's (root-unit) parameters are gathered when it runs, and autocast
    is the forward's. A hook on the block fires once per forward also when the block is checkpointed (the
    recompute calls the block's function, not the module) or compiled (only its forward is compiled).
  * The encoder is not a submodule: frozen, fp32 weights, run under no_grad, never saved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dit_accel.errors import UserError

PROJECTOR_NAME = "repa_projector"
PROJECTOR_PREFIX = PROJECTOR_NAME + "."


def projector(hidden: int, encoder_dim: int, width: int) -> nn.Sequential:
    """REPA's 3-layer MLP with SiLU: hidden -> width -> width -> encoder_dim (PyTorch's default init, as
    REPA's)."""
    return nn.Sequential(
        nn.Linear(hidden, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, encoder_dim)
    )


def attach_projector(model: nn.Module, encoder_dim: int, width: int) -> nn.Module:
    """Add the projector to the (unwrapped) network, on the network's device; returns it."""
    hidden = model.dit_spec.hidden  # the width of the tokens it projects (either family)
    device = next(model.parameters()).device
    with device:
        module = projector(hidden, encoder_dim, width)
    model.add_module(PROJECTOR_NAME, module)
    return module


def is_projector_param(name: str) -> bool:
    """A parameter (or state-dict key) of the projector, under any wrapper's prefix ("module.")."""
    return name.removeprefix("module.").startswith(PROJECTOR_PREFIX)


def without_projector(state: dict) -> dict:
    """A state dict (or EMA) of the network as sampling needs it: the projector's entries dropped."""
    return {name: value for name, value in state.items() if not is_projector_param(name)}


class TokenCapture:
    """The projected output tokens of block `depth` (1-based) of the network's last forward.

    `take()` returns them once and forgets them, so a forward without a take (sampling the training model)
    keeps nothing alive past the next forward."""

    def __init__(self, model: nn.Module, depth: int):
        blocks = model.transformer_blocks
        if not 1 <= depth <= len(blocks):
            raise UserError(
                f"--repa-depth {depth} is not a block of this {len(blocks)}-block network",
                f"pass a block from 1 to {len(blocks)} (REPA aligns block 8 of SiT-XL/2)",
            )
        if not hasattr(model, PROJECTOR_NAME):
            raise ValueError("attach_projector first: the hook applies the network's own projector")
        self.model, self.depth = model, depth
        self.projected: torch.Tensor | None = None
        self.handle = blocks[depth - 1].register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        self.projected = getattr(self.model, PROJECTOR_NAME)(hidden)

    def take(self) -> torch.Tensor:
        projected, self.projected = self.projected, None
        if projected is None:
            raise RuntimeError(f"block {self.depth} did not run in the last forward")
        return projected

    def remove(self) -> None:
        self.handle.remove()


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sample (B,): minus the cosine similarity of each token pair, averaged over tokens (REPA's proj_loss
    before its mean over the batch). fp32 whatever the compute dtype; `target` carries no gradient."""
    if projected.shape != target.shape:
        raise ValueError(
            f"projected tokens {tuple(projected.shape)} and encoder tokens {tuple(target.shape)} differ: the "
            "encoder's input side must give one patch per network token"
        )
    cosine = (F.normalize(projected.float(), dim=-1) * F.normalize(target.detach().float(), dim=-1)).sum(-1)
    return -cosine.mean(dim=1)


class Repa:
    """One run's alignment: the frozen encoder, the capture on the network, the weight of the term.

    `build` attaches the projector to the unwrapped network, so call it before the optimizer and before
    DDP/FSDP2 see the parameters (dit_accel.train.step.build_components does)."""

    def __init__(self, encoder: nn.Module, capture: TokenCapture, coeff: float, grid: int):
        self.encoder, self.capture, self.coeff, self.grid = encoder, capture, coeff, grid

    @classmethod
    def build(
        cls, model: nn.Module, encoder, depth: int, coeff: float, width: int, grid: int, device
    ) -> Repa:
        """`encoder`: the path of published weights (`load_encoder`), or an encoder module already built."""
        from dit_accel.repa.encoder import load_encoder

        if not isinstance(encoder, nn.Module):
            encoder = load_encoder(encoder, grid, device)
        attach_projector(model, encoder.dim, width)
        return cls(encoder, TokenCapture(model, depth), coeff, grid)

    @torch.no_grad()
    def targets(self, images: torch.Tensor, autocast) -> torch.Tensor:
        """The encoder's normed patch tokens of clean images in [-1, 1], under the step's `autocast` context
        (REPA runs its encoders under the run's mixed precision)."""
        from dit_accel.repa.encoder import preprocess

        with autocast:
            return self.encoder(preprocess(images, self.grid))

    def loss(self, targets: torch.Tensor) -> torch.Tensor:
        """coeff x the per-sample alignment term of the forward that just ran (B,)."""
        return self.coeff * alignment_loss(self.capture.take(), targets)
