"""Each memory component of one training step at one moment (`COMPONENTS`, `PHASES`): the weights (and
FSDP's gathered ones), the gradients alive then, AdamW's state, the EMA, the saved activations
(`planner.activations`), autocast's cast cache, the VAE and REPA's encoder, the temporaries, and the
overhead outside PyTorch's allocator. `planner.memory` adds the allocator's share and finds the peak."""

from __future__ import annotations

from dataclasses import dataclass

from planner import repa, vae
from planner.activations import (
    FP32_BYTES,
    INT64_BYTES,
    ElementBytes,
    backward_held_matrix_params,
    backward_temporary_bytes,
    block_matrix_params,
    block_saved_bytes,
    buffer_bytes,
    checkpointed_block_saved_bytes,
    checkpointed_forward_peak,
    class_table_params,
    element_bytes,
    final_layer_saved_bytes,
    hidden_bytes,
    lightningdit_backward_freed_bytes,
    lightningdit_backward_peak_gradient_params,
    lightningdit_final_layer_backward_bytes,
    loss_saved_bytes,
    never_cast_params,
    noised_input_bytes,
    patch_input_bytes,
    recompute_bytes,
    saved_activation_bytes,
)
from planner.allocator import stream_pool_reserved
from planner.decision import Cluster, Decision
from planner.hardware import Assumptions
from planner.rules import SHARDING_MODES
from planner.spec import DiTSpec

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


def shard_count(decision: Decision, cluster: Cluster) -> int:
    """The GPUs that share one copy of the sharded states: all of them (zero2/zero3), one node's (hsdp)."""
    return SHARDING_MODES[decision.sharding].shard_degree(cluster.nodes, cluster.gpus_per_node)


def saved_element_bytes(decision: Decision, assumptions: Assumptions) -> ElementBytes:
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
    total = FP32_BYTES * params // shard_count(decision, cluster) + buffer_bytes(spec)
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
    compute = saved_element_bytes(decision, assumptions).compute
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


@dataclass(frozen=True)
class BackwardStart:
    """The planner's start_of_backward: where backward first peaks, and what is alive there beyond the
    moment's other components. DiT: inside the last block (its MLP's backward). LightningDiT peaks either in
    its final layer (three fp32 residual-sized gradients beside nearly every saved tensor) or in the last
    block's MLP (SwiGLU's gradients, with the final layer's saved tensors and w3's input freed): whichever
    holds more, which the trace bears out (the final layer at large batches in bf16, the block in fp32)."""

    where: str  # "last block" | "final layer"
    activations: int
    temporaries: int
    gradient_params: int


def backward_start(spec: DiTSpec, decision: Decision, assumptions: Assumptions) -> BackwardStart:
    eb = saved_element_bytes(decision, assumptions)
    b, k = decision.micro_batch, decision.checkpointed_blocks
    saved = saved_activation_bytes(spec, b, eb, k, assumptions.attention)
    last_recomputed = recompute_bytes(spec, b, eb, assumptions.attention) if k == spec.depth else 0
    in_last_block = saved - final_layer_saved_bytes(spec, b, eb) + last_recomputed
    fresh = live_gradient_params(spec, decision, "start_of_backward", assumptions.zero_grad)
    fresh_params = fresh != spec.params_trainable
    if spec.family != "lightningdit":
        working = backward_temporary_bytes(spec, b, eb)
        return BackwardStart("last block", in_last_block - hidden_bytes(spec, b, eb), working, fresh)
    last_block = BackwardStart(
        "last block",
        in_last_block - lightningdit_backward_freed_bytes(spec, b, eb),
        backward_temporary_bytes(spec, b, eb),
        fresh + (lightningdit_backward_peak_gradient_params(spec) if fresh_params else 0),
    )
    final_layer = BackwardStart(
        "final layer",
        saved - hidden_bytes(spec, b, eb),
        lightningdit_final_layer_backward_bytes(spec, b, eb),
        0 if fresh_params else fresh,
    )

    def alive(point: BackwardStart) -> int:
        return point.activations + point.temporaries + FP32_BYTES * point.gradient_params

    return max(last_block, final_layer, key=alive)


