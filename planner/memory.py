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

from planner import repa, vae
from planner.allocator import (
    accumulating_encode_bytes,
    block_parameter_elements,
    new_gradient_segment_bytes,
    online_reserved_bytes,
    outer_parameter_elements,
    parameter_rounding_bytes,
    reserved_bytes,
    stream_pool_reserved,
)
from planner.errors import PlanError
from planner.hardware import Assumptions, GPUPreset
from planner.repa import DEFAULT_PROJECTOR_DIM
from planner.rules import SHARDING_MODES
from planner.spec import TIMESTEP_FREQ_DIM, DiTSpec

COMPONENTS = (
    "weights",
    "grads",
    "optimizer",
    "ema",
    "activations",
    "autocast_cache",
    "vae",
    "repa",
    "temporaries",
    "allocator",
    "overhead",
)
# the tensors themselves: what torch.cuda.max_memory_allocated counts
ALLOCATED = (
    "weights",
    "grads",
    "optimizer",
    "ema",
    "activations",
    "autocast_cache",
    "vae",
    "repa",
    "temporaries",
)
PHASES = (
    "vae_encode",
    "repa_encode",
    "last_block_forward",
    "end_of_forward",
    "start_of_backward",
    "end_of_backward",
    "optimizer_step",
)  # the moments, in the order the step reaches them
BACKWARD_MOMENTS = ("start_of_backward", "end_of_backward")
FORWARD_MOMENTS = ("last_block_forward", "end_of_forward")
SHARDINGS = tuple(SHARDING_MODES)
ADAMW_KINDS = ("fused", "foreach", "single")
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


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of the tensors autograd saves, which depend on where autocast casts.

    compute: matmul outputs and the residual stream (the patch-embedding conv already yields bf16 under
             autocast, so diffusers' residual stream is bf16).
    norm:    layer_norm inputs, outputs and statistics. CUDA autocast runs layer_norm in fp32, so it saves an
             fp32 copy of its bf16 input and returns fp32; CPU autocast runs it in bf16.
    table:   the class-embedding table as the forward reads it: fp32 master weights under autocast (an
             embedding is never cast, so the conditioning, timestep + class embedding, is fp32 and so is the
             table's gradient); the compute dtype in pure low precision (FSDP2's bf16 parameters).
    """

    compute: int
    norm: int
    table: int = FP32_BYTES

    @property
    def linear_input_casts(self) -> bool:
        """An fp32 norm output feeds bf16 linears: autocast casts it anew for every linear that reads it
        (its cast cache holds only leaf tensors, i.e. weights), so q, k and v each save their own copy."""
        return self.norm != self.compute

    @property
    def norm_saves_block_input(self) -> bool:
        """layer_norm in the residual dtype saves the block's input itself (one storage, not a copy)."""
        return self.norm == self.compute


def element_bytes(precision: str, autocast_device: str = "cuda", pure: bool = False) -> ElementBytes:
    """Saved dtypes of a bf16/fp16 step under autocast over fp32 weights (`autocast_device`'s op lists), or,
    `pure`, with the parameters themselves in bf16/fp16 and no autocast: sharded plans, whose FSDP2
    MixedPrecisionPolicy gathers bf16 parameters and casts the network's input, while Accelerate's FSDP2 path
    adds no autocast. Then every op runs in the compute dtype on either device, layer norms included."""
    if precision == "fp32":
        return ElementBytes(compute=4, norm=4)
    if precision not in ("bf16", "fp16"):
        raise PlanError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
    if pure:
        return ElementBytes(compute=2, norm=2, table=2)
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


def backward_held_matrix_params(spec: DiTSpec) -> int:
    """Weight copies outside the blocks still saved once the final layer's backward has run: the patch
    conv's and the embedder's second timestep linear's (every block's embedder call saves that one copy)."""
    d, p = spec.hidden, spec.patch
    return spec.in_channels * p * p * d + d * d


def class_table_params(spec: DiTSpec) -> int:
    """The class embedding table (with the null class): the one parameter autocast never casts."""
    return (spec.num_classes + 1) * spec.hidden


def buffer_bytes(spec: DiTSpec) -> int:
    """The fixed sin-cos positional table, an fp32 buffer of tokens x hidden."""
    return FP32_BYTES * spec.tokens * spec.hidden


# --- activations: what autograd saves, op by op ------------------------------------------------------


def hidden_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """One residual-stream tensor (b x s x d in the compute dtype): a block's input, output or gated branch."""
    return micro_batch * spec.tokens * spec.hidden * eb.compute


def embedder_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """One call of the shared embedder and the adaLN projection that reads it (made in every block).

    sinusoids cast to the compute dtype (saved by linear_1), linear_1 output (SiLU), SiLU output (linear_2),
    class labels (embedding), the conditioning (timestep emb + class emb, in the table's dtype: fp32 under
    autocast; saved by the adaLN SiLU), the adaLN linear's input, and its 6d output (the gates are saved as
    views of it).
    """
    b, d, c = micro_batch, spec.hidden, eb.compute
    return b * (TIMESTEP_FREQ_DIM * c + 2 * d * c + INT64_BYTES + d * eb.table + d * c + 6 * d * c)


def block_saved_bytes(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, attention: str = "fused"
) -> dict[str, int]:
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
    return hidden_bytes(spec, micro_batch, eb)


def patch_input_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """The noised latents cast to the compute dtype, saved by the patch-embedding conv."""
    return micro_batch * spec.in_channels * spec.latent_size**2 * eb.compute


def final_layer_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """The final layer: its embedder call, the adaLN-style modulation of norm_out (proj_out_1's input and
    1 + scale), norm_out's input, statistics and output, and proj_out_2's input."""
    b, s, d, c, n = micro_batch, spec.tokens, spec.hidden, eb.compute, eb.norm
    tokens = b * s
    embedder = b * (TIMESTEP_FREQ_DIM * c + 2 * d * c + INT64_BYTES + d * eb.table)
    modulation = b * d * c + b * d * c
    norm_out = tokens * d * n + 2 * tokens * n + tokens * d * n + tokens * d * c
    return embedder + modulation + norm_out


def head_and_tail_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Patch-embedding conv input and the final layer; the loss's tensors are counted separately."""
    return patch_input_bytes(spec, micro_batch, eb) + final_layer_saved_bytes(spec, micro_batch, eb)


def loss_saved_bytes(spec: DiTSpec, micro_batch: int, loss_tensors: float) -> int:
    """`loss_tensors` output-sized fp32 tensors of the diffusion loss."""
    return int(loss_tensors * micro_batch * spec.out_channels * spec.latent_size**2 * FP32_BYTES)


def saved_activation_bytes(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, checkpointed_blocks: int = 0, attention: str = "fused"
) -> int:
    """Every tensor autograd holds for backward after the forward of the network (loss excluded).

    This is the figure a saved-tensor trace measures (storages de-duplicated, parameters excluded).
    """
    if not 0 <= checkpointed_blocks <= spec.depth:
        raise PlanError(
            f"--checkpointing {checkpointed_blocks} is outside 0..{spec.depth} (the model's depth)"
        )
    full = sum(block_saved_bytes(spec, micro_batch, eb, attention).values())
    kept = (spec.depth - checkpointed_blocks) * full
    kept += checkpointed_blocks * checkpointed_block_saved_bytes(spec, micro_batch, eb)
    if checkpointed_blocks:
        kept += 2 * micro_batch * INT64_BYTES  # the timestep and label tensors the checkpoints hold
    return head_and_tail_saved_bytes(spec, micro_batch, eb) + kept


def recompute_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes, attention: str = "fused") -> int:
    """What rerunning a checkpointed block's forward in backward adds to the input it kept: its saved set,
    less that input where layer_norm saves the input itself (CPU autocast, fp32)."""
    block = sum(block_saved_bytes(spec, micro_batch, eb, attention).values())
    return block - (hidden_bytes(spec, micro_batch, eb) if eb.norm_saves_block_input else 0)


