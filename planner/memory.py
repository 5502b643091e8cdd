"""Bytes per GPU of one DiT training step at its peak, by component.

The network is the one the trainer runs: diffusers' DiTTransformer2DModel with one timestep+class embedder
shared by all blocks. Activations are counted op by op from what autograd saves for backward in that code
(attention.py BasicTransformerBlock with ada_norm_zero, AttnProcessor2_0 -> SDPA, FeedForward gelu-tanh 4x,
AdaLayerNormZero, CombinedTimestepLabelEmbeddings), under fp32 or autocast. The step is then walked through
the moments that can hold its peak, each a snapshot of what is alive then; the peak is the largest.
`dit-accel verify` traces the trainer's real step on fake tensors and tests/test_memtrace_grid.py holds the
CPU-autocast variant of these moments to that trace (docs/planner-accuracy.md).

  vae_encode          (online latents) the VAE encoder's no-grad working set, before the DiT forward
  repa_encode         (REPA) its frozen encoder's no-grad working set, before the DiT forward
  last_block_forward  (the last block checkpointed) inside its forward: every block's input + its MLP
  end_of_forward      the loss: every saved activation, autocast's cache of the weights cast outside
                      checkpointed blocks, the loss terms
  start_of_backward   inside the last block's backward: its activation and weight gradients in flight
                      (LightningDiT: or in its final layer's, whichever holds more: components.backward_start)
  end_of_backward     inside block 0's backward: nearly every gradient, block 0's (recomputed) set
  optimizer_step      weights + grads + AdamW states + the optimizer's temporaries

Everything a tensor trace cannot see (DDP buckets, FSDP gather buffers, CUDA context, NCCL) is added from its
own formula. `allocator` is what PyTorch's caching allocator reserves beyond the tensors' bytes (rounding and
fragmentation, planner/allocator.py, and the cuBLAS/cuBLASLt workspaces it holds for the libraries): the
reserved peak is the allocated bytes plus it, and `overhead` (CUDA context, NCCL) is memory outside that
allocator. The budget is held to reserved + overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planner import vae
from planner.activations import FP32_BYTES, buffer_bytes
from planner.allocator import (
    accumulating_encode_bytes,
    block_parameter_elements,
    new_gradient_segment_bytes,
    online_reserved_bytes,
    outer_parameter_elements,
    parameter_rounding_bytes,
    reserved_bytes,
)
from planner.components import (
    ALLOCATED,
    COMPONENTS,
    FORWARD_MOMENTS,
    activations_bytes,
    autocast_cache_bytes,
    casts_weights,
    ema_bytes,
    gradients_in_buckets,
    grads_bytes,
    moments,
    optimizer_bytes,
    overhead_bytes,
    repa_bytes,
    repa_persistent_bytes,
    repa_projector_params,
    saved_element_bytes,
    shard_count,
    stream_pool_bytes,
    temporaries_bytes,
    vae_bytes,
    weights_bytes,
)
from planner.decision import ADAMW_KINDS, SHARDINGS, Cluster, Decision
from planner.errors import PlanError
from planner.hardware import Assumptions
from planner.spec import DiTSpec


@dataclass(frozen=True)
class MemoryEstimate:
    phases: dict  # moment -> {component: bytes}
    peak_phase: str
    vram_bytes: int
    budget_bytes: int
    # moment -> what the caching allocator gives back when memory runs short (planner/allocator.py, pressure)
    reclaimable: dict = field(default_factory=dict)

    @property
    def components(self) -> dict[str, int]:
        """Components at the peak moment; they sum to peak_bytes."""
        return self.phases[self.peak_phase]

    @property
    def peak_bytes(self) -> int:
        """Reserved peak + the memory outside the allocator: what the budget holds."""
        return sum(self.components.values())

    @property
    def allocated_peak_bytes(self) -> int:
        """The largest moment's tensor bytes (torch.cuda.max_memory_allocated's figure)."""
        return max(sum(parts[name] for name in ALLOCATED) for parts in self.phases.values())

    @property
    def reserved_peak_bytes(self) -> int:
        """The caching allocator's peak (torch.cuda.max_memory_reserved's figure): never released in a step."""
        return max(
            sum(parts[name] for name in ALLOCATED) + parts["allocator"] for parts in self.phases.values()
        )

    @property
    def overhead_bytes(self) -> int:
        return self.components["overhead"]

    def phase_bytes(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def needed_bytes(self) -> int:
        """The least memory the step runs in: at each moment, its bytes less what the allocator releases
        under pressure before it would report out of memory; the largest moment. The budget holds this."""
        return max(sum(parts.values()) - self.reclaimable.get(m, 0) for m, parts in self.phases.items())

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.budget_bytes


def allocator_bytes(
    spec,
    decision,
    cluster,
    assumptions,
    parts: dict[str, int],
    moment: str = "",
    pressure: bool = False,
    floor_bytes: int = 0,
) -> int:
    """What the caching allocator reserves beyond the tensors `parts` at one moment (planner/allocator.py):
    the persistent tensors' block rounding, the fragmentation the transient ones leave and the cuBLAS
    workspaces (PyTorch allocates them through it and keeps them; a release does not return them), and at least
    `floor_bytes` reserved in all (what the step reserved earlier); with `pressure`, what stays reserved
    after it released its cache to fit."""
    shards = shard_count(decision, cluster)
    buckets = FP32_BYTES * spec.params_trainable if cluster.world_size > 1 and not decision.sharded else 0
    persistent = (
        FP32_BYTES * spec.params_trainable // shards
        + buffer_bytes(spec)
        + optimizer_bytes(spec, decision, cluster, assumptions, "optimizer_step")
        + ema_bytes(spec, decision, cluster, assumptions, "optimizer_step")
        + vae_bytes(spec, decision, cluster, assumptions, "optimizer_step")
        + repa_persistent_bytes(spec, decision, cluster)
        + buckets
    )
    allocated = sum(parts[name] for name in ALLOCATED)
    encoder_working = encoder_working_bytes(spec, decision, cluster, assumptions)
    reserved = reserved_bytes(
        spec,
        allocated,
        persistent,
        segments=assumptions.allocator_segments,
        shards=shards,
        persistent_copies=4 if decision.ema else 3,
        bucket_bytes=buckets,
        earlier_working_bytes=encoder_working if moment != "vae_encode" else 0,
        # the floor counts cuBLAS's workspaces, added below (and with memory to spare, the stream pools)
        reserved_floor_bytes=max(floor_bytes - assumptions.cublas_workspace_bytes, 0) if pressure else 0,
        measured_fragmentation=assumptions.fragmentation,
        pressure=pressure,
        pinned=moment == "vae_encode"
        and assumptions.allocator_segments == "fixed"
        and accumulated_gradient_bytes(spec, decision, cluster) > 0,
    )
    reserved += assumptions.cublas_workspace_bytes
    if pressure:
        return reserved - allocated
    if assumptions.fragmentation <= 0:  # a measured ratio already holds the stream pools
        reserved += stream_pool_bytes(spec, decision, cluster, assumptions)
    return max(reserved, floor_bytes) - allocated


def encoder_working_bytes(spec, decision, cluster, assumptions) -> int:
    """The online VAE encoder's working set: its bytes at the encode less its weights (0 without it)."""
    weights = vae_bytes(spec, decision, cluster, assumptions, "optimizer_step")
    return vae_bytes(spec, decision, cluster, assumptions, "vae_encode") - weights


