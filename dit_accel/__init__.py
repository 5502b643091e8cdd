"""dit-accel: train DiT with Hugging Face Accelerate exactly as `dit-plan` planned it."""

import logging

__version__ = "0.1.0"

# torchao (installed for `train --fp8`) is imported by diffusers whenever a model loads, and then three
# libraries each print a notice that means nothing here: torchao that its CUDA-only extensions do not load on
# a CPU, torch's pytree that torchao registers enums it no longer needs to, and diffusers that it cannot
# unpickle torchao-serialised checkpoints (this package reads safetensors). They would stand between a
# command and its one line; their errors still show.
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)
