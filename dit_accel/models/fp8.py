"""FP8 matmuls (`dit-accel train --fp8`): the transformer blocks' linear layers in float8 through torchao's
float8 training (`convert_to_float8_training`), bf16 autocast elsewhere.

torchao is PyTorch's own maintained library for it (torchtitan trains with it); its recipe here is its
default, dynamic tensorwise scaling: every matmul's inputs get a scale from their own amax at each call, so
no scale travels between steps and a resume is exact. The weights, gradients, AdamW state and EMA stay as
they were (fp32, or FSDP2's bf16 parameters): a `Float8Linear` holds the same `weight` and `bias` as the
`nn.Linear` it replaces, so checkpoints, sampling and export never see an FP8 tensor. On a CPU (no FP8
matmul) torchao emulates the casts and the scaled matmul: the tests' path, not a speed.
"""

from __future__ import annotations

import logging

from torch import nn

from dit_accel.errors import UserError

RECIPE = "tensorwise dynamic scaling (torchao's default)"
ALIGNMENT = 16  # FP8 matmuls want both dimensions a multiple of 16


def import_float8():
    """torchao's float8 training API; one line when torchao is not installed."""
    previous = logging.getLogger("torchao").level
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA-only extensions fail to load on a CPU
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError(
            "--fp8 needs torchao (PyTorch's float8 training library)", "pip install 'dit-accel[fp8]'"
        ) from None
    finally:
        logging.getLogger("torchao").setLevel(previous)
    return torchao.__version__, Float8LinearConfig, convert_to_float8_training


def in_a_block(model: nn.Module):
    """The filter: an `nn.Linear` of a transformer block, both dimensions aligned, and not DiT's shared
    conditioning embedder (every block refers to it; it runs once per step, a small matmul)."""
    blocks = {id(module) for block in model.transformer_blocks for module in block.modules()}
    shared = set()
    for block in model.transformer_blocks:
        embedder = getattr(getattr(block, "norm1", None), "emb", None)
        if embedder is not None:
            shared |= {id(module) for module in embedder.modules()}

    def keep(module: nn.Module, _name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # descend into it
        aligned = module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0
        return id(module) in blocks and id(module) not in shared and aligned

    return keep


def use_float8(model: nn.Module, device_type: str, precision: str) -> dict:
    """Swap the blocks' linear layers for torchao's `Float8Linear`, in place; the run's record of it."""
    if precision != "bf16":
        raise UserError(
            f"--fp8 runs the blocks' matmuls in FP8 beside bf16, but the plan's precision is {precision}",
            "re-plan with `dit-plan --precision bf16`, or drop --fp8",
        )
    version, Float8LinearConfig, convert_to_float8_training = import_float8()
    before = sum(isinstance(module, nn.Linear) for module in model.modules())
    convert_to_float8_training(
        model, module_filter_fn=in_a_block(model), config=Float8LinearConfig(emulate=device_type != "cuda")
    )
    converted = sum(type(module).__name__ == "Float8Linear" for module in model.modules())
    return {
        "library": f"torchao {version}",
        "recipe": RECIPE,
        "emulated": device_type != "cuda",
        "linears": converted,
        "linears_kept": before - converted,
    }
