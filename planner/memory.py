"""Bytes per GPU of one DiT training step at its peak, by component.

The network is the one the trainer runs: diffusers' DiTTransformer2DModel with one timestep+class embedder
shared by all blocks. Activations are counted op by op from what autograd saves for backward in that code
(attention.py BasicTransformerBlock with ada_norm_zero, AttnProcessor2_0 -> SDPA, FeedForward gelu-tanh 4x,
AdaLayerNormZero, CombinedTimestepLabelEmbeddings), under fp32 or autocast, and a test holds the count to a
real trace of saved tensors. Everything a tensor trace cannot see (optimizer state, EMA, DDP buckets, FSDP
gather buffers, the VAE, CUDA context, NCCL, fragmentation) is added here from its own formula.

A step has three moments that can be the peak; the estimate takes the largest:
  start_of_backward  weights + states + every saved activation (+ grads kept across accumulation)
  optimizer_step     weights + grads + AdamW states + the optimizer's temporaries
  vae_encode         (online latents) the VAE encoder's no-grad working set, before the DiT forward
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlanError
from planner.hardware import Assumptions, GPUPreset
from planner.spec import TIMESTEP_FREQ_DIM, DiTSpec
from planner import vae

COMPONENTS = ("weights", "grads", "optimizer", "ema", "activations", "autocast_cache", "vae", "temporaries", "overhead")
PHASES = ("start_of_backward", "optimizer_step", "vae_encode")
SHARDINGS = ("ddp", "zero2", "zero3")
INT64_BYTES = 8
FP32_BYTES = 4


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
    adamw: str = "fused"  # "fused" (one kernel, no temporary) | "foreach" (PyTorch's default off CUDA: 4 B/param more)
    gradient_as_bucket_view: bool = True  # DDP grads alias its buckets (saves 4 B/param); Accelerate's default is off

    @property
    def sharded(self) -> bool:
        return self.sharding != "ddp"


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of the tensors autograd saves, which depend on where autocast casts.

    compute: matmul outputs and the residual stream (the patch-embedding conv already yields bf16 under
             autocast, so diffusers' residual stream is bf16).
    norm:    layer_norm inputs, outputs and statistics. CUDA autocast runs layer_norm in fp32, so it saves an
             fp32 copy of its bf16 input and returns fp32; CPU autocast runs it in bf16.
    """

    compute: int
    norm: int

    @property
    def linear_input_casts(self) -> bool:
        """An fp32 norm output feeds bf16 linears: autocast casts it anew for every linear that reads it
        (its cast cache holds only leaf tensors, i.e. weights), so q, k and v each save their own copy."""
        return self.norm != self.compute


def element_bytes(precision: str, autocast_device: str = "cuda") -> ElementBytes:
    if precision == "fp32":
        return ElementBytes(compute=4, norm=4)
    if precision not in ("bf16", "fp16"):
        raise PlanError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
    return ElementBytes(compute=2, norm=4 if autocast_device == "cuda" else 2)


# --- parameters ---------------------------------------------------------------------------------------

def block_matrix_params(spec: DiTSpec) -> int:
    """Weight matrices of one block (q, k, v, out; MLP in and out; adaLN's 6d projection): what autocast casts."""
    d = spec.hidden
    return 4 * d * d + 2 * d * spec.mlp_hidden + 6 * d * d


def outer_matrix_params(spec: DiTSpec) -> int:
    """Weight matrices outside the blocks whose casts are saved: patch conv, the embedder's second timestep
    linear (its first reads fixed sinusoids, so no weight copy is kept), and the two output projections."""
    d, p = spec.hidden, spec.patch
    return spec.in_channels * p * p * d + d * d + 2 * d * d + d * p * p * spec.out_channels


def buffer_bytes(spec: DiTSpec) -> int:
    """The fixed sin-cos positional table, an fp32 buffer of tokens x hidden."""
    return FP32_BYTES * spec.tokens * spec.hidden


# --- activations: what autograd saves, op by op ------------------------------------------------------

