"""What two runs of different process layouts can be held to, on any x86 CPU.

Attention key biases: q . (k + b) adds q . b to every logit of a query, which softmax ignores, so their true
gradient is exactly zero and what autograd computes is rounding noise. AdamW divides that noise by its own
root mean square and moves the bias by about lr per step, in a direction set by the CPU's kernels (AVX2 and
AVX-512 round differently). Two runs that differ in process layout, micro-batch or thread count agree on
them only by chance, so layout equivalences leave them out, and check instead that their AdamW moments
really are noise (many orders below any real gradient's).

The other weights agree closely but not to a fixed absolute figure: two layouts sum a gradient in another
order, and AdamW's normalised step m / sqrt(v) turns that rounding into a weight difference whose size is
set by the worst-conditioned element, not by the weights' scale. adaLN-Zero makes the last block's MLP that
element: its gates start at zero, so its first gradient comes at step 2, small and cancellation-dominated.
So a layout test bounds the difference by the farthest the run could move a weight, lr x steps (AdamW's step
is about lr per element): LAYOUT_FRACTION of it. Measured worst (zero3 micro 2 x accumulation 2 against DDP
micro 4, 4 steps, Intel Xeon with AVX-512): 9.4e-5 of lr x steps, in transformer_blocks.1.ff.net.0.proj;
a missing reduction or a wrong shard moves weights by a sizeable fraction of lr x steps.
"""

from __future__ import annotations

ZERO_GRADIENT_PARAMETERS = ("attn1.to_k.bias",)
LAYOUT_FRACTION = 1e-3  # 10x the measured worst


def layout_atol(lr: float, steps: int) -> float:
    """How far apart two process layouts' weights may be after `steps` AdamW steps at `lr`."""
    return LAYOUT_FRACTION * lr * steps


def has_true_gradient(name: str) -> bool:
    return not name.endswith(ZERO_GRADIENT_PARAMETERS)
