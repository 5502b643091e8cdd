"""Regional compilation: `torch.compile` per transformer block, not per model.

Every DiT block has the same code and shapes, so one compiled graph serves them all: compile time is one
block's, not the network's, and the units other parts of the run are built on stay per block (selective
activation checkpointing in dit_accel.models.dit, FSDP2's per-block units in dit_accel.distributed.accelerator). Large-model
trainers (torchtitan) compile this way for the same reasons. The shared embedder, which every block calls,
is traced into the block's graph; the patch embedding, the final layer and the loss stay eager: small, and
run once per step.

What is compiled is the block's own `forward` (its class's), reached through a per-instance subclass, as
FSDP2's `fully_shard` swaps a module's class. That is the call a checkpointed block makes inside
`torch.utils.checkpoint` (dit_accel.models.dit calls `type(block).forward`), so checkpointed and stored blocks run
the same compiled graph, and checkpointing stays eager around it: the first pass drops what the compiled
forward saves, the recompute runs it again. (Compiling `Module.__call__` instead, as `block.compile()` does,
would trace into the checkpoint and break the graph at that call: checkpointed blocks would run eager.)
Parameter names, state dicts and checkpoints do not change.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("dit_accel.train")

_COMPILED_CLASSES: dict[type, type] = {}  # one compiled subclass (so one compiled forward) per block class


def resolve_compile(requested: bool | None, plan_compile: bool, device_type: str) -> tuple[bool, str]:
    """Whether the run compiles its blocks, and why (for the log).

    `--compile` / `--no-compile` decide; without either (auto) the run follows the plan on CUDA and runs
    eager on a CPU, where compile time is far larger than what it saves and nothing is planned for.
    """
    if requested is not None:
        return requested, "--compile" if requested else "--no-compile"
    if device_type != "cuda":
        return False, f"auto: off on {device_type.upper()}"
    return plan_compile, f"auto: the plan's compile {str(plan_compile).lower()}"


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every transformer block of a built model, in place; returns how many.

    Call it after `set_checkpointed_blocks` and before FSDP2 sharding and DDP wrapping (the order torchtitan
    uses). Compilation itself happens at the first forward. Idempotent.
    """
    blocks = list(model.transformer_blocks)
    for block in blocks:
        block.__class__ = _compiled_class(type(block))
    return len(blocks)


def compiled_blocks(model: nn.Module) -> int:
    """How many of the model's blocks run the compiled forward."""
    return sum(type(block) in _COMPILED_CLASSES.values() for block in model.transformer_blocks)


def _compiled_class(block_class: type) -> type:
    if block_class in _COMPILED_CLASSES.values():
        return block_class
    if block_class not in _COMPILED_CLASSES:
        compiled_forward = torch.compile(block_class.forward)

        def forward(self, hidden_states, *args, **kwargs):
            # The first block's input is the patch embedding's transposed view; the others' are contiguous.
            # Dynamo specialises on strides, so without this copy block 0 would compile a graph of its own.
            return compiled_forward(self, hidden_states.contiguous(), *args, **kwargs)

        _COMPILED_CLASSES[block_class] = type(
            f"Compiled{block_class.__name__}",
            (block_class,),
            {"forward": forward, "__module__": __name__, "__doc__": block_class.__doc__},
        )
    return _COMPILED_CLASSES[block_class]


def compile_for_run(
    model: nn.Module, requested: bool | None, plan_compile: bool, device: torch.device
) -> bool:
    """The trainer's one call (dit_accel.train.step.build_components): decide, compile the blocks or not, and say
    which and why in the run's log at the first forward (after the run's first line; a compiled run's first
    step is the one that compiles). Returns whether it compiles."""
    on, why = resolve_compile(requested, plan_compile, device.type)
    if on:
        count = compile_blocks(model)
        message = (
            f"compiled blocks: {count}/{len(model.transformer_blocks)}, torch.compile per block ({why}); "
            "this first step compiles them"
        )
    else:
        message = f"compiled blocks: off, eager ({why})"
    _log_at_first_forward(model, message)
    return on


def _log_at_first_forward(model: nn.Module, message: str) -> None:
    def log_once(module, args, kwargs):
        handle.remove()
        log.info(message)

    handle = model.register_forward_pre_hook(log_once, with_kwargs=True)
