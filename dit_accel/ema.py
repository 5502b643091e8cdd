"""Exponential moving average of the weights, in fp32, updated once per applied optimizer step.

DiT samples from the EMA weights (decay 0.9999). The EMA is a plain dict of fp32 tensors keyed by
parameter name rather than a second nn.Module: it never runs forward during training, it costs exactly
4 bytes per parameter (what the planner counts), and it saves as one safetensors file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.9999):
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {
            name: param.detach().to(torch.float32).clone()
            for name, param in model.named_parameters()
            if param.requires_grad
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """shadow <- decay * shadow + (1 - decay) * param, for every trainable parameter."""
        shadows, params = [], []
        for name, param in model.named_parameters():
            if name in self.shadow:
                shadows.append(self.shadow[name])
                params.append(param.detach().to(torch.float32))
        torch._foreach_lerp_(shadows, params, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = set(self.shadow) - set(state), set(state) - set(self.shadow)
        if missing or unexpected:
            raise ValueError(f"EMA state does not match the model: missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]}")
        for name, tensor in state.items():
            self.shadow[name].copy_(tensor)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA weights into a model with the same parameter names (for sampling or export)."""
        for name, param in model.named_parameters():
            if name in self.shadow:
                param.copy_(self.shadow[name])

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file({name: tensor.contiguous().cpu() for name, tensor in self.shadow.items()}, str(path))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.load_state_dict(load_file(str(path), device=str(next(iter(self.shadow.values())).device)))