def checkpointed_forward_peak(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, casts_weights: bool = False
) -> tuple[int, int]:
    """(activations, weight copies) alive at the peak inside a checkpointed block's forward. Nothing of it is
    saved; always alive are the block's adaLN output (b x 6d) and, at its MLP, the gated attention output and
    the residual after it (compute dtype) and the modulated MLP input (the norm's dtype: fp32 under CUDA
    autocast). The peak is the larger of two points: at the GELU (the MLP's hidden layer before and after it)
    or at the MLP's output linear (the GELU output, the linear's output and, under autocast, its weight and
    bias copy, cast uncached: `casts_weights`), which wins when the micro-batch has few tokens (b s < ~4d/3)."""
    b, s, d, c = micro_batch, spec.tokens, spec.hidden, eb.compute
    tokens, hidden = b * s, spec.mlp_hidden
    common = tokens * d * (2 * c + eb.norm) + b * 6 * d * c
    at_gelu = common + 2 * tokens * hidden * c
    at_output = common + tokens * hidden * c + tokens * d * c
    output_copy = (hidden * d + d) * c if casts_weights else 0
    return (at_gelu, 0) if at_gelu >= at_output + output_copy else (at_output, output_copy)


def checkpointed_forward_working_bytes(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, casts_weights: bool = False
) -> int:
    """Everything a checkpointed block's forward holds at its peak (`checkpointed_forward_peak`), in bytes."""
    return sum(checkpointed_forward_peak(spec, micro_batch, eb, casts_weights))


