"""What the network holds, op by op: its parameter groups, and the bytes autograd saves for backward in the
code the trainer runs, under fp32, autocast (CPU's or CUDA's op lists) or pure low precision (`ElementBytes`),
with checkpointed blocks and their recompute. Each public function answers for both families:

  DiT           diffusers' BasicTransformerBlock with ada_norm_zero, SDPA attention, the gelu-tanh MLP, the
                shared timestep + class embedder called in every block; its residual stream in the compute
                dtype (diffusers casts the positional table's sum back).
  LightningDiT  models.lightningdit: RMSNorm (fp32 inside, a weight), SwiGLU, 2-D RoPE on q and k, the
                conditioning made once before the blocks; its residual stream fp32 over fp32 weights (the fp32
                sin-cos table promotes the patch embedding's autocast output, as in the released network), so
                every norm keeps an fp32 input; bf16 under FSDP2's pure low precision.

DiT's terms were first set from traces of its step; LightningDiT's are read off its code and held to traces of
the trainer's step (tests/test_memtrace_grid.py, `dit-accel verify`)."""

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
    pure: bool = (
        False  # the parameters themselves in the compute dtype (FSDP2's mixed precision), no autocast
    )

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
        return ElementBytes(compute=2, norm=2, table=2, pure=True)
    return ElementBytes(compute=2, norm=4 if autocast_device == "cuda" else 2)


def block_matrix_params(spec: DiTSpec) -> int:
    """Weight matrices of one block (q, k, v, out; MLP in and out; adaLN's projection): what autocast casts."""
    d = spec.hidden
    mlp = (3 if spec.swiglu else 2) * d * spec.mlp_hidden
    return 4 * d * d + mlp + spec.modulations * d * d


def outer_matrix_params(spec: DiTSpec) -> int:
    """Weight matrices outside the blocks whose casts are saved: patch conv, the embedder's second timestep
    linear (its first reads fixed sinusoids, so no weight copy is kept), and the two output projections."""
    d, p = spec.hidden, spec.patch
    return spec.in_channels * p * p * d + d * d + 2 * d * d + d * p * p * spec.out_channels


def never_cast_params(spec: DiTSpec) -> int:
    """Parameters autocast never casts: the class table (an embedding), and LightningDiT's RMSNorm weights
    (a multiplication, not an autocast op)."""
    norms = 0
    if spec.rmsnorm:
        norms = (2 * spec.depth + 1) * spec.hidden + (2 * spec.depth * spec.head_dim if spec.qk_norm else 0)
    return class_table_params(spec) + norms


def backward_held_matrix_params(spec: DiTSpec) -> int:
    """Weight copies outside the blocks still saved once the final layer's backward has run: the patch
    conv's and the embedder's second timestep linear's (every block's embedder call saves that one copy)."""
    d, p = spec.hidden, spec.patch
    return spec.in_channels * p * p * d + d * d


def class_table_params(spec: DiTSpec) -> int:
    """The class embedding table (with the null class): the one parameter autocast never casts."""
    return (spec.num_classes + 1) * spec.hidden


def buffer_bytes(spec: DiTSpec) -> int:
    """The fixed sin-cos positional table, an fp32 buffer of tokens x hidden (and LightningDiT's rotary cos and
    sin tables, tokens x head width each)."""
    rope = 2 * spec.tokens * spec.head_dim if spec.rope else 0
    return FP32_BYTES * (spec.tokens * spec.hidden + rope)


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
    if spec.family == "lightningdit":
        return lightningdit_block_saved_bytes(spec, micro_batch, eb, attention)
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


def block_input_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """A block's input, the residual stream: the compute dtype in DiT; in LightningDiT fp32 over fp32 weights
    (fp32 and autocast), the compute dtype when the parameters are (pure)."""
    if spec.family == "lightningdit":
        return micro_batch * spec.tokens * spec.hidden * (eb.compute if eb.pure else FP32_BYTES)
    return hidden_bytes(spec, micro_batch, eb)


def checkpointed_block_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """A checkpointed block keeps only its input hidden states (the conditioning and tables are shared,
    counted once)."""
    return block_input_bytes(spec, micro_batch, eb)


def patch_input_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """The noised latents cast to the compute dtype, saved by the patch-embedding conv."""
    return micro_batch * spec.in_channels * spec.latent_size**2 * eb.compute