def online_floor_bytes(spec, decision, cluster, assumptions, by_moment: dict[str, dict[str, int]]) -> int:
    """Online latents: the reserved bytes once the VAE encodes have run (planner/allocator.py
    `online_reserved_bytes`), from the moments `by_moment` reserved on their own; every later moment holds
    at least that. 0 without online latents, or when a measured fragmentation replaces the model."""
    if decision.latents != "online" or assumptions.fragmentation > 0:
        return 0
    segments = assumptions.allocator_segments

    def allocated(moment: str) -> int:
        return sum(by_moment[moment][name] for name in ALLOCATED)

    def reserved(moment: str) -> int:
        return allocated(moment) + by_moment[moment]["allocator"]

    largest_map = vae.encoder_activation_bytes(
        spec.resolution, decision.micro_batch, 1, assumptions.vae_bytes_per_param
    )
    lazy_states = None
    if assumptions.adamw_state == "lazy":
        states = optimizer_bytes(spec, decision, cluster, assumptions, "optimizer_step")
        states_rounding = 2 * parameter_rounding_bytes(
            spec, FP32_BYTES, shard_count(decision, cluster), segments
        )
        lazy_states = {
            "dit_reserved": max(reserved(m) for m in by_moment if m != "vae_encode"),
            # cuBLAS's workspaces are held too, not cache the encode can reuse
            "optimizer_allocated": allocated("optimizer_step") + assumptions.cublas_workspace_bytes,
            "optimizer_reserved": reserved("optimizer_step"),
            "states_held_bytes": states + states_rounding,
            "states_bytes": states,
            "map_bytes": largest_map,
        }
    working = encoder_working_bytes(spec, decision, cluster, assumptions)
    accumulated = accumulated_gradient_bytes(spec, decision, cluster)
    return online_reserved_bytes(
        encode_reserved=reserved("vae_encode"),
        working_bytes=working,
        segments=segments,
        lazy_states=lazy_states,
        accumulated_bytes=accumulated,
        later_encode_bytes=accumulating_encode_bytes(accumulated, largest_map, working, segments),
    )