def noised_input_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """The noised latents x_t in fp32, which the objective holds through the network's forward (the loss reads
    them) beside the compute-dtype copy the patch conv saves; in fp32 they are that saved input itself."""
    return (
        0 if eb.compute == FP32_BYTES else micro_batch * spec.in_channels * spec.latent_size**2 * FP32_BYTES
    )


def backward_temporary_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Alive inside a block's backward at its peak (the matmul making the gradient of the MLP's hidden layer):
    that gradient (b s 4d) and two hidden-sized activation gradients, the second MLP linear's weight gradient
    in the compute dtype (4d x d), and the shared embedder's gradients, which autograd buffers until every
    block has contributed: the class table's in its own dtype (embedding backward; fp32 under autocast) and the
    timestep MLP's second and first linear in the compute dtype; and small ones, a per-image modulation
    gradient (b x d) and three bias gradients (d each)."""
    b, s, d, c = micro_batch, spec.tokens, spec.hidden, eb.compute
    activation_grads = b * s * (spec.mlp_hidden + 2 * d) * c + b * d * c
    mlp_weight_grad = spec.mlp_hidden * d * c + 3 * d * c
    embedder_grads = eb.table * class_table_params(spec) + (d * d + TIMESTEP_FREQ_DIM * d) * c
    return activation_grads + mlp_weight_grad + embedder_grads


# --- the step ----------------------------------------------------------------------------------------


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


def _shards(decision: Decision, cluster: Cluster) -> int:
    """The GPUs that share one copy of the sharded states: all of them (zero2/zero3), one node's (hsdp)."""
    return SHARDING_MODES[decision.sharding].shard_degree(cluster.nodes, cluster.gpus_per_node)


def _eb(decision: Decision, assumptions: Assumptions) -> ElementBytes:
    """Sharded plans compute in pure low precision (FSDP2's bf16 parameters, no autocast); the others autocast."""
    return element_bytes(decision.precision, assumptions.autocast_device, pure=decision.sharded)


def moments(spec: DiTSpec, decision: Decision) -> list[str]:
    """The moments of this step that can hold its peak."""
    chosen = []
    for moment in PHASES:
        if moment == "vae_encode" and decision.latents != "online":
            continue
        if moment == "repa_encode" and not decision.repa:
            continue
        if moment == "last_block_forward" and decision.checkpointed_blocks < spec.depth:
            continue  # a stored last block's forward holds less than the end of the forward
        chosen.append(moment)
    return chosen


