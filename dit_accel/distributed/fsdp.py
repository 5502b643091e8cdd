"""FSDP2 laid out as the plan counts it: one unit per transformer block on the root unit's mesh, FSDP on a CPU
(which Accelerate never turns on there), and the whole tensor of a sharded one."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def use_fsdp_on_cpu(accelerator, plugin, mixed_precision: str, parallelism=None) -> None:
    """Switch a CPU Accelerator to FSDP, which accelerate 1.15 never does by itself.

    AcceleratorState turns a launch into FSDP only inside its GPU-family branch (MULTI_GPU, MULTI_XPU, ...); a
    `cpu=True` state is MULTI_CPU and would silently wrap the model in DDP instead. (FSDP1 fails earlier still:
    its plugin with sync_module_states asks for a GPU's current_device.) torch's `fully_shard` itself runs on a
    CPU mesh over gloo, so here the state is set to FSDP by hand, and from then on accelerate's own FSDP2 code
    (prepare, gradient clipping, sync, save_state/load_state) runs exactly as on GPUs: that is what the CPU
    tests exercise. Nothing else changes: the device stays the CPU and the process group gloo. An hsdp plan's
    `parallelism` (its ParallelismConfig) is installed here too, its mesh built on the CPU: gloo runs FSDP2's
    HSDP collectives (reduce-scatter inside the shard group, all-reduce across the replicas) as they are.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # what AcceleratorState does for GPU launches
    accelerator.state.fsdp_plugin = plugin
    if parallelism is not None:
        parallelism.get_device_mesh("cpu")
        accelerator.state.parallelism_config = parallelism
        accelerator.state.device_mesh = parallelism.device_mesh
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def uses_fsdp(accelerator) -> bool:
    if accelerator is None:
        return False
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def shard_blocks(model: nn.Module, plugin) -> None:
    """One FSDP2 unit per transformer block, holding the block's own layers but NOT its conditioning embedder.

    Every DiT block's `norm1.emb` is the same CombinedTimestepLabelEmbeddings, and a parameter that two FSDP units
    see is an error; `fully_shard` on a list of modules makes them one unit (one all-gather, one
    reduce-scatter per block, as the planner counts), so each block's unit is its layers minus the embedder,
    and the embedder, patch embedding and final layer stay in the root unit that `accelerator.prepare` adds.
    A LightningDiT block holds no embedder (its conditioning is made before the blocks): its unit is all of it.
    Activation checkpointing (set_checkpointed_blocks) wraps the block's forward, outside these units: the
    recompute in backward runs the units' hooks again and gathers their parameters as the first pass did.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # torch warns that a unit "returned a view tensor" because nn.Linear on (batch, tokens, width) returns
    # one; only an in-place op on it would skip the unit's backward hook, and diffusers' block uses none
    # (tests/test_train_fsdp.py holds zero2 and zero3 equal to the DDP update).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": fsdp_mesh(),
    }
    for block in model.transformer_blocks:
        embedder = getattr(
            getattr(block, "norm1", None), "emb", None
        )  # DiT's shared one; LightningDiT has none
        layers = [
            module for module in _children_without(block, embedder) if any(True for _ in module.parameters())
        ]
        fully_shard(layers, **kwargs)


def fsdp_mesh():
    """The mesh Accelerate shards the root unit over (`fsdp2_prepare_model`: its ParallelismConfig's FSDP
    dimensions, (dp_replicate, dp_shard) under hsdp), so that every block unit uses the same one; None (all
    ranks, one dimension) without a ParallelismConfig."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    mesh, config = getattr(state, "device_mesh", None), getattr(state, "parallelism_config", None)
    if mesh is None or config is None:
        return None
    return mesh[tuple(config.fsdp_dim_names)]


def _children_without(module: nn.Module, excluded: nn.Module | None) -> list[nn.Module]:
    """The smallest set of submodules that covers `module` except `excluded` (and its own submodules)."""
    covering = []
    for child in module.children():
        if child is excluded:
            continue
        if any(sub is excluded for sub in child.modules()):
            covering.extend(_children_without(child, excluded))
            if any(True for _ in child.parameters(recurse=False)):
                raise ValueError(f"{type(child).__name__} holds parameters beside the shared embedder")
        else:
            covering.append(child)
    return covering


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective for a DTensor (every rank must call it), the tensor itself otherwise."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