def accumulated_gradient_bytes(spec, decision, cluster) -> int:
    """The gradients the earlier micro-steps leave alive through a later one's encode, made by the first
    micro-step's backward, REPA's projector's among them: 0 without accumulation or in DDP's buckets; a
    shard of them under FSDP (each micro-step reduce-scatters into it)."""
    if decision.grad_accum == 1 or gradients_in_buckets(decision, cluster):
        return 0
    params = spec.params_trainable + repa_projector_params(spec, decision)
    return FP32_BYTES * params // shard_count(decision, cluster)


def largest_transient_bytes(spec: DiTSpec, decision: Decision, assumptions: Assumptions) -> int:
    """The largest tensor the step allocates and frees: the MLP's hidden activation (and its gradient, the same
    size), the attention probabilities when attention is not fused, autocast's copy of the adaLN matrix. Not
    the online VAE encoder's maps: the DiT's forward splits them, and the replay of DiT-XL/2 fp32 at micro-batch
    8 online still maps the gradients' own segments in its first backward."""
    eb = saved_element_bytes(decision, assumptions)
    tokens = decision.micro_batch * spec.tokens
    largest = tokens * spec.mlp_hidden * eb.compute * (2 if spec.swiglu else 1)  # SwiGLU: gate and value
    if assumptions.attention == "math":
        largest = max(largest, decision.micro_batch * spec.heads * spec.tokens**2 * eb.compute)
    if casts_weights(decision):
        largest = max(largest, eb.compute * 6 * spec.hidden**2)
    return largest


def gradient_segment_bytes(spec, decision, cluster, assumptions) -> int:
    """Fixed segments: the segments the first backward maps for the fp32 gradients no freed block holds
    (planner/allocator.py `new_gradient_segment_bytes`). None under FSDP (its gradients are reduce-scattered
    shards) or under DDP with gradient_as_bucket_view (each gradient autograd makes is copied into its
    bucket, allocated at the start, and freed at once)."""
    if (
        assumptions.allocator_segments != "fixed"
        or decision.sharded
        or gradients_in_buckets(decision, cluster)
    ):
        return 0
    block = [FP32_BYTES * n for n in reversed(block_parameter_elements(spec))]  # backward's order
    outer = [FP32_BYTES * n for n in outer_parameter_elements(spec)]
    largest = largest_transient_bytes(spec, decision, assumptions)
    return new_gradient_segment_bytes(block, spec.depth, outer, largest)