def weights_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """fp32 master weights (sharded under zero2/zero3) + the positional buffer + FSDP's gathered copies.

    FSDP (Accelerate sets param_dtype to the mixed-precision dtype) all-gathers a unit's parameters for compute.
    SHARD_GRAD_OP keeps every unit gathered from forward until the end of backward; FULL_SHARD frees each unit
    after use and holds at most two (the current one and the prefetched next) plus the root (embedder, patch
    embedding, final layer). Neither holds gathered copies before the forward or at the optimizer step.
    """
    params = spec.params_trainable
    total = FP32_BYTES * params // _shards(decision, cluster) + buffer_bytes(spec)
    return total + gathered_bytes(spec, decision, moment)


def gathered_bytes(spec: DiTSpec, decision: Decision, moment: str) -> int:
    """FSDP's all-gathered parameter copies in the compute dtype at `moment` (none under DDP, before the
    forward or at the optimizer step): every unit under zero2, two units and the root otherwise."""
    if not decision.sharded or moment not in FORWARD_MOMENTS + BACKWARD_MOMENTS:
        return 0
    params = spec.params_trainable
    if decision.sharding == "zero2":
        return element_bytes(decision.precision).compute * params
    units = min(2, spec.depth) * spec.block_params + params - spec.depth * spec.block_params
    return element_bytes(decision.precision).compute * units


def stream_pool_bytes(spec, decision, cluster, assumptions) -> int:
    """FSDP2's side streams keep pools the default stream's requests cannot take (torch 2.13,
    fully_shard/_fsdp_collectives.py): the flat all-gather outputs are allocated on the copy-in stream (up to
    the units in flight with prefetch; each is freed once copied out into the unsharded parameters, which live
    on the default stream and count as weights; zero2 gathers each unit once, zero3 again in backward: two
    units and the root in flight either way), and each reduce-scatter's output shard on the reduce-scatter
    stream (its unsharded input is default-stream memory). Once the first step has run both pools stay
    cached at every moment (so none is asked for), held in the allocator's units (`stream_pool_reserved`).
    A release under pressure returns them (whole free segments, free pages)."""
    if not decision.sharded:
        return 0
    compute = _eb(decision, assumptions).compute
    root = spec.params_trainable - spec.depth * spec.block_params
    in_flight = [compute * spec.block_params] * min(2, spec.depth) + [compute * root]  # prefetch: 2 units
    scatter_shard = compute * spec.block_params // cluster.world_size
    segments = assumptions.allocator_segments
    return stream_pool_reserved(in_flight, segments) + stream_pool_reserved([scatter_shard], segments)


def live_gradient_params(spec: DiTSpec, decision: Decision, moment: str, zero_grad: str = "none") -> int:
    """Parameters whose gradient exists at `moment` (before DDP buckets and sharding).

    `zero_grad(set_to_none=True)` frees every gradient after the optimizer step, so with one micro-step they
    appear only as backward makes them: the final layer's first (its backward runs first), then each block's
    as it finishes; the shared embedder's and the patch embedding's come last. When accumulating, the earlier
    micro-steps' sums live through the whole forward and backward, and so does every gradient when zero_grad
    only zeroes them (`zero_grad="zeros"`, set_to_none=False: torch 1.13's default).
    """
    params = spec.params_trainable
    if moment == "optimizer_step" or decision.grad_accum > 1 or zero_grad == "zeros":
        return params
    if moment == "start_of_backward":
        return spec.param_breakdown()["final_layer"]
    if moment == "end_of_backward":
        return params - spec.block_params - spec.embedder_params - spec.param_breakdown()["patch_embed"]
    return 0


def grads_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """fp32 gradients alive at the moment (`live_gradient_params`), plus DDP's flat all-reduce buckets.

    DDP allocates buckets of another 4 B/param for the whole run unless gradient_as_bucket_view makes the
    gradients live in them. Sharded runs keep 1/N of the gradients (reduce-scattered every micro-step:
    sync_each_batch).
    """
    alive = FP32_BYTES * live_gradient_params(spec, decision, moment, assumptions.zero_grad)
    if decision.sharded:
        return alive // _shards(decision, cluster)
    buckets = FP32_BYTES * spec.params_trainable if cluster.world_size > 1 else 0
    if gradients_in_buckets(decision, cluster):
        return buckets
    return buckets + alive


