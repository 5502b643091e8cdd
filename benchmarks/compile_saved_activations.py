"""What `torch.compile` (inductor) changes in the activations one DiT block saves for backward (issue 12).

One transformer block of the trainer's network (dit_accel.models.dit, the tied embedder) runs forward once eager and
once compiled as the trainer compiles it (dit_accel.models.compile), on the CPU, under
`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps for the block's backward is seen by
the pack hook, and its storage is counted once. Parameters are left out (they live anyway), so the figure is
what the planner calls a block's saved activations. Regimes: fp32, bf16 autocast (CPU autocast's op lists,
what DDP plans run) and pure bf16 (bf16 weights, no autocast: what FSDP2's MixedPrecisionPolicy runs in
sharded plans).

    python benchmarks/compile_saved_activations.py --shape tiny
    python benchmarks/compile_saved_activations.py --shape xl --micro-batch 2

prints one row per regime: eager bytes, compiled bytes, their ratio, and the planner's per-block figure
(planner.activations.block_saved_bytes) for the same regime. Figures: docs/planner-accuracy.md, "Compiled blocks".
What this cannot show: inductor's CUDA partitioner (min-cut rematerialisation) decides against CUDA's
kernels and CUDA autocast's op lists; only a GPU run settles those.
"""

from __future__ import annotations

import argparse
import platform

import torch

from planner.spec import DiTSpec

SHAPES = {
    "tiny": dict(name="DiT-S/2", depth=1, hidden=32, heads=2, patch=2, resolution=64, num_classes=4),
    "xl": dict(name="DiT-XL/2", depth=1, hidden=1152, heads=16, patch=2, resolution=256, num_classes=1000),
}


def block_inputs(model, micro_batch: int, dtype: torch.dtype | None):
    """The first block's inputs (hidden states, timestep, labels) as the trainer's forward makes them."""
    captured = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs

    handle = model.transformer_blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    spec = model.dit_spec
    channels = model.config.in_channels
    x = torch.randn(micro_batch, channels, spec.latent_size, spec.latent_size, dtype=dtype or torch.float32)
    t = torch.randint(0, 1000, (micro_batch,))
    y = torch.randint(0, spec.num_classes, (micro_batch,))
    with torch.no_grad():
        model(x, timestep=t, class_labels=y, return_dict=False)
    handle.remove()
    hidden = captured["args"][0].detach().clone().requires_grad_(True)
    return hidden, captured["kwargs"]


def saved_bytes(block, hidden, kwargs, autocast: bool) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) of the distinct storages autograd saves in one forward of
    `block`. Parameters themselves are left out (they live anyway); a saved tensor equal to a parameter
    (or its transpose) cast to a lower precision is a cast copy of it (autocast's, or the compiled graph's
    own cast), which the planner files under `autocast_cache`, not activations."""
    params = list(block.parameters())
    parameters = {p.untyped_storage().data_ptr() for p in params}
    activations: dict[int, int] = {}
    copies: dict[int, int] = {}

    def is_cast_copy(tensor) -> bool:
        if tensor.dim() != 2 or tensor.dtype == torch.float32:
            return False
        for p in params:
            for view in (p, p.t()) if p.dim() == 2 else ():
                if view.shape == tensor.shape and torch.equal(view.detach().to(tensor.dtype), tensor):
                    return True
        return False

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kind = copies if is_cast_copy(tensor.detach()) else activations
            kind[storage.data_ptr()] = storage.nbytes()
        return tensor

    context = (
        torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), context:
        out = block(hidden, **kwargs)
    del out
    return sum(activations.values()), sum(copies.values())


def measure(shape: str, micro_batch: int, regime: str) -> dict:
    from dit_accel.models.compile import compile_blocks
    from dit_accel.models.dit import build_model
    from planner.activations import block_saved_bytes, element_bytes

    spec = DiTSpec(**SHAPES[shape])
    torch.manual_seed(0)
    model = build_model(spec, init="torch")  # no zero weights: a cast copy is told apart by value
    pure = regime == "pure-bf16"
    if pure:
        model.to(torch.bfloat16)
    hidden, kwargs = block_inputs(model, micro_batch, torch.bfloat16 if pure else None)
    autocast = regime == "bf16-autocast"
    if autocast:  # under autocast the block input is bf16 (the patch convolution already casts)
        hidden = hidden.detach().to(torch.bfloat16).requires_grad_(True)
    block = model.transformer_blocks[0]
    eager = saved_bytes(block, hidden, kwargs, autocast)
    compile_blocks(model)
    for _ in range(2):  # the first call compiles; the second is the steady state
        compiled = saved_bytes(block, hidden, kwargs, autocast)
    precision = "fp32" if regime == "fp32" else "bf16"
    eb = element_bytes(precision, "cpu", pure=pure)
    planner = sum(block_saved_bytes(spec, micro_batch, eb, "fused").values())
    return dict(regime=regime, eager=eager, compiled=compiled, planner=planner)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--regimes", default="fp32,bf16-autocast,pure-bf16")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"{args.shape} block, micro-batch {args.micro_batch}, torch {torch.__version__}, {platform.processor()}"
    )
    print(
        "regime | eager activations B | compiled | compiled/eager | planner B | eager weight copies B | compiled"
    )
    for regime in args.regimes.split(","):
        row = measure(args.shape, args.micro_batch, regime)
        (eager, eager_copies), (compiled, compiled_copies) = row["eager"], row["compiled"]
        print(
            f"{regime} | {eager:,} | {compiled:,} | {compiled / eager:.3f} | {row['planner']:,} | "
            f"{eager_copies:,} | {compiled_copies:,}"
        )


if __name__ == "__main__":
    main()