def embedder_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """One call of the shared embedder and the adaLN projection that reads it (made in every block).

    sinusoids cast to the compute dtype (saved by linear_1), linear_1 output (SiLU), SiLU output (linear_2),
    class labels (embedding), the fp32 conditioning (timestep emb + fp32 class emb; saved by the adaLN SiLU),
    the adaLN linear's input, and its 6d output (the gates are saved as views of it).
    """
    b, d, c = micro_batch, spec.hidden, eb.compute
    return b * (TIMESTEP_FREQ_DIM * c + 2 * d * c + INT64_BYTES + d * FP32_BYTES + d * c + 6 * d * c)


def block_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes, attention: str = "fused") -> dict[str, int]:
    """Saved tensors of one BasicTransformerBlock (ada_norm_zero), by op. `b*s*d` elements unless noted."""
    b, s, d, h = micro_batch, spec.tokens, spec.hidden, spec.heads
    c, n = eb.compute, eb.norm
    tokens = b * s
    linear_input_copies = 3 if eb.linear_input_casts else 1
    parts = {
        "embedder+adaLN": embedder_saved_bytes(spec, b, eb),
        "1+scale (x2)": 2 * b * d * c,
        "norm1 input, mean, rstd": tokens * d * n + 2 * tokens * n,
        "norm1 output (modulation mul)": tokens * d * n,
        "q/k/v input": linear_input_copies * tokens * d * c,
        "q, k, v (attention)": 3 * tokens * d * c,
        "attention output + logsumexp": tokens * d * c + b * h * s * FP32_BYTES,
        "out-projection output (gate mul)": tokens * d * c,
        "norm2 input, mean, rstd": tokens * d * n + 2 * tokens * n,
        "norm2 output (modulation mul)": tokens * d * n,
        "mlp input": tokens * d * c,
        "mlp hidden (gelu input)": tokens * spec.mlp_hidden * c,
        "gelu output (mlp out input)": tokens * spec.mlp_hidden * c,
        "mlp output (gate mul)": tokens * d * c,
    }
    if attention == "math":
        parts["attention probabilities (non-fused)"] = b * h * s * s * c
    return parts


def checkpointed_block_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """A checkpointed block keeps only its input hidden states (timestep and labels are shared, counted once)."""
    return micro_batch * spec.tokens * spec.hidden * eb.compute


