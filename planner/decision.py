"""What the planner decides and on what: the cluster (`Cluster`) and one way to run the step (`Decision`), the
planner's output and the trainer's instructions (plan.json's `cluster` and `decision`)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.hardware import GPUPreset
from planner.repa import DEFAULT_PROJECTOR_DIM
from planner.rules import SHARDING_MODES

SHARDINGS = tuple(SHARDING_MODES)


ADAMW_KINDS = ("fused", "foreach", "single")


@dataclass(frozen=True)
class Cluster:
    """The machines: `gpus_per_node` GPUs of `vram_bytes` each on `nodes` nodes."""

    nodes: int
    gpus_per_node: int
    vram_bytes: int
    gpu: GPUPreset | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Decision:
    """One way to run the step; the planner's output and the trainer's instructions."""

    micro_batch: int
    grad_accum: int
    checkpointed_blocks: int
    precision: str  # "bf16" | "fp16" | "fp32" (bf16/fp16 = autocast over fp32 master weights)
    sharding: str  # "ddp" | "zero2" (FSDP SHARD_GRAD_OP) | "zero3" (FSDP FULL_SHARD)
    latents: str  # "precomputed" | "online" | "pixel"
    ema: bool = True
    # "fused" (one kernel, no temporary; the trainer's default on CUDA) | "foreach" (PyTorch's default on CUDA
    # when not fused: +4 B/param at the step) | "single" (the per-tensor loop, PyTorch's default on a CPU)
    adamw: str = "fused"
    gradient_as_bucket_view: bool = (
        True  # DDP grads alias its buckets (saves 4 B/param); Accelerate's default is off
    )
    repa: str = ""  # REPA's frozen encoder (planner.repa.ENCODERS), "" without REPA
    repa_projector_dim: int = DEFAULT_PROJECTOR_DIM  # the width of REPA's projector (with `repa`)

    @property
    def sharded(self) -> bool:
        return self.sharding != "ddp"
