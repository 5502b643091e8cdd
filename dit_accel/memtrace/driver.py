"""Driving the trainer's own step under the tracker: the step for one plan on fake tensors (the trainer's
`build_components`, `train_micro_step`, `check_step`, `apply_step`), its windows labelled per block, traced
at shallow depths and extrapolated to the plan's (`extrapolate`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from dit_accel.errors import UserError
from dit_accel.memtrace import fake_cuda
from dit_accel.memtrace.extrapolate import (
    Counts,
    _block_of_role,
    _describe,
    _segments,
    extrapolate,
    planner_moment,
    role_peaks,
    trace_plan_counts,
)
from dit_accel.memtrace.tracker import StorageTracker, TraceResult, _in_backward
from planner.planfile import Plan


@dataclass
class StepParts:
    """The trainer's components for one configuration and its step as two calls (fake tensors for
    `verify`, real ones for `calibrate`).

    `micro_step()` is the trainer's forward + backward of one micro-batch (with its accumulation context);
    `optimizer_step()` is the trainer's finite step: `check_step` (clip, vote) then `apply_step` (AdamW, lr
    schedule, EMA, zero_grad). `checkpointed` says, in forward order, which blocks recompute their
    activations in backward.
    """

    model: torch.nn.Module
    blocks: list
    checkpointed: list
    micro_step: Callable[[], None]
    optimizer_step: Callable[[], None]
    grad_accum: int
    ema_tensors: list = field(default_factory=list)
    # the trainer's AdamW, its state made before the first step as a fresh run makes it (optim.create_states)
    optimizer: torch.optim.Optimizer | None = None
    vae: torch.nn.Module | None = None
    batch_tensors: list = field(default_factory=list)
    # REPA: the frozen encoder and the network's projector, whose storages are the planner's "repa"
    repa_encoder: torch.nn.Module | None = None
    repa_projector: torch.nn.Module | None = None
    # called when a parameter's gradient is complete; default: count `param.grad` as grads (a sharded trace
    # frees it and keeps a 1/N fp32 shard instead, as FSDP2's reduce-scatter does)
    on_grad: Callable[[torch.nn.Parameter, StorageTracker], None] | None = None


def run_traced(
    parts: StepParts, tracker: StorageTracker, optimizer_steps: int = 2, max_micro_steps: int = 2
) -> None:
    """Run `optimizer_steps` steps of the trainer under `tracker`, labelling the windows.

    Only the last step runs its whole accumulation cycle, and that up to `max_micro_steps` micro-steps:
    from the second micro-step on, each one starts with the same live storages (the accumulated grads) and
    does the same work. Earlier steps run one micro-step: they bring the allocator's cache to the state
    later steps find (the first encode's and the first step's freed blocks), and every moment of theirs is
    matched by the same moment of the last step. AdamW's state exists before them, as in the trainer.
    """
    projector = (
        {id(p) for p in parts.repa_projector.parameters()} if parts.repa_projector is not None else set()
    )
    for param in parts.model.parameters():
        tracker.tag(param, "repa" if id(param) in projector else "weights")
    if parts.repa_encoder is not None:
        for tensor in list(parts.repa_encoder.parameters()) + list(parts.repa_encoder.buffers()):
            tracker.tag(tensor, "repa")
    for buffer in parts.model.buffers():
        tracker.tag(buffer, "buffers")
    for tensor in parts.ema_tensors:
        tracker.tag(tensor, "ema")
    if parts.vae is not None:
        for tensor in list(parts.vae.parameters()) + list(parts.vae.buffers()):
            tracker.tag(tensor, "vae")

    def tag_states(optimizer, *_):
        for param, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.tag(value, "repa" if id(param) in projector else "optimizer")

    if parts.optimizer is not None:
        tag_states(parts.optimizer)
    for tensor in parts.batch_tensors:
        tracker.tag(tensor, "batch")

    where = {"step": 0, "micro": 0}
    handles = []
    last_block = len(parts.blocks) - 1

    def block_pre(index):
        def hook(module, args):
            if not _in_backward():  # a checkpointed block's recompute runs forward again inside backward
                tracker.set_window(("fwd", where["step"], where["micro"], index))

        return hook

    def block_post(index):
        def hook(module, args, output):
            if _in_backward():
                return
            step, micro = where["step"], where["micro"]
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                # fires when the gradient of this block's output is ready: its backward starts
                hidden.register_hook(lambda grad: tracker.set_window(("bwd", step, micro, index)))
            if index == last_block:
                tracker.set_window(("head", step, micro))

        return hook

    for index, block in enumerate(parts.blocks):
        handles.append(block.register_forward_pre_hook(block_pre(index)))
        handles.append(block.register_forward_hook(block_post(index)))
    if parts.on_grad is None:

        def on_grad(p):
            tracker.tag(p.grad, "repa" if id(p) in projector else "grads")
    else:

        def on_grad(p):
            parts.on_grad(p, tracker)

    for param in parts.model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(on_grad))
    if parts.vae is not None:

        def vae_enter(module, args):
            tracker.in_vae += 1

        def vae_leave(module, args, output):
            tracker.in_vae -= 1

        for module in parts.vae.children():
            handles.append(module.register_forward_pre_hook(vae_enter))
            handles.append(module.register_forward_hook(vae_leave))
    if parts.repa_encoder is not None:  # what the encoder's forward makes is REPA's working set,

        def repa_enter(module, args):
            tracker.in_repa += 1

        def repa_leave(module, args, output):
            tracker.in_repa -= 1

        # ... and so is what the projector saves for backward, made inside block K's forward
        for module in (parts.repa_encoder, parts.repa_projector):
            handles.append(module.register_forward_pre_hook(repa_enter))
            handles.append(module.register_forward_hook(repa_leave))

    handles.append(register_optimizer_step_post_hook(tag_states))  # a state made lazily, if any
    try:
        with tracker:
            for step in range(optimizer_steps):
                final_step = step == optimizer_steps - 1
                for micro in range(min(parts.grad_accum, max_micro_steps) if final_step else 1):
                    where.update(step=step, micro=micro)
                    tracker.set_window(("pre", step, micro))
                    parts.micro_step()
                tracker.set_window(("opt", step))
                tracker.phase = "optimizer"  # clipping, AdamW, zero_grad, the EMA update: all temporaries
                parts.optimizer_step()
                tracker.phase = "forward"
            tracker.set_window(("end",))
    finally:
        for handle in handles:
            handle.remove()


# The Stable Diffusion VAE (sd-vae-ft-ema / -mse) that DiT encodes with: its architecture, no weights.
SD_VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "act_fn": "silu",
    "sample_size": 256,
    "scaling_factor": 0.18215,
}


def fake_batch(
    spec, micro_batch: int, device: torch.device, online: bool, flow: bool = False, images: bool = False
) -> dict:
    """One micro-batch as the trainer's `Collate` makes it (on fake tensors: shapes and dtypes only): a flow
    objective's t is a float per sample; REPA from a latent cache adds each latent's source image."""
    side = spec.resolution if online else spec.latent_size
    channels = 3 if online else spec.in_channels
    batch = {
        "x": torch.randn(micro_batch, channels, side, side, device=device),
        "y": torch.randint(0, spec.num_classes, (micro_batch,), device=device),
        "sample_number": torch.arange(micro_batch, device=device),
        "t": torch.randint(0, 1000, (micro_batch,), device=device),
        "noise": torch.randn(
            micro_batch, spec.in_channels, spec.latent_size, spec.latent_size, device=device
        ),
        "drop": torch.zeros(micro_batch, dtype=torch.bool, device=device),
    }
    if flow:
        batch["t"] = torch.rand(micro_batch, device=device)
    if online:
        batch["posterior_noise"] = torch.randn_like(batch["noise"])
    if images:
        batch["image"] = torch.randn(micro_batch, 3, spec.resolution, spec.resolution, device=device)
    return batch


def build_vae(vae_config: dict | None, device: torch.device):
    """A frozen AutoencoderKL of the given architecture (default: the SD VAE), and its `LatentNorm`."""
    from diffusers import AutoencoderKL

    from dit_accel.models.vae import LatentNorm

    with device:
        vae = AutoencoderKL.from_config(vae_config or SD_VAE_CONFIG)
    vae.eval().requires_grad_(False)
    return vae, LatentNorm.of_vae_config(vae.config)


def build_step_parts(
    plan: Plan,
    spec,
    checkpointed_blocks: int,
    micro_batch: int,
    device: str,
    vae_config: dict | None = None,
    sharded_world_size: int = 0,
) -> StepParts:
    """The trainer's components (`dit_accel.train.step.build_components`, bare device, no Accelerator, the plan's
    own precision) and its step for `spec` (which may be shallower than the plan's network): the micro-step
    is `train_micro_step`; the optimizer step is `check_step` then `apply_step`, the path of a finite step,
    with no value read (`optimizer_step` only adds the decision between them and the numbers it logs).

    Inside a FakeTensorMode nothing it builds owns memory; outside one (`dit-accel calibrate`) it is real.

    `sharded_world_size` > 0: one rank's compute of a sharded plan instead (`make_sharded`).
    """
    from dit_accel.train import step
    from dit_accel.train.config import TrainConfig
    from dit_accel.train.optim import create_states

    online = plan.decision.latents == "online"
    # the VAE of online latents comes from `vae_config` below, not from a weights folder
    variant = plan.with_decision(
        checkpointed_blocks=checkpointed_blocks, micro_batch=micro_batch, latents="precomputed"
    )
    config = TrainConfig(plan="(traced)", output_dir="(traced)", latents="(traced)")
    device = torch.device(device)
    encoder = None
    if plan.decision.repa:  # an encoder of the plan's published shape, aligned at a block the trace has
        from dit_accel.repa.encoder import encoder_of_shape
        from dit_accel.repa.training import token_grid

        config.repa_encoder, config.repa_projector_dim = "(traced)", plan.decision.repa_projector_dim
        config.repa_depth = min(config.repa_depth, spec.depth)
        encoder = encoder_of_shape(plan.decision.repa, token_grid(spec), device)
    # The plan's precision even where a bare-device run would fall back (fp16 on a CPU): the trace is a
    # proxy for the GPU run. Without an Accelerator there is no GradScaler (a few scalars).
    components = step.build_components(
        variant,
        config,
        device=device,
        spec=spec,
        precision="fp32" if sharded_world_size else plan.decision.precision,
        repa_encoder=encoder,
    )
    components.plan = plan
    if online:
        if vae_config is None and spec.tokenizer == "va-vae":  # LightningDiT's tokenizer, not the SD VAE
            from dit_accel.models.vavae import vavae_config

            vae_config = vavae_config(resolution=spec.resolution)
        components.vae, components.latent_norm = build_vae(vae_config, device)
    flow, images = plan.objective == "flow", bool(plan.decision.repa) and not online
    batch = fake_batch(spec, micro_batch, device, online, flow, images)
    losses = []

    no_device = device.type == "cuda" and fake_cuda.without_a_device()
    if no_device:  # fake CUDA with no GPU: CUDA autocast and attention kernels pinned, no autograd backward
        fake_cuda.patch_components(components)

    def micro_step():
        losses.append(step.train_micro_step(components, batch))
        if no_device:
            fake_cuda.gradients_as_after_backward(components.raw_model)

    def optimizer_step():
        loss_sum = torch.stack(losses).sum()
        check = step.check_step(components, loss_sum)
        step.apply_step(components)  # with `check` and `loss_sum` alive, as in the trainer's optimizer_step
        del check, loss_sum
        losses.clear()

    # as the trainer's fresh run does (dit_accel.train.resume.restore), unless the plan models a codebase whose AdamW
    # makes it in the first step (--assume adamw_state=lazy); a sharded trace adds the state's shards itself
    if not sharded_world_size and plan.assumptions.get("adamw_state", "eager") == "eager":
        create_states(components.optimizer)
    model = components.raw_model
    parts = StepParts(
        model=model,
        blocks=list(model.transformer_blocks),
        checkpointed=["forward" in block.__dict__ for block in model.transformer_blocks],
        micro_step=micro_step,
        optimizer_step=optimizer_step,
        grad_accum=components.grad_accum,
        ema_tensors=list(components.ema.shadow.values()) if components.ema is not None else [],
        optimizer=components.optimizer,
        vae=components.vae,
        batch_tensors=list(batch.values()),
        repa_encoder=components.repa.encoder if components.repa is not None else None,
        repa_projector=getattr(model, "repa_projector", None),
    )
    if sharded_world_size:
        make_sharded(parts, plan.decision.precision, sharded_world_size, losses)
    return parts


def make_sharded(parts: StepParts, precision: str, world_size: int, losses: list) -> None:
    """Turn the traced step into ONE rank's compute of a sharded plan, as FSDP2 runs it, as far as one process
    can show it.

    FSDP2's MixedPrecisionPolicy gathers every unit's parameters in the compute dtype and casts the root's
    floating inputs to it, and Accelerate's FSDP2 path adds no autocast: here the parameters themselves are
    converted (the buffers stay fp32, as FSDP2 leaves them), a pre-hook on the root casts its inputs, and the
    step runs without autocast (so there is no autocast cache). The converted parameters stand for the gathered
    copies of every unit (zero2's layout). Each gradient, once complete, is freed and replaced by a 1/world_size
    fp32 shard, as the reduce-scatter leaves it (accumulated into over micro-steps). The fp32 master weights,
    AdamW state and EMA are not traced (`compare_sharded` adds them from the traced sizes), nor is the
    optimizer step, which only drops the gradient shards here.
    """
    from dit_accel.train.step import compute_dtype as dtype_of

    compute_dtype = dtype_of(precision) or torch.float32
    for param in parts.model.parameters():
        param.data = param.data.to(compute_dtype)

    def cast_inputs(module, args, kwargs):
        def cast(value):
            return (
                value.to(compute_dtype)
                if isinstance(value, torch.Tensor) and value.is_floating_point()
                else value
            )

        return tuple(map(cast, args)), {key: cast(value) for key, value in kwargs.items()}

    parts.model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    grad_shards: dict[int, torch.Tensor] = {}

    def on_grad(param, tracker):
        if id(param) not in grad_shards:
            shard = torch.zeros(
                math.ceil(param.numel() / world_size), dtype=torch.float32, device=param.device
            )
            tracker.tag(shard, "grads")
            grad_shards[id(param)] = shard
        param.grad = None  # the unsharded gradient is gone after its reduce-scatter

    def optimizer_step():
        grad_shards.clear()
        losses.clear()

    parts.on_grad, parts.optimizer_step, parts.ema_tensors = on_grad, optimizer_step, []


def _trace_once(
    plan: Plan,
    spec,
    checkpointed_blocks: int,
    micro_batch: int,
    autocast_device: str,
    vae_config: dict | None = None,
    sharded_world_size: int = 0,
) -> tuple[StorageTracker, list]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):  # a value read in the step would raise here
        parts = build_step_parts(
            plan, spec, checkpointed_blocks, micro_batch, autocast_device, vae_config, sharded_world_size
        )
        tracker = StorageTracker()
        run_traced(parts, tracker)
    return tracker, parts.checkpointed


def trace_events(plan: Plan, autocast_device: str = "cpu") -> StorageTracker:
    """The plan's step traced once at its full depth, kept for a replay event by event: the tracker's
    `events` (every allocation and free, in order) and `event_windows` (the window of each), which
    `memtrace.allocator.replay_steps` walks (benchmarks/online_reserved_timeline.py)."""
    d = plan.decision
    return _trace_once(plan, plan.spec(), d.checkpointed_blocks, d.micro_batch, autocast_device)[0]


def _runs_kinds(checkpointed: list) -> list[bool]:
    return [kind for _, _, kind in _segments(checkpointed)]


def trace_training_step(
    plan: Plan,
    *,
    depth_extrapolate: str = "auto",
    autocast_device: str | None = None,
    micro_batch: int | None = None,
    vae_config: dict | None = None,
    replay_at_depth: bool = False,
) -> TraceResult:
    """Trace the plan's training step on fake tensors and return its peak and the components live then.

    `depth_extrapolate="auto"` traces at most 5 blocks (up to three shallow traces) and extrapolates per
    block, unless the full network is as cheap to trace; `"on"` always extrapolates (tests); `"off"`
    traces the full depth. `autocast_device` is "cpu" (default without CUDA) or "cuda"
    (needs a CUDA build of torch; fake CUDA tensors allocate nothing on the GPU either; without a GPU the
    backward cannot run on them: `fake_cuda` says what is traced then). `vae_config`
    (online latents): the AutoencoderKL's config; default the SD VAE's (`SD_VAE_CONFIG`).

    The step's allocations and frees are replayed through the caching-allocator model (`allocator_peaks`)
    when the plan's depth is traced; an extrapolated trace gets them only with `replay_at_depth`, which
    traces the plan's depth once more for it (`verify` does; the grid tests do not need it).

    A sharded plan (zero2/zero3) is traced as one rank's compute under FSDP2 (`make_sharded`: parameters in the
    compute dtype, no autocast, 1/world_size fp32 gradient shards); `compare_sharded` completes it.
    """
    if depth_extrapolate not in ("auto", "on", "off"):
        raise UserError(f"--depth-extrapolate must be auto or off, got {depth_extrapolate!r}")
    autocast_device = autocast_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if autocast_device not in ("cpu", "cuda"):
        raise UserError(f"--device-autocast must be cpu or cuda, got {autocast_device!r}")
    if autocast_device == "cuda" and not torch.backends.cuda.is_built():
        raise UserError(
            "--device-autocast cuda needs a CUDA build of torch (fake CUDA tensors): use --device-autocast cpu here"
        )
    backward_on_cpu = autocast_device == "cuda" and fake_cuda.without_a_device()
    if backward_on_cpu:  # a forward-only trace has no backward windows to extrapolate per block
        depth_extrapolate = "off"
    decision = plan.decision
    spec = plan.spec()
    micro_batch = int(micro_batch or decision.micro_batch)
    checkpointed = decision.checkpointed_blocks
    if not 0 <= checkpointed <= spec.depth:
        raise UserError(
            f"plan decision.checkpointed_blocks {checkpointed} is outside 0..{spec.depth}",
            "re-create the plan",
        )
    sharding = decision.sharding
    world_size = plan.world_size if plan.sharding.uses_fsdp else 1
    target = (spec.depth - checkpointed, checkpointed)
    base, all_counts = trace_plan_counts(target)
    started = time.perf_counter()

    def trace(counts: Counts) -> tuple[StorageTracker, list]:
        shallow = dataclasses.replace(spec, depth=sum(counts))
        return _trace_once(
            plan,
            shallow,
            counts[1],
            micro_batch,
            autocast_device,
            vae_config,
            world_size if sharding != "ddp" else 0,
        )

    # Each trace also runs the embedding, final layer and loss (about two blocks' worth of ops): when the
    # shallow traces together would run as many ops as the full network, trace the full network.
    shallow_cost = sum(sum(counts) + 2 for counts in all_counts)
    if (
        depth_extrapolate == "off"
        or sum(base) == spec.depth
        or (depth_extrapolate == "auto" and shallow_cost >= spec.depth + 2)
    ):
        tracker, _ = trace(target)
        peak_bytes, components, window = tracker.peak_bytes, tracker.peak_components, tracker.peak_window
        traced_depths = [spec.depth]
        allocator, allocator_depths = tracker.allocator_peaks(), "traced"
    else:
        samples, patterns = {}, set()
        for counts in all_counts:
            tracker, kinds = trace(counts)
            samples[counts] = role_peaks(tracker, kinds)
            patterns.add(tuple(_runs_kinds(kinds)))
        if len(patterns) != 1:
            raise AssertionError(
                f"the checkpointed blocks change order with depth ({patterns}): cannot extrapolate"
            )
        roles = extrapolate(samples, target, base)
        # the latest of equal peaks: the second optimizer step, whose state is already tagged as such
        role = max(reversed(list(roles)), key=lambda role: roles[role][0])
        peak_bytes, components = roles[role]
        pattern = patterns.pop()  # the kinds of the runs in forward order, e.g. (True, False)
        target_checkpointed = [kind for kind in pattern for _ in range(target[1] if kind else target[0])]
        window = _block_of_role(role, target_checkpointed)
        traced_depths = [sum(counts) for counts in all_counts]
        # the allocator's reserved bytes are not linear in the block counts (segment reuse differs from one
        # depth to the next): they are replayed from a trace at the plan's depth, or not at all
        allocator, allocator_depths = {}, "not replayed"
        if replay_at_depth:
            allocator, allocator_depths = trace(target)[0].allocator_peaks(), "traced"
    result = TraceResult(
        peak_bytes=peak_bytes,
        components=dict(components),
        peak_at=_describe(window),
        depth=spec.depth,
        checkpointed_blocks=checkpointed,
        micro_batch=micro_batch,
        precision=decision.precision,
        autocast_device=autocast_device,
        traced_depths=traced_depths,
        seconds=round(time.perf_counter() - started, 2),
        sharding=sharding,
        world_size=world_size,
        peak_moment=planner_moment(window, components, spec.depth) if sharding != "ddp" else "",
        allocator=allocator,
        allocator_depths=allocator_depths,
    )
    if backward_on_cpu:  # the backward's own peak, from the same shapes under CPU autocast
        cpu = trace_training_step(plan, autocast_device="cpu", micro_batch=micro_batch, vae_config=vae_config)
        result = fake_cuda.with_backward_from(result, cpu)
    return result