def head_and_tail_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Patch-embedding conv input; the final layer (its embedder call, adaLN-style modulation of norm_out,
    proj_out_2's input); the loss's output-sized fp32 tensors are added separately."""
    b, s, d, c, n = micro_batch, spec.tokens, spec.hidden, eb.compute, eb.norm
    tokens = b * s
    patch_input = b * spec.in_channels * spec.latent_size**2 * c
    embedder = b * (TIMESTEP_FREQ_DIM * c + 2 * d * c + INT64_BYTES + d * FP32_BYTES)
    final = b * d * c + b * d * c  # proj_out_1 input (SiLU output), 1 + scale
    final += tokens * d * n + 2 * tokens * n + tokens * d * n + tokens * d * c  # norm_out in/stats/out, proj_out_2 input
    return patch_input + embedder + final


def loss_saved_bytes(spec: DiTSpec, micro_batch: int, loss_tensors: float) -> int:
    return int(loss_tensors * micro_batch * spec.out_channels * spec.latent_size**2 * FP32_BYTES)


def saved_activation_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes, checkpointed_blocks: int = 0,
                           attention: str = "fused") -> int:
    """Every tensor autograd holds for backward after the forward of the network (loss excluded).

    This is the figure a saved-tensor trace measures (storages de-duplicated, parameters excluded).
    """
    if not 0 <= checkpointed_blocks <= spec.depth:
        raise PlanError(f"--checkpointing {checkpointed_blocks} is outside 0..{spec.depth} (the model's depth)")
    full = sum(block_saved_bytes(spec, micro_batch, eb, attention).values())
    kept = (spec.depth - checkpointed_blocks) * full
    kept += checkpointed_blocks * checkpointed_block_saved_bytes(spec, micro_batch, eb)
    if checkpointed_blocks:
        kept += 2 * micro_batch * INT64_BYTES  # the timestep and label tensors the checkpoints hold
    return head_and_tail_saved_bytes(spec, micro_batch, eb) + kept


def recompute_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes, checkpointed_blocks: int,
                    attention: str = "fused") -> int:
    """While backward reaches a checkpointed block, its forward is rerun: one block's saved tensors are alive.
    Counted at the start of backward, which bounds the case where the last blocks are the checkpointed ones."""
    if not checkpointed_blocks:
        return 0
    return sum(block_saved_bytes(spec, micro_batch, eb, attention).values())


# --- the step ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    phases: dict  # phase -> {component: bytes}
    peak_phase: str
    vram_bytes: int
    budget_bytes: int

    @property
    def components(self) -> dict[str, int]:
        """Components at the peak phase; they sum to peak_bytes."""
        return self.phases[self.peak_phase]

    @property
    def peak_bytes(self) -> int:
        return sum(self.components.values())

    def phase_bytes(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes


def _shards(decision: Decision, cluster: Cluster) -> int:
    return cluster.world_size if decision.sharded else 1


def weights_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """fp32 master weights (sharded under zero2/zero3) + the positional buffer + FSDP's gathered copies.

    FSDP (Accelerate sets param_dtype to the mixed-precision dtype) all-gathers a unit's parameters for compute.
    SHARD_GRAD_OP keeps every unit gathered from forward until the end of backward; FULL_SHARD frees each unit
    after use and holds at most two (the current one and the prefetched next) plus the root (embedder, patch
    embedding, final layer). Both free the gathered copies before the optimizer step.
    """
    params = spec.params_trainable
    total = FP32_BYTES * params // _shards(decision, cluster) + buffer_bytes(spec)
    if decision.sharded and phase != "optimizer_step":
        gathered = element_bytes(decision.precision).compute
        if decision.sharding == "zero2":
            total += gathered * params
        else:
            total += gathered * (min(2, spec.depth) * spec.block_params + params - spec.depth * spec.block_params)
    return total


def grads_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """fp32 gradients, plus DDP's flat all-reduce buckets.

    Gradients exist at the optimizer step, and at the start of backward only when accumulating (the earlier
    micro-steps' sums; `zero_grad(set_to_none=True)` frees them otherwise). DDP allocates buckets of another
    4 B/param for the whole run unless gradient_as_bucket_view makes the gradients live in them. Sharded
    runs keep 1/N of the gradients (Accelerate should then reduce-scatter every micro-step: sync_each_batch).
    """
    params = spec.params_trainable
    alive = phase == "optimizer_step" or decision.grad_accum > 1
    if decision.sharded:
        return FP32_BYTES * params // cluster.world_size if alive else 0
    buckets = FP32_BYTES * params if cluster.world_size > 1 else 0
    if buckets and decision.gradient_as_bucket_view:
        return buckets
    return buckets + (FP32_BYTES * params if alive else 0)


def optimizer_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """AdamW's exp_avg and exp_avg_sq in fp32: 8 B/param, sharded under zero2/zero3."""
    return 2 * FP32_BYTES * spec.params_trainable // _shards(decision, cluster)


def ema_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """The EMA weights in fp32 on the GPU (sharded like the parameters when FSDP shards)."""
    return FP32_BYTES * spec.params_trainable // _shards(decision, cluster) if decision.ema else 0


def activations_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """Saved activations + the recompute working set + what the diffusion loss saves (start of backward only)."""
    if phase != "start_of_backward":
        return 0
    eb = element_bytes(decision.precision, assumptions.autocast_device)
    b, c = decision.micro_batch, decision.checkpointed_blocks
    return (saved_activation_bytes(spec, b, eb, c, assumptions.attention)
            + recompute_bytes(spec, b, eb, c, assumptions.attention)
            + loss_saved_bytes(spec, b, assumptions.loss_tensors))


def autocast_cache_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """bf16/fp16 copies of weight matrices that autocast makes and that linears save for backward.

    Not under FSDP (the gathered parameters are already in the compute dtype) and not in fp32. A
    checkpointed block keeps none; during its recompute one block's copies exist again.
    """
    if phase != "start_of_backward" or decision.precision == "fp32" or decision.sharded:
        return 0
    eb = element_bytes(decision.precision)
    kept_blocks = spec.depth - decision.checkpointed_blocks + (1 if decision.checkpointed_blocks else 0)
    return eb.compute * (outer_matrix_params(spec) + kept_blocks * block_matrix_params(spec))


def vae_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """Online latents: the VAE's weights for the whole run, and during the encode its no-grad working set."""
    if decision.latents != "online":
        return 0
    total = assumptions.vae_params * assumptions.vae_bytes_per_param
    if phase == "vae_encode":
        total += vae.encoder_activation_bytes(spec.resolution, decision.micro_batch, assumptions.vae_activation_maps,
                                              assumptions.vae_bytes_per_param)
    return total


def temporaries_bytes(spec, decision, cluster, assumptions, phase) -> int:
    """Short-lived buffers at each moment.

    start of backward: activation gradients in flight (`backward_working_tensors` MLP-sized tensors) and, under
    FSDP, one unit's unsharded gradient before its reduce-scatter. optimizer step: the foreach AdamW's
    intermediate (about one fp32 copy of the parameters it updates); fused AdamW has none.
    """
    eb = element_bytes(decision.precision)
    if phase == "start_of_backward":
        working = assumptions.backward_working_tensors * decision.micro_batch * spec.tokens * spec.mlp_hidden * eb.compute
        if decision.sharded:
            working += eb.compute * spec.block_params
        return int(working)
    if phase == "optimizer_step" and decision.adamw == "foreach":
        return FP32_BYTES * spec.params_trainable // _shards(decision, cluster)
    return 0


def overhead_bytes(cluster: Cluster, assumptions: Assumptions, allocated_bytes: int) -> int:
    """Memory outside the tensors: CUDA context, cuBLAS workspaces, NCCL buffers (multi-GPU only), and the
    caching allocator's fragmentation as a fraction of what it has allocated."""
    fixed = assumptions.cuda_context_bytes + assumptions.cublas_workspace_bytes
    if cluster.world_size > 1:
        fixed += assumptions.nccl_buffer_bytes
    return int(fixed + assumptions.fragmentation * allocated_bytes)


_COMPONENT_FUNCTIONS = {
    "weights": weights_bytes,
    "grads": grads_bytes,
    "optimizer": optimizer_bytes,
    "ema": ema_bytes,
    "activations": activations_bytes,
    "autocast_cache": autocast_cache_bytes,
    "vae": vae_bytes,
    "temporaries": temporaries_bytes,
}


def phase_components(spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions,
                     phase: str) -> dict[str, int]:
    parts = {name: int(fn(spec, decision, cluster, assumptions, phase)) for name, fn in _COMPONENT_FUNCTIONS.items()}
    parts["overhead"] = overhead_bytes(cluster, assumptions, sum(parts.values()))
    return {name: parts[name] for name in COMPONENTS}


def step_memory(spec: DiTSpec, decision: Decision, cluster: Cluster, assumptions: Assumptions,
                budget_bytes: int | None = None) -> MemoryEstimate:
    """Per-GPU memory of one training step at each moment that can be its peak."""
    if decision.sharding not in SHARDINGS:
        raise PlanError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {decision.sharding!r}")
    phases = [p for p in PHASES if p != "vae_encode" or decision.latents == "online"]
    by_phase = {p: phase_components(spec, decision, cluster, assumptions, p) for p in phases}
    peak_phase = max(phases, key=lambda p: sum(by_phase[p].values()))
    budget = cluster.vram_bytes if budget_bytes is None else budget_bytes
    return MemoryEstimate(phases=by_phase, peak_phase=peak_phase, vram_bytes=cluster.vram_bytes, budget_bytes=budget)
