"""AdamW and the learning-rate schedule of the DiT recipe: constant lr, optional linear warmup and scaling.

The scheduler is stepped by the trainer once per APPLIED optimizer step and is never passed through
`accelerator.prepare`: a prepared scheduler steps `num_processes` times per optimizer step (it assumes the
per-process batch grew with the process count), which would make a warmup end N times too early.
"""

from __future__ import annotations

import torch
from torch import nn

REFERENCE_GLOBAL_BATCH = 256  # the batch DiT's lr 1e-4 was tuned for


def effective_lr(base_lr: float, global_batch: int, scale_lr: bool) -> float:
    """Linear scaling rule: lr grows with global batch / 256 when asked to."""
    return base_lr * global_batch / REFERENCE_GLOBAL_BATCH if scale_lr else base_lr


def build_optimizer(
    model: nn.Module,
    lr: float,
    betas=(0.9, 0.999),
    weight_decay: float = 0.0,
    device: torch.device | str = "cpu",
    implementation: str | None = None,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters.

    `implementation` is the plan's `decision.adamw`: "fused" (one kernel, no temporary) or "foreach" (a
    temporary of about 4 bytes/param at the step, which the planner then counts). Unset: fused where the
    device has it (CUDA), PyTorch's default elsewhere. fused on a CPU falls back to the default, which
    is what a CPU run of a GPU plan is for: checking the flow, not the kernels.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = torch.device(device).type == "cuda"
    if implementation not in (None, "fused", "foreach"):
        raise ValueError(f"AdamW implementation must be fused or foreach, got {implementation!r}")
    fused = on_cuda and implementation in (None, "fused")
    foreach = True if (implementation == "foreach" and on_cuda) else None
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused or None, foreach=foreach
    )


def create_states(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state for every trainable parameter, made now as its first step would make it (zero moments,
    step 0), so that a fresh run's first step computes what a lazily made state gives, bit for bit.

    Why: a resumed run loads its state before the first step, a fresh one makes it inside its first optimizer
    step, out of whatever the allocator cached then (with online latents: the VAE encoder's freed maps, which
    the states then pin, so the second encode maps new memory). Made here, among the persistent tensors, a
    fresh run has a resumed run's memory layout and the plan's reserved peak holds for both. Through the
    public `load_state_dict`, which places `step` as fused and capturable AdamW want it."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    if optimizer.state:
        return
    saved = optimizer.state_dict()
    zero_state = {}
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for param, index in zip(group["params"], saved_group["params"]):
            state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param)}
            state["exp_avg_sq"] = torch.zeros_like(param)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param)
            zero_state[index] = state
    optimizer.load_state_dict({"state": zero_state, "param_groups": saved["param_groups"]})


class WarmupConstant:
    """lr multiplier: (step + 1) / warmup_steps during warmup, then 1. A class, not a lambda, so that
    LambdaLR's state_dict records it and a resumed run checks the same schedule."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, applied_steps: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (applied_steps + 1) / self.warmup_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupConstant(warmup_steps))
