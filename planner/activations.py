"""What the DiT network holds, op by op: its parameter groups, and the bytes autograd saves for backward in
the code the trainer runs (diffusers' BasicTransformerBlock with ada_norm_zero, SDPA attention, the gelu-tanh
MLP, the shared timestep + class embedder), under fp32, autocast (CPU's or CUDA's op lists) or pure low
precision (`ElementBytes`), with checkpointed blocks and their recompute."""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlanError
from planner.spec import TIMESTEP_FREQ_DIM, DiTSpec

INT64_BYTES = 8


FP32_BYTES = 4


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