def final_layer_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """The final layer: its embedder call, the adaLN-style modulation of norm_out (proj_out_1's input and
    1 + scale), norm_out's input, statistics and output, and proj_out_2's input."""
    if spec.family == "lightningdit":
        b, c = micro_batch, eb.compute
        modulation = (
            b * spec.hidden * c + b * 2 * spec.hidden * c + b * spec.hidden * c
        )  # SiLU out, out, 1+scale
        return norm_saved_bytes(spec, b, eb) + modulation + b * spec.tokens * spec.hidden * c
    b, s, d, c, n = micro_batch, spec.tokens, spec.hidden, eb.compute, eb.norm
    tokens = b * s
    embedder = b * (TIMESTEP_FREQ_DIM * c + 2 * d * c + INT64_BYTES + d * eb.table)
    modulation = b * d * c + b * d * c
    norm_out = tokens * d * n + 2 * tokens * n + tokens * d * n + tokens * d * c
    return embedder + modulation + norm_out


def head_and_tail_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Patch-embedding conv input and the final layer (LightningDiT: and the conditioning, made once); the
    loss's tensors are counted separately."""
    head = patch_input_bytes(spec, micro_batch, eb)
    if spec.family == "lightningdit":
        head += lightningdit_conditioning_saved_bytes(spec, micro_batch, eb)
    return head + final_layer_saved_bytes(spec, micro_batch, eb)


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
    if checkpointed_blocks and spec.family == "dit":
        kept += 2 * micro_batch * INT64_BYTES  # the timestep and label tensors the checkpoints hold
    return head_and_tail_saved_bytes(spec, micro_batch, eb) + kept


def recompute_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes, attention: str = "fused") -> int:
    """What rerunning a checkpointed block's forward in backward adds to the input it kept: its saved set,
    less that input where the first norm saves the input itself (DiT: CPU autocast, fp32; LightningDiT: but
    under FSDP2's pure low precision, whose norm saves an fp32 copy of its cast input)."""
    block = sum(block_saved_bytes(spec, micro_batch, eb, attention).values())
    saves_input = not eb.pure if spec.family == "lightningdit" else eb.norm_saves_block_input
    return block - (block_input_bytes(spec, micro_batch, eb) if saves_input else 0)


