"""CUDA's autocast traced without a GPU: a CUDA build of torch on a machine with no device.

Fake CUDA tensors need no device, but three parts of a training step do:

- `torch.autocast("cuda")` checks for a driver and, finding none, disables itself (a warning, then an fp32
  forward). `cuda_autocast` switches CUDA autocast on below that check, as torch.autocast's own __enter__
  does (dtype, enabled, nesting count; the cast cache cleared when the outermost one exits).
- `F.scaled_dot_product_attention` picks its kernel from the device's properties and, without them, takes
  the math path, which saves the whole attention matrix. `PinnedAttention` calls the kernel a GPU run gets
  instead: aten's flash attention for bf16/fp16 (head size a multiple of 8, at most 256, no mask), its
  memory-efficient attention otherwise.
- The autograd engine starts a device thread and refuses (`hasPrimaryContext expects a valid device
  index`). The backward is therefore not traced: `gradients_as_after_backward` gives every parameter the
  gradient a backward leaves (zeros of its shape, accumulated into across micro-steps, each parameter's
  post-accumulate hooks called as the engine would), once the forward's graph is gone. The forward, the end
  of forward and the optimizer step are traced; the backward's own peak comes from a CPU-autocast trace of
  the same shapes (`driver.trace_training_step` adds it to the result's notes).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

HALF_DTYPES = (torch.bfloat16, torch.float16)
BACKWARD_NOT_TRACED = (
    "the backward: fake CUDA tensors without a device cannot run the autograd engine; the forward, the end "
    "of forward and the optimizer step are traced under CUDA autocast, the gradients stand in for the "
    "backward's result"
)


def without_a_device() -> bool:
    """A CUDA build of torch on a machine without a usable CUDA device."""
    return torch.backends.cuda.is_built() and not torch.cuda.is_available()


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype):
    """CUDA autocast to `dtype`, switched on below torch.autocast's driver check (for fake CUDA tensors)."""
    enabled, previous_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_enabled("cuda", True)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous_dtype)


def pinned_attention_kernel(dtype: torch.dtype, head_dim: int, has_mask: bool) -> str:
    """The SDPA kernel a CUDA run of these inputs gets: "flash" or "efficient" (the math path never: both
    fused kernels take every shape DiT has)."""
    if dtype in HALF_DTYPES and head_dim % 8 == 0 and head_dim <= 256 and not has_mask:
        return "flash"
    return "efficient"


def pinned_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`F.scaled_dot_product_attention` through the kernel a GPU picks (`pinned_attention_kernel`), with
    CUDA autocast's cast of its inputs (SDPA is on autocast's lower-precision list; the aten kernels are
    not, so the cast is done here)."""
    if enable_gqa:
        raise NotImplementedError("grouped-query attention is not pinned (DiT does not use it)")
    if query.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = (tensor.to(dtype) for tensor in (query, key, value))
    kernel = pinned_attention_kernel(query.dtype, query.shape[-1], attn_mask is not None)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    needs_grad = any(tensor.requires_grad for tensor in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
    )[0]


class PinnedAttention(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `pinned_attention`; every other function runs as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return pinned_attention(*args, **kwargs)
        return func(*args, **kwargs)


def forward_context(autocast_dtype: torch.dtype | None):
    """What replaces the trainer's forward context on fake CUDA: pinned attention, and CUDA autocast to
    `autocast_dtype` (None: no autocast, as an fp32 or sharded step runs)."""
    stack = contextlib.ExitStack()
    stack.enter_context(PinnedAttention())
    if autocast_dtype is not None:
        stack.enter_context(cuda_autocast(autocast_dtype))
    return stack


def gradients_as_after_backward(model: torch.nn.Module) -> None:
    """Every trainable parameter's gradient as a backward leaves it: allocated on the first micro-step,
    accumulated into (the same storage) after that; its post-accumulate-grad hooks run as the engine runs
    them (the tracer tags gradients there; a sharded trace replaces them by shards there)."""
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        for hook in list((param._post_accumulate_grad_hooks or {}).values()):
            hook(param)


def patch_components(components) -> None:
    """Make the trainer's components (built on fake CUDA tensors) traceable without a device: the forward
    under `forward_context`, and no autograd backward (the caller adds the gradients after each micro-step
    with `gradients_as_after_backward`)."""
    autocast_dtype = components.autocast_dtype
    components.forward_context = lambda: forward_context(autocast_dtype)
    components.backward = lambda loss: None


def with_backward_from(result, cpu_result):
    """The fake-CUDA trace's result, its notes saying what was not traced and where the backward's figure
    comes from: the CPU-autocast trace of the same step (`cpu_result`)."""
    import dataclasses

    gib = 2**30
    notes = tuple(line for line in result.unseen if not line.startswith("CPU-vs-CUDA"))
    backward = (
        f"{BACKWARD_NOT_TRACED}; the whole step under CPU autocast (same shapes) peaks at "
        f"{cpu_result.peak_bytes / gib:.2f} GiB, {cpu_result.peak_at}"
    )
    return dataclasses.replace(
        result, unseen=(*notes, backward), seconds=round(result.seconds + cpu_result.seconds, 2)
    )