def optimizer_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """AdamW's exp_avg and exp_avg_sq in fp32: 8 B/param, sharded under zero2/zero3 (from the first step on)."""
    return 2 * FP32_BYTES * spec.params_trainable // _shards(decision, cluster)


def ema_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """The EMA weights in fp32 on the GPU (sharded like the parameters when FSDP shards)."""
    return FP32_BYTES * spec.params_trainable // _shards(decision, cluster) if decision.ema else 0


def activations_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """Tensors made by the forward and still alive (saved for backward, or held by the code running).

    last_block_forward  (every block checkpointed) every block's input, the patch conv's input, the noised
                        input x_t and the last block's working set at its MLP; nothing of it is saved.
    end_of_forward      every saved tensor (stored blocks, checkpointed blocks' inputs, head and tail) and
                        the loss's working set: the learned-sigma VB term evaluates the KL and the
                        discretised-Gaussian NLL for every sample, `loss_tensors` output-sized fp32 tensors.
    start_of_backward   the loss and the final layer's saved tensors are gone, and the last block's gate has
                        freed its input (the MLP output); a checkpointed last block is recomputed first.
                        The first blocks, when checkpointed, are recomputed only after every stored block's
                        activations are gone, so no recompute set counts here otherwise.
    end_of_backward     block 0's set (recomputed if checkpointed) less its MLP output, and the patch input.
    """
    if moment in ("vae_encode", "repa_encode", "optimizer_step"):
        return 0
    eb = _eb(decision, assumptions)
    b, k = decision.micro_batch, decision.checkpointed_blocks
    hidden = hidden_bytes(spec, b, eb)
    if moment == "last_block_forward":
        saved_before_head = saved_activation_bytes(
            spec, b, eb, k, assumptions.attention
        ) - final_layer_saved_bytes(spec, b, eb)
        working, _ = checkpointed_forward_peak(spec, b, eb, casts_weights(decision))
        return saved_before_head + noised_input_bytes(spec, b, eb) + working
    if moment == "end_of_forward":
        return saved_activation_bytes(spec, b, eb, k, assumptions.attention) + loss_saved_bytes(
            spec, b, assumptions.loss_tensors
        )
    if moment == "start_of_backward":
        last_recomputed = recompute_bytes(spec, b, eb, assumptions.attention) if k == spec.depth else 0
        return (
            saved_activation_bytes(spec, b, eb, k, assumptions.attention)
            - final_layer_saved_bytes(spec, b, eb)
            - hidden
            + last_recomputed
        )
    # end_of_backward: block 0's backward
    if k:
        block0 = (
            checkpointed_block_saved_bytes(spec, b, eb)
            + 2 * b * INT64_BYTES
            + recompute_bytes(spec, b, eb, assumptions.attention)
        )
    else:
        block0 = sum(block_saved_bytes(spec, b, eb, assumptions.attention).values())
    return patch_input_bytes(spec, b, eb) + block0 - hidden


def casts_weights(decision: Decision) -> bool:
    """Autocast casts the weights (bf16/fp16 over fp32 master weights); not in fp32 and not under FSDP, whose
    gathered parameters are already in the compute dtype."""
    return decision.precision != "fp32" and not decision.sharded