def checkpointed_forward_peak(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, casts_weights: bool = False
) -> tuple[int, int]:
    """(activations, weight copies) alive at the peak inside a checkpointed block's forward. Nothing of it is
    saved; always alive are the block's adaLN output (b x 6d) and, at its MLP, the gated attention output and
    the residual after it (compute dtype) and the modulated MLP input (the norm's dtype: fp32 under CUDA
    autocast). The peak is the larger of two points: at the GELU (the MLP's hidden layer before and after it)
    or at the MLP's output linear (the GELU output, the linear's output and, under autocast, its weight and
    bias copy, cast uncached: `casts_weights`), which wins when the micro-batch has few tokens (b s < ~4d/3).
    LightningDiT: `lightningdit_checkpointed_forward_peak`."""
    if spec.family == "lightningdit":
        return lightningdit_checkpointed_forward_peak(spec, micro_batch, eb, casts_weights)
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
    gradient (b x d) and three bias gradients (d each). LightningDiT: `lightningdit_backward_temporary_bytes`."""
    if spec.family == "lightningdit":
        return lightningdit_backward_temporary_bytes(spec, micro_batch, eb)
    b, s, d, c = micro_batch, spec.tokens, spec.hidden, eb.compute
    activation_grads = b * s * (spec.mlp_hidden + 2 * d) * c + b * d * c
    mlp_weight_grad = spec.mlp_hidden * d * c + 3 * d * c
    embedder_grads = eb.table * class_table_params(spec) + (d * d + TIMESTEP_FREQ_DIM * d) * c
    return activation_grads + mlp_weight_grad + embedder_grads


# --- LightningDiT (models.lightningdit) ----------------------------------------------------------------------


def norm_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """One RMSNorm of the residual stream: its fp32 input (the stream itself; under pure low precision an fp32
    copy of the cast input), 1/rms per token, the normalised tensor and its weighted output (fp32 with an fp32
    weight: the residual's dtype and the weight's promote; the compute dtype when pure). Without RMSNorm, a
    non-affine LayerNorm: its input, mean and rstd, and its output."""
    tokens, d = micro_batch * spec.tokens, spec.hidden
    inner = eb.compute if eb.pure else FP32_BYTES
    if not spec.rmsnorm:
        return tokens * d * FP32_BYTES + 2 * tokens * FP32_BYTES + tokens * d * inner
    return tokens * d * FP32_BYTES + tokens * FP32_BYTES + 2 * tokens * d * inner


def lightningdit_block_saved_bytes(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, attention: str
) -> dict[str, int]:
    """Saved tensors of one LightningDiT block, by op (models.lightningdit.LightningDiTBlock)."""
    b, s, d, h, m = micro_batch, spec.tokens, spec.hidden, spec.heads, spec.mlp_hidden
    c, tokens = eb.compute, micro_batch * spec.tokens
    parts = {
        "adaLN SiLU output (its linear's input)": b * d * c,
        "norm1 input, 1/rms, normalised, weighted": norm_saved_bytes(spec, b, eb),
        "1+scale (x2)": 2 * b * d * c,
        "qkv input": tokens * d * c,
        "qkv output (v; q, k as well without RoPE)": 3 * tokens * d * c,
        "q, k rotated (attention)": 2 * tokens * d * c if spec.rope else 0,
        "attention output + logsumexp": tokens * d * c + b * h * s * FP32_BYTES,
        "out-projection input": tokens * d * c,
        "adaLN output (the gates)": b * spec.modulations * d * c,
        "norm2 input, 1/rms, normalised, weighted": norm_saved_bytes(spec, b, eb),
        "mlp input": tokens * d * c,
        "mlp output (gate mul)": tokens * d * c,
    }
    if spec.swiglu:
        parts["SwiGLU projection output (gate and value)"] = 2 * tokens * m * c
        parts["silu(gate), and the product (w3 input)"] = 2 * tokens * m * c
    else:
        parts["mlp hidden (gelu input), gelu output"] = 2 * tokens * m * c
    if spec.qk_norm:  # each of q and k: an fp32 copy, 1/rms per head and token, normalised and weighted
        inner = eb.compute if eb.pure else FP32_BYTES
        parts["q, k norms"] = 2 * (
            tokens * d * FP32_BYTES + b * h * s * FP32_BYTES + tokens * d * (c + inner)
        )
    if attention == "math":
        parts["attention probabilities (non-fused)"] = b * h * s * s * c
    return parts


def lightningdit_conditioning_saved_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """The conditioning, made once: the sinusoids (cast for the timestep MLP's first linear), its hidden layer
    before and after SiLU, the labels, and the sum t + y that every block's SiLU saves (the table's dtype: fp32
    under autocast, whose class embedding is never cast)."""
    b, d, c = micro_batch, spec.hidden, eb.compute
    return b * (TIMESTEP_FREQ_DIM * c + 2 * d * c + INT64_BYTES + d * eb.table)


def lightningdit_checkpointed_forward_peak(
    spec: DiTSpec, micro_batch: int, eb: ElementBytes, casts_weights: bool = False
) -> tuple[int, int]:
    """Inside a checkpointed block's forward, at its MLP: the fp32 residual after attention and the MLP's
    modulated input (fp32 under autocast, the compute dtype when pure), the adaLN output, and SwiGLU's
    projection output with silu(gate) and the product (a GELU MLP: its hidden layer before and after)."""
    b, s, d, c = micro_batch, spec.tokens, spec.hidden, eb.compute
    tokens, m = b * s, spec.mlp_hidden
    residual = eb.compute if eb.pure else FP32_BYTES  # and the modulated MLP input, likewise
    common = 2 * tokens * d * residual + b * spec.modulations * d * c
    working = 4 * tokens * m * c if spec.swiglu else 2 * tokens * m * c
    return common + working, 0


def lightningdit_backward_temporary_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Alive inside a block's backward at its peak (the MLP's, once w3's weight gradient is made): the
    gradients of SwiGLU's projection output and of its two halves' product, the residual's gradient (fp32 but
    under pure low precision), and a per-image modulation gradient and bias gradients."""
    b, s, d, c = micro_batch, spec.tokens, spec.hidden, eb.compute
    tokens, m = b * s, spec.mlp_hidden
    hidden = 3 * tokens * m * c if spec.swiglu else 2 * tokens * m * c
    residual = eb.compute if eb.pure else FP32_BYTES
    return hidden + tokens * d * residual + 3 * d * c + 2 * b * d * FP32_BYTES


def lightningdit_backward_freed_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Saved tensors a LightningDiT block's backward has freed at its peak: the MLP output (the gate's input)
    and w3's input (the SwiGLU product, or the GELU output), gone with w3's weight gradient."""
    tokens = micro_batch * spec.tokens
    return tokens * spec.hidden * eb.compute + tokens * spec.mlp_hidden * eb.compute


def lightningdit_backward_peak_gradient_params(spec: DiTSpec) -> int:
    """Parameters of the block in backward whose gradient exists at its peak: w3's (the MLP's output)."""
    return spec.mlp_hidden * spec.hidden


def lightningdit_final_layer_backward_bytes(spec: DiTSpec, micro_batch: int, eb: ElementBytes) -> int:
    """Alive in the final layer's backward at its peak: three residual-sized gradients (the modulated norm's
    output, the normalised tensor, the residual's), fp32 but under pure low precision."""
    residual = eb.compute if eb.pure else FP32_BYTES
    return 3 * micro_batch * spec.tokens * spec.hidden * residual