def gradient_segment_floor_bytes(spec, decision, cluster, assumptions, by_moment: dict | None = None) -> int:
    """Fixed segments: the reserved bytes once the first backward has mapped the gradients' own segments
    (`gradient_segment_bytes`) on top of what the first micro-step's forward reserved; every later moment
    holds at least that. 0 when there are none or a measured fragmentation replaces the model. `by_moment`:
    the step's moments, already computed (`step_memory`); without accumulation its forward is the first's."""
    new = gradient_segment_bytes(spec, decision, cluster, assumptions)
    if not new or assumptions.fragmentation > 0:
        return 0
    known = by_moment if by_moment is not None and decision.grad_accum == 1 else {}
    first = replace(decision, grad_accum=1)  # before any gradient exists
    reserved = []
    for moment in (m for m in moments(spec, first) if m in FORWARD_MOMENTS):
        parts = known.get(moment) or phase_components(spec, first, cluster, assumptions, moment)
        reserved.append(sum(parts[name] for name in ALLOCATED) + parts["allocator"])
    return max(reserved) + new


_COMPONENT_FUNCTIONS = {
    "weights": weights_bytes,
    "grads": grads_bytes,
    "optimizer": optimizer_bytes,
    "ema": ema_bytes,
    "activations": activations_bytes,
    "autocast_cache": autocast_cache_bytes,
    "vae": vae_bytes,
    "repa": repa_bytes,
    "temporaries": temporaries_bytes,
}


def phase_components(
    spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions, phase: str
) -> dict[str, int]:
    """Every component at one moment, the allocator's share last but one (it depends on the tensors)."""
    parts = {
        name: int(fn(spec, decision, cluster, assumptions, phase))
        for name, fn in _COMPONENT_FUNCTIONS.items()
    }
    parts["allocator"] = allocator_bytes(spec, decision, cluster, assumptions, parts, phase)
    parts["overhead"] = overhead_bytes(cluster, assumptions)
    return {name: parts[name] for name in COMPONENTS}


def step_memory(
    spec: DiTSpec,
    decision: Decision,
    cluster: Cluster,
    assumptions: Assumptions,
    budget_bytes: int | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of one training step at each moment that can be its peak; the peak is the largest."""
    if decision.sharding not in SHARDINGS:
        raise PlanError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {decision.sharding!r}")
    if decision.adamw not in ADAMW_KINDS:
        raise PlanError(f"--adamw must be one of {', '.join(ADAMW_KINDS)}, got {decision.adamw!r}")
    if not 0 <= decision.checkpointed_blocks <= spec.depth:
        raise PlanError(
            f"--checkpointing {decision.checkpointed_blocks} is outside 0..{spec.depth} (the model's depth)"
        )
    chosen = moments(spec, decision)
    by_moment = {m: phase_components(spec, decision, cluster, assumptions, m) for m in chosen}
    floor = online_floor_bytes(spec, decision, cluster, assumptions, by_moment)
    # a release under pressure returns the gradients' extra segments (whole free ones), not the encoder's
    spare_floor = max(floor, gradient_segment_floor_bytes(spec, decision, cluster, assumptions, by_moment))
    for m in chosen if spare_floor else ():
        by_moment[m]["allocator"] = allocator_bytes(
            spec, decision, cluster, assumptions, by_moment[m], m, floor_bytes=spare_floor
        )
    reclaimable = {
        m: by_moment[m]["allocator"]
        - allocator_bytes(
            spec, decision, cluster, assumptions, by_moment[m], m, pressure=True, floor_bytes=floor
        )
        for m in chosen
    }
    peak = max(chosen, key=lambda m: sum(by_moment[m].values()))
    budget = cluster.vram_bytes if budget_bytes is None else budget_bytes
    return MemoryEstimate(
        phases=by_moment,
        peak_phase=peak,
        vram_bytes=cluster.vram_bytes,
        budget_bytes=budget,
        reclaimable=reclaimable,
    )
