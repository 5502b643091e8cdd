"""What two runs of different process layouts can be held to, on any x86 CPU.

Attention key biases: q . (k + b) adds q . b to every logit of a query, which softmax ignores, so their true
gradient is exactly zero and what autograd computes is rounding noise. AdamW divides that noise by its own
root mean square and moves the bias by about lr per step, in a direction set by the CPU's kernels (AVX2 and
AVX-512 round differently). Two runs that differ in process layout, micro-batch or thread count agree on
them only by chance, so layout equivalences leave them out, and check instead that their AdamW moments
really are noise (many orders below any real gradient's).
"""

from __future__ import annotations

ZERO_GRADIENT_PARAMETERS = ("attn1.to_k.bias",)


def has_true_gradient(name: str) -> bool:
    return not name.endswith(ZERO_GRADIENT_PARAMETERS)