def autocast_cache_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """bf16/fp16 copies of weights that autocast makes. Not under FSDP (the gathered parameters are already in
    the compute dtype) and not in fp32.

    In the forward autocast's cache holds a copy of every weight it cast outside checkpointed blocks (biases
    too) until the context exits after the loss: every parameter but the class table (an embedding is never
    cast) and the checkpointed blocks' own. A checkpointed block casts with the cache off (dit_accel.model), so
    its copies live only while its ops run; the shared embedder it calls stays cached. Inside the last block's
    forward, when every block is checkpointed, the cache holds the patch conv's and the embedder's copies (the
    final layer has cast nothing yet), beside the block's own uncached copy in use at its peak, if any
    (`checkpointed_forward_peak`). In backward only the copies
    linears saved remain: of every stored block, the patch conv and the embedder's second timestep linear (the
    output projections' go with the final layer's backward). A recomputed block casts its weights again (and
    the embedder's linear), so block 0's backward holds that one block's copies.
    """
    if not casts_weights(decision) or moment in ("vae_encode", "optimizer_step"):
        return 0
    c = element_bytes(decision.precision).compute
    k = decision.checkpointed_blocks
    if moment == "end_of_forward":
        return c * (spec.params_trainable - class_table_params(spec) - k * spec.block_params)
    if moment == "last_block_forward":
        _, in_use = checkpointed_forward_peak(spec, decision.micro_batch, _eb(decision, assumptions), True)
        return in_use + c * (
            spec.params_trainable
            - class_table_params(spec)
            - spec.param_breakdown()["final_layer"]
            - spec.depth * spec.block_params
        )
    if moment == "start_of_backward" and k < spec.depth:
        return c * ((spec.depth - k) * block_matrix_params(spec) + backward_held_matrix_params(spec))
    return c * (block_matrix_params(spec) + backward_held_matrix_params(spec))


def vae_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """Online latents: the VAE's weights for the whole run, and during the encode its no-grad working set
    (`vae_activation_maps` full-resolution 128-channel maps; see planner/vae.py)."""
    if decision.latents != "online":
        return 0
    total = assumptions.vae_params * assumptions.vae_bytes_per_param
    if moment == "vae_encode":
        total += vae.encoder_activation_bytes(
            spec.resolution,
            decision.micro_batch,
            assumptions.vae_activation_maps,
            assumptions.vae_bytes_per_param,
        )
    return total


def repa_projector_params(spec: DiTSpec, decision: Decision) -> int:
    """REPA's projector (trained with the network, never sampled): 0 without REPA."""
    if not decision.repa:
        return 0
    encoder = repa.encoder_spec(decision.repa)
    return repa.projector_params(spec.hidden, encoder.dim, decision.repa_projector_dim)


def repa_persistent_bytes(spec: DiTSpec, decision: Decision, cluster: Cluster) -> int:
    """What REPA keeps for the whole run: the frozen encoder's fp32 weights on every GPU, and the projector's
    fp32 weights and AdamW moments, sharded like the network's (it sits in FSDP2's root unit)."""
    if not decision.repa:
        return 0
    projector = 3 * FP32_BYTES * repa_projector_params(spec, decision) // _shards(decision, cluster)
    return FP32_BYTES * repa.encoder_spec(decision.repa).params + projector


def repa_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """REPA's share of the step, kept in one component so the network's formulas stay the DiT's.

    Always: `repa_persistent_bytes`. The projector's gradient once backward has made it (from the start when
    accumulating, as the network's). `repa_encode`: the encoder's no-grad working set and, under autocast,
    the cast copy of one weight at a time (autocast caches casts of weights that require gradients only: a
    frozen encoder's are made and freed per op; the largest counts). Forward and backward: the
    encoder's target tokens and what the projector saves for backward (its two SiLUs' inputs and outputs
    per token; gone once backward has passed it, before block 0), and FSDP2's gathered copy of it.
    """
    if not decision.repa:
        return 0
    encoder, eb = repa.encoder_spec(decision.repa), _eb(decision, assumptions)
    projector, shards = repa_projector_params(spec, decision), _shards(decision, cluster)
    b, grid = decision.micro_batch, spec.latent_size // spec.patch
    total = repa_persistent_bytes(spec, decision, cluster)
    if moment in ("end_of_backward", "optimizer_step") or decision.grad_accum > 1:
        total += FP32_BYTES * projector // shards
    if moment == "repa_encode":
        lower = eb.compute < FP32_BYTES and not decision.sharded
        casts = eb.compute * encoder.largest_matrix_params() if lower else 0
        return total + encoder.activation_bytes(grid, b, eb.compute) + casts
    if moment in FORWARD_MOMENTS or moment == "start_of_backward":
        total += b * spec.tokens * (encoder.dim + 4 * decision.repa_projector_dim) * eb.compute
    if decision.sharded and moment in (*FORWARD_MOMENTS, *BACKWARD_MOMENTS):
        total += eb.compute * projector
    return total