def grads_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """fp32 gradients alive at the moment (`live_gradient_params`), plus DDP's flat all-reduce buckets.

    DDP allocates buckets of another 4 B/param for the whole run unless gradient_as_bucket_view makes the
    gradients live in them. Sharded runs keep 1/N of the gradients (reduce-scattered every micro-step:
    sync_each_batch).
    """
    if moment == "start_of_backward":
        alive = FP32_BYTES * backward_start(spec, decision, assumptions).gradient_params
    else:
        alive = FP32_BYTES * live_gradient_params(spec, decision, moment, assumptions.zero_grad)
    if decision.sharded:
        return alive // shard_count(decision, cluster)
    buckets = FP32_BYTES * spec.params_trainable if cluster.world_size > 1 else 0
    if gradients_in_buckets(decision, cluster):
        return buckets
    return buckets + alive


def optimizer_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """AdamW's exp_avg and exp_avg_sq in fp32: 8 B/param, sharded under zero2/zero3 (from the first step on)."""
    return 2 * FP32_BYTES * spec.params_trainable // shard_count(decision, cluster)


def ema_bytes(spec, decision, cluster, assumptions, moment) -> int:
    """The EMA weights in fp32 on the GPU (sharded like the parameters when FSDP shards)."""
    return FP32_BYTES * spec.params_trainable // shard_count(decision, cluster) if decision.ema else 0


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
    eb = saved_element_bytes(decision, assumptions)
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
            spec, b, loss_tensors(spec, assumptions)
        )
    if moment == "start_of_backward":
        return backward_start(spec, decision, assumptions).activations
    # end_of_backward: block 0's backward
    if k:
        block0 = checkpointed_block_saved_bytes(spec, b, eb) + recompute_bytes(
            spec, b, eb, assumptions.attention
        )
        if spec.family == "dit":
            block0 += 2 * b * INT64_BYTES  # the timestep and labels its checkpoint holds
    else:
        block0 = sum(block_saved_bytes(spec, b, eb, assumptions.attention).values())
    if spec.family == "lightningdit":
        return patch_input_bytes(spec, b, eb) + block0 - lightningdit_backward_freed_bytes(spec, b, eb)
    return patch_input_bytes(spec, b, eb) + block0 - hidden


def loss_tensors(spec: DiTSpec, assumptions: Assumptions) -> float:
    """Output-sized fp32 tensors alive while the loss is computed: the learned-sigma VB term's many, or a
    plain MSE's few (LightningDiT's flow loss)."""
    return assumptions.loss_tensors if spec.learn_sigma else assumptions.mse_loss_tensors


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
        return c * (spec.params_trainable - never_cast_params(spec) - k * spec.block_params)
    if moment == "last_block_forward":
        _, in_use = checkpointed_forward_peak(
            spec, decision.micro_batch, saved_element_bytes(decision, assumptions), True
        )
        return in_use + c * (
            spec.params_trainable
            - never_cast_params(spec)
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
    total = vae.autoencoder_params(spec.tokenizer, assumptions.vae_params) * assumptions.vae_bytes_per_param
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
    projector = 3 * FP32_BYTES * repa_projector_params(spec, decision) // shard_count(decision, cluster)
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
    encoder, eb = repa.encoder_spec(decision.repa), saved_element_bytes(decision, assumptions)
    projector, shards = repa_projector_params(spec, decision), shard_count(decision, cluster)
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
    eb = saved_element_bytes(decision, assumptions)
    if moment == "start_of_backward":
        start = backward_start(spec, decision, assumptions)
        working = start.temporaries
        if decision.sharded and start.where == "last block":
            working += eb.compute * spec.block_params
        return working
    if moment == "end_of_backward":
        working = backward_temporary_bytes(spec, decision.micro_batch, eb)
        if decision.sharded:
            working += eb.compute * spec.block_params
        return working
    if moment == "optimizer_step":
        if decision.adamw == "foreach":
            lists = assumptions.foreach_adamw_lists
            return lists * FP32_BYTES * spec.params_trainable // shard_count(decision, cluster)
        if decision.adamw == "single":
            return FP32_BYTES * largest_step_temporary_params(spec)
    return 0


def overhead_bytes(cluster: Cluster, assumptions: Assumptions) -> int:
    """Memory outside PyTorch's caching allocator: CUDA context, NCCL buffers (multi-GPU only)."""
    fixed = assumptions.cuda_context_bytes
    if cluster.world_size > 1:
        fixed += assumptions.nccl_buffer_bytes
    return int(fixed)


def gradients_in_buckets(decision: Decision, cluster: Cluster) -> bool:
    """DDP on several GPUs with gradient_as_bucket_view: the gradients live in the buckets, allocated at the
    start, and what autograd makes is copied in and freed at once. Sharded plans have no DDP buckets."""
    return cluster.world_size > 1 and not decision.sharded and decision.gradient_as_bucket_view
