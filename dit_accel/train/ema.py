"""Exponential moving average of the weights, in fp32, updated once per applied optimizer step.

DiT samples from the EMA weights (decay 0.9999). The EMA is a plain dict of fp32 tensors keyed by
parameter name rather than a second nn.Module: it never runs forward during training, it costs exactly
4 bytes per parameter (what the planner counts), and it saves as one safetensors file.

Under FSDP2 a parameter is a DTensor holding this rank's shard. The EMA then keeps only that shard (4/N
bytes per parameter, as the plan counts) and updates it locally, with no communication; only saving
gathers the full tensors (a collective), so the file is the same as an unsharded run's and sampling or
export never needs torch.distributed. Loading takes each rank's shard of the full tensors back.

Parameters that are trained but never sampled (REPA's projector, `dit_accel.repa.align`) have no EMA: the
sampling network is the DiT alone, and ema.safetensors loads into it as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dit_accel.repa.align import is_projector_param


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = False):
        self.decay, self.warmup = decay, warmup
        self.updates = (
            0  # updates the shadow has had; a resumed run sets it from the checkpoint's applied steps
        )
        self.shadow: dict[str, torch.Tensor] = {}  # this rank's fp32 shard (the whole tensor when unsharded)
        self.layout: dict[
            str, torch.Tensor
        ] = {}  # sharded parameters: a DTensor to take mesh and placements from
        for name, param in model.named_parameters():
            if not param.requires_grad or is_projector_param(name):
                continue
            self.shadow[name] = _local(param.detach()).to(torch.float32).clone()
            if hasattr(param, "to_local"):
                self.layout[name] = param

    @property
    def sharded(self) -> bool:
        return bool(self.layout)

    def current_decay(self) -> float:
        """The decay of the next update: constant (the DiT recipe), or with warm-up diffusers' EMAModel ramp
        (inv_gamma 1, power 2/3), 1 - (1 + n)^(-2/3) after n updates, capped at `decay`: the first update
        copies the weights and a short run's EMA already follows them."""
        if not self.warmup:
            return self.decay
        return min(self.decay, 1.0 - (1.0 + self.updates) ** (-2.0 / 3.0))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """shadow <- decay * shadow + (1 - decay) * param, for every trainable parameter (shard by shard)."""
        shadows, params = [], []
        for name, param in model.named_parameters():
            if name in self.shadow:
                shadows.append(self.shadow[name])
                params.append(_local(param.detach()).to(torch.float32))
        torch._foreach_lerp_(shadows, params, 1.0 - self.current_decay())
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 tensors by parameter name. Sharded: gathered, a collective that EVERY rank must call."""
        if not self.sharded:
            return dict(self.shadow)
        from torch.distributed.tensor import DTensor

        full = {}
        for name, shard in self.shadow.items():
            layout = self.layout.get(name)
            if layout is None:
                full[name] = shard
                continue
            gathered = DTensor.from_local(
                shard,
                layout.device_mesh,
                layout.placements,
                shape=layout.shape,
                stride=layout.stride(),
                run_check=False,
            )
            full[name] = gathered.full_tensor()
        return full

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Full tensors by name (what `state_dict` gives); each rank keeps its own shard. No communication."""
        missing, unexpected = set(self.shadow) - set(state), set(state) - set(self.shadow)
        if missing or unexpected:
            raise ValueError(
                f"EMA state does not match the model: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}"
            )
        for name, tensor in state.items():
            layout = self.layout.get(name)
            if layout is not None:
                from torch.distributed.tensor import distribute_tensor

                tensor = distribute_tensor(
                    tensor.to(layout.device), layout.device_mesh, layout.placements, src_data_rank=None
                ).to_local()
            self.shadow[name].copy_(tensor)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA weights into an unsharded model with the same parameter names (sampling, export)."""
        if self.sharded:
            raise RuntimeError(
                "copy_to needs the full weights: load ema.safetensors into an unsharded model instead"
            )
        for name, param in model.named_parameters():
            if name in self.shadow:
                param.copy_(self.shadow[name])

    def save(self, path: Path, write: bool = True) -> None:
        """One safetensors file of full fp32 tensors. Sharded: every rank calls this (the gather is a
        collective) and only the one with `write` writes."""
        from safetensors.torch import save_file

        state = self.state_dict()
        if write:
            save_file({name: tensor.contiguous().cpu() for name, tensor in state.items()}, str(path))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.load_state_dict(load_file(str(path), device="cpu"))