def largest_step_temporary_params(spec: DiTSpec) -> int:
    """PyTorch's per-tensor AdamW makes the denominator of each parameter in two steps (sqrt, then the division)
    while the loop variable still holds the previous parameter's: most at the adaLN projection (6d x d, the
    largest matrix) of block 0, which follows the class table."""
    d = spec.hidden
    return 2 * 6 * d * d + class_table_params(spec)


def temporaries_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """Short-lived buffers at each moment.

    Backward moments: activation and weight gradients in flight and the shared embedder's buffered gradients
    (`backward_temporary_bytes`) and, under FSDP, one unit's unsharded gradient before its reduce-scatter.
    Optimizer step: foreach AdamW's sqrt(exp_avg_sq) of every parameter (4 B/param; torch 2.0's made the
    denominator beside it: `foreach_adamw_lists`); the per-tensor loop's denominators of two parameters; fused
    AdamW none.
    """
    eb = _eb(decision, assumptions)
    if moment in BACKWARD_MOMENTS:
        working = backward_temporary_bytes(spec, decision.micro_batch, eb)
        if decision.sharded:
            working += eb.compute * spec.block_params
        return working
    if moment == "optimizer_step":
        if decision.adamw == "foreach":
            lists = assumptions.foreach_adamw_lists
            return lists * FP32_BYTES * spec.params_trainable // _shards(decision, cluster)
        if decision.adamw == "single":
            return FP32_BYTES * largest_step_temporary_params(spec)
    return 0


def overhead_bytes(cluster: Cluster, assumptions: Assumptions) -> int:
    """Memory outside PyTorch's caching allocator: CUDA context, NCCL buffers (multi-GPU only)."""
    fixed = assumptions.cuda_context_bytes
    if cluster.world_size > 1:
        fixed += assumptions.nccl_buffer_bytes
    return int(fixed)


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
    shards = _shards(decision, cluster)
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
        states_rounding = 2 * parameter_rounding_bytes(spec, FP32_BYTES, _shards(decision, cluster), segments)
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


def gradients_in_buckets(decision: Decision, cluster: Cluster) -> bool:
    """DDP on several GPUs with gradient_as_bucket_view: the gradients live in the buckets, allocated at the
    start, and what autograd makes is copied in and freed at once. Sharded plans have no DDP buckets."""
    return cluster.world_size > 1 and not decision.sharded and decision.gradient_as_bucket_view


def accumulated_gradient_bytes(spec, decision, cluster) -> int:
    """The gradients the earlier micro-steps leave alive through a later one's encode, made by the first
    micro-step's backward, REPA's projector's among them: 0 without accumulation or in DDP's buckets; a
    shard of them under FSDP (each micro-step reduce-scatters into it)."""
    if decision.grad_accum == 1 or gradients_in_buckets(decision, cluster):
        return 0
    params = spec.params_trainable + repa_projector_params(spec, decision)
    return FP32_BYTES * params // _shards(decision, cluster)


def largest_transient_bytes(spec: DiTSpec, decision: Decision, assumptions: Assumptions) -> int:
    """The largest tensor the step allocates and frees: the MLP's hidden activation (and its gradient, the same
    size), the attention probabilities when attention is not fused, autocast's copy of the adaLN matrix. Not
    the online VAE encoder's maps: the DiT's forward splits them, and the replay of DiT-XL/2 fp32 at micro-batch
    8 online still maps the gradients' own segments in its first backward."""
    eb = _eb(decision, assumptions)
    tokens = decision.micro_batch * spec.tokens
    largest = tokens * spec.mlp_hidden * eb.compute
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
