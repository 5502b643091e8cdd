"""The traced memory of one real training step, to hold the planner to account (`dit-accel verify`).

The trainer's own step (model construction, autocast, checkpointed blocks, AdamW, EMA, accumulation) runs
under torch's FakeTensorMode, so no byte is allocated, while a dispatch-level tracker counts every live
tensor storage by component (weights, grads, optimizer, ema, activations, autocast_cache, vae, temporaries,
batch) and records the peak. Two optimizer steps run so the optimizer's state exists at the second one.

Full-depth DiT-XL/2 would cost tens of thousands of Python dispatches, so by default the step is traced
at shallow depths and extrapolated per block (see `extrapolate`): exact, not a fit, because every block
of one kind adds the same storages.

What a tensor trace cannot see is listed in `UNSEEN` and printed beside every result.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dit_accel.errors import UserError, exits_cleanly

# Components in the order they are printed; the planner's plan.json memory keys use the same names.
COMPONENTS = ("weights", "grads", "optimizer", "ema", "activations", "autocast_cache", "vae", "temporaries",
              "batch", "buffers")

UNSEEN = (
    "CUDA context and kernels (~0.3-1 GB per process)",
    "cuBLAS/cuDNN workspaces and memory inside kernels",
    "NCCL buffers (hundreds of MB per communicator) and DDP gradient buckets (4 bytes/param unless "
    "gradient_as_bucket_view=True): no process group is traced",
    "the caching allocator's block rounding and fragmentation (reserved > allocated)",
    "CPU-vs-CUDA autocast: the two cast different ops (CUDA keeps layer_norm in fp32); a CPU trace "
    "of bf16/fp16 is a proxy for the GPU",
)


# ---------------------------------------------------------------------------------------------------
# The tracker
# ---------------------------------------------------------------------------------------------------


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of every live tensor storage by component; keeps the peak and the peak of each window.

    A storage is counted once however many views share it, from the op that creates it until Python drops
    its last reference (a weakref callback). Its component is decided when it is created (forward ->
    activations, backward -> temporaries, a cast of a weight under autocast -> autocast_cache, ...) and
    re-tagged when it becomes a gradient or optimizer state. `window` labels the current stretch of the
    step (set by the driver and by hooks on the blocks) so that the extrapolation can reason per block.
    """

    def __init__(self):
        super().__init__()
        self.current = dict.fromkeys(COMPONENTS, 0)
        self.total_bytes = 0
        self.peak_bytes = 0
        self.peak_components = dict(self.current)
        self.peak_window: Hashable = None
        self.window: Hashable = ("setup",)
        self.window_peaks: dict[Hashable, tuple[int, dict[str, int]]] = {}
        self.phase = "forward"  # "forward" | "optimizer" (set by the driver); backward is read from autograd
        self.in_vae = 0
        self._info: dict[int, list] = {}  # id(storage) -> [nbytes, component, weakref]

    # --- bookkeeping -------------------------------------------------------------------------------
    def _storage(self, tensor: torch.Tensor):
        return tensor.untyped_storage()

    def tag(self, tensor: torch.Tensor, component: str) -> None:
        """Count `tensor`'s storage under `component` (moving it there if it is already counted)."""
        storage = self._storage(tensor)
        key = id(storage)
        info = self._info.get(key)
        if info is None:
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, lambda _ref, key=key: self._release(key))
            self._info[key] = [nbytes, component, ref]
            self.current[component] += nbytes
            self.total_bytes += nbytes
            self._note_peak()
        elif info[1] != component:
            self.current[info[1]] -= info[0]
            self.current[component] += info[0]
            info[1] = component

    def component_of(self, tensor: torch.Tensor) -> str | None:
        info = self._info.get(id(self._storage(tensor)))
        return None if info is None else info[1]

    def _release(self, key: int) -> None:
        info = self._info.pop(key, None)
        if info is not None:
            self.current[info[1]] -= info[0]
            self.total_bytes -= info[0]

    def _note_peak(self) -> None:
        total = self.total_bytes
        # ">=": of equal peaks keep the later one, so the optimizer's second step (state already tagged)
        # is reported rather than its first.
        if total >= self.peak_bytes:
            self.peak_bytes, self.peak_components, self.peak_window = total, dict(self.current), self.window
        best = self.window_peaks.get(self.window)
        if best is None or total >= best[0]:
            self.window_peaks[self.window] = (total, dict(self.current))

    def set_window(self, window: Hashable) -> None:
        self.window = window
        self._note_peak()  # a window starts with what is live when it opens

    # --- dispatch ----------------------------------------------------------------------------------
    def _component_for_new(self, func, args) -> str:
        if self.in_vae:
            return "vae"
        # Inside autograd's backward, ops run without grad mode, except a checkpointed block's recompute,
        # which recreates that block's saved activations (and, under autocast, its weight copies).
        if _in_backward() and not torch.is_grad_enabled():
            return "temporaries"
        if self.phase == "optimizer":
            return "temporaries"
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            if self.component_of(args[0]) == "weights":
                return "autocast_cache"
        return "activations"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outputs:
            component = None
            for tensor in outputs:
                if id(self._storage(tensor)) not in self._info:
                    component = component or self._component_for_new(func, args)
                    self.tag(tensor, component)
        return out


# ---------------------------------------------------------------------------------------------------
# What one trace produces
# ---------------------------------------------------------------------------------------------------


@dataclass
class TraceResult:
    """The traced step: its peak, the components live at the peak, and where the peak happened."""

    peak_bytes: int
    components: dict[str, int]  # live bytes by component at the peak
    peak_at: str  # the window of the step that holds the peak, e.g. "backward of block 27 (step 2)"
    depth: int
    checkpointed_blocks: int
    micro_batch: int
    precision: str
    autocast_device: str
    traced_depths: list[int] = field(default_factory=list)  # the depths really traced (extrapolated if shallower)
    seconds: float = 0.0
    unseen: tuple[str, ...] = UNSEEN
    # a sharded plan is traced as ONE rank's compute (`sharded_step_parts`); "ddp": the whole unsharded step
    sharding: str = "ddp"
    world_size: int = 1
    peak_moment: str = ""  # sharded: the planner's moment (planner.memory.PHASES) that the traced peak is


    def to_json(self) -> dict:
        values = {key: (list(value) if isinstance(value, tuple) else value) for key, value in self.__dict__.items()}
        if self.sharding == "ddp":  # a DDP trace's JSON as it always was
            del values["sharding"], values["world_size"], values["peak_moment"]
        return values


# ---------------------------------------------------------------------------------------------------
# Driving the trainer's step under the tracker
# ---------------------------------------------------------------------------------------------------


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
    vae: torch.nn.Module | None = None
    batch_tensors: list = field(default_factory=list)
    # called when a parameter's gradient is complete; default: count `param.grad` as grads (a sharded trace
    # frees it and keeps a 1/N fp32 shard instead, as FSDP2's reduce-scatter does)
    on_grad: Callable[[torch.nn.Parameter, "StorageTracker"], None] | None = None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def run_traced(parts: StepParts, tracker: StorageTracker, optimizer_steps: int = 2, max_micro_steps: int = 2) -> None:
    """Run `optimizer_steps` steps of the trainer under `tracker`, labelling the windows.

    Only the last step runs its whole accumulation cycle, and that up to `max_micro_steps` micro-steps:
    from the second micro-step on, each one starts with the same live storages (the accumulated grads) and
    does the same work. Earlier steps run one micro-step: they exist to create AdamW's state, and every
    moment of theirs is matched by the same moment of the last step, which also holds that state.
    """
    for param in parts.model.parameters():
        tracker.tag(param, "weights")
    for buffer in parts.model.buffers():
        tracker.tag(buffer, "buffers")
    for tensor in parts.ema_tensors:
        tracker.tag(tensor, "ema")
    if parts.vae is not None:
        for tensor in list(parts.vae.parameters()) + list(parts.vae.buffers()):
            tracker.tag(tensor, "vae")
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
            tracker.tag(p.grad, "grads")
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

    def optimizer_post(optimizer, args, kwargs):
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.tag(value, "optimizer")

    handles.append(register_optimizer_step_post_hook(optimizer_post))
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


# ---------------------------------------------------------------------------------------------------
# Extrapolation per block
# ---------------------------------------------------------------------------------------------------


def _segments(checkpointed: list) -> list[tuple[int, int, bool]]:
    """Runs of blocks of one kind, in forward order: (start, end, checkpointed)."""
    runs = []
    for index, kind in enumerate(checkpointed):
        if runs and runs[-1][2] == bool(kind):
            runs[-1] = (runs[-1][0], index + 1, bool(kind))
        else:
            runs.append((index, index + 1, bool(kind)))
    return runs


def _roles(window: Hashable, checkpointed: list) -> list[Hashable]:
    """The structural roles a window plays, independent of how many blocks each run holds.

    Within a run of same-kind blocks, every block after the first adds the same live storages, so the
    local peaks along the run are a line: its maximum is at the first, second or last block (the first
    may differ: it shares its input with whatever precedes the run). Other blocks need no role.
    """
    if window[0] not in ("fwd", "bwd"):
        return [window]
    phase, step, micro, index = window
    for run, (start, end, kind) in enumerate(_segments(checkpointed)):
        if start <= index < end:
            order = list(range(start, end)) if phase == "fwd" else list(range(end - 1, start - 1, -1))
            position = order.index(index)
            roles = []
            if position == 0:
                roles.append("first")
            if position == 1:
                roles.append("second")
            if position == len(order) - 1:
                roles.append("last")
            return [(phase, step, micro, run, kind, role) for role in roles]
    raise AssertionError(f"block {index} is outside the model")


def role_peaks(tracker: StorageTracker, checkpointed: list) -> dict[Hashable, tuple[int, dict[str, int]]]:
    peaks = {}
    for window, value in tracker.window_peaks.items():
        for role in _roles(window, checkpointed):
            peaks[role] = value
    return peaks


Counts = tuple  # (plain blocks, checkpointed blocks)


def _vector(value: tuple[int, dict[str, int]]) -> list[int]:
    return [value[0]] + [value[1][name] for name in COMPONENTS]


def extrapolate(samples: dict[Counts, dict[Hashable, tuple[int, dict[str, int]]]], target: Counts,
                base: Counts) -> dict[Hashable, tuple[int, dict[str, int]]]:
    """Role peaks at `target` block counts from traces at `base` and at base plus one block of each kind.

    Every role's live storages are a sum over blocks, so each role's bytes (total and each component) are
    exactly linear in (plain blocks, checkpointed blocks): value(target) = value(base) + sum over kinds of
    (target - base) x (value(base + 1 of that kind) - value(base)).
    """
    result = {}
    for role, value in samples[base].items():
        vector = _vector(value)
        for kind in (0, 1):
            extra = target[kind] - base[kind]
            if extra == 0:
                continue
            bumped = list(base)
            bumped[kind] += 1
            other = samples[tuple(bumped)].get(role)
            if other is None:
                raise AssertionError(f"role {role} missing from the trace with {tuple(bumped)} blocks")
            vector = [v + extra * (o - b) for v, o, b in zip(vector, _vector(other), _vector(value))]
        result[role] = (vector[0], dict(zip(COMPONENTS, vector[1:])))
    return result


def trace_plan_counts(target: Counts) -> tuple[Counts, list[Counts]]:
    """The shallow block counts to trace for a target: a base of up to two blocks of each kind present,
    and the base plus one block of each kind that the target has more of."""
    base = tuple(min(n, 2) for n in target)
    extra = []
    for kind in (0, 1):
        if target[kind] > base[kind]:
            bumped = list(base)
            bumped[kind] += 1
            extra.append(tuple(bumped))
    return base, [base] + extra


def _block_of_role(role: Hashable, checkpointed: list) -> Hashable:
    """The block window (phase, step, micro, block index) that plays `role` in a network whose blocks,
    in forward order, are `checkpointed`; other windows are returned as they are."""
    if role[0] not in ("fwd", "bwd") or len(role) == 4:
        return role
    phase, step, micro, run, _, position = role
    start, end, _ = _segments(checkpointed)[run]
    order = list(range(start, end)) if phase == "fwd" else list(range(end - 1, start - 1, -1))
    return (phase, step, micro, order[{"first": 0, "second": 1, "last": -1}[position]])


def planner_moment(window: Hashable, components: dict[str, int], depth: int) -> str:
    """The planner's moment (planner.memory.PHASES) that a traced peak in `window` is, or "" if none.

    The final layer's window runs the loss and then starts backward: before backward nothing is a temporary.
    """
    kind = window[0]
    if kind == "head":
        return "start_of_backward" if components.get("temporaries") else "end_of_forward"
    if kind == "fwd" and window[3] == depth - 1:
        return "last_block_forward"
    if kind == "bwd":
        return {depth - 1: "start_of_backward", 0: "end_of_backward"}.get(window[3], "")
    if kind == "opt":
        return "optimizer_step"
    if kind == "pre" and components.get("vae"):
        return "vae_encode"
    return ""


def _describe(window: Hashable) -> str:
    kind = window[0]
    if kind == "setup":
        return "before the first step"
    if kind == "end":
        return "after the last step"
    if kind == "opt":
        return f"optimizer step {window[1] + 1}"
    step, micro = window[1] + 1, window[2] + 1
    where = f"(step {step}, micro-step {micro})"
    if kind == "pre":
        return f"input and embedding {where}"
    if kind == "head":
        return f"final layer, loss and start of backward {where}"
    return f"{'forward' if kind == 'fwd' else 'backward'} of block {window[3]} {where}"


# ---------------------------------------------------------------------------------------------------
# The trainer's step for one plan, on fake tensors
# ---------------------------------------------------------------------------------------------------

# The Stable Diffusion VAE (sd-vae-ft-ema / -mse) that DiT encodes with: its architecture, no weights.
SD_VAE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "act_fn": "silu", "sample_size": 256, "scaling_factor": 0.18215,
}


def fake_batch(spec, micro_batch: int, device: torch.device, online: bool) -> dict:
    """One micro-batch as the trainer's `Collate` makes it (on fake tensors: shapes and dtypes only)."""
    side = spec.resolution if online else spec.latent_size
    channels = 3 if online else spec.in_channels
    batch = {
        "x": torch.randn(micro_batch, channels, side, side, device=device),
        "y": torch.randint(0, spec.num_classes, (micro_batch,), device=device),
        "sample_number": torch.arange(micro_batch, device=device),
        "t": torch.randint(0, 1000, (micro_batch,), device=device),
        "noise": torch.randn(micro_batch, spec.in_channels, spec.latent_size, spec.latent_size, device=device),
        "drop": torch.zeros(micro_batch, dtype=torch.bool, device=device),
    }
    if online:
        batch["posterior_noise"] = torch.randn_like(batch["noise"])
    return batch


def build_vae(vae_config: dict | None, device: torch.device):
    """A frozen AutoencoderKL of the given architecture (default: the SD VAE), and its latent (shift, scale)."""
    from diffusers import AutoencoderKL

    with device:
        vae = AutoencoderKL.from_config(vae_config or SD_VAE_CONFIG)
    vae.eval().requires_grad_(False)
    return vae, (float(getattr(vae.config, "shift_factor", None) or 0.0), float(vae.config.scaling_factor))


def build_step_parts(plan: dict, spec, checkpointed_blocks: int, micro_batch: int, device: str,
                     vae_config: dict | None = None, sharded_world_size: int = 0) -> StepParts:
    """The trainer's components (`dit_accel.train.build_components`, bare device, no Accelerator, the plan's
    own precision) and its step for `spec` (which may be shallower than the plan's network): the micro-step
    is `train_micro_step`; the optimizer step is `check_step` then `apply_step`, the path of a finite step,
    with no value read (`optimizer_step` only adds the decision between them and the numbers it logs).

    Inside a FakeTensorMode nothing it builds owns memory; outside one (`dit-accel calibrate`) it is real.

    `sharded_world_size` > 0: one rank's compute of a sharded plan instead (`make_sharded`).
    """
    import copy

    from dit_accel import train
    from dit_accel.train_config import TrainConfig

    variant = copy.deepcopy(plan)
    decision = variant["decision"]
    online = decision["latents"] == "online"
    decision.update(checkpointed_blocks=checkpointed_blocks, micro_batch=micro_batch)
    if online:  # the VAE comes from `vae_config` below, not from a weights folder
        decision["latents"] = "precomputed"
    config = TrainConfig(plan="(traced)", output_dir="(traced)", latents="(traced)")
    device = torch.device(device)
    # The plan's precision even where a bare-device run would fall back (fp16 on a CPU): the trace is a
    # proxy for the GPU run. Without an Accelerator there is no GradScaler (a few scalars).
    components = train.build_components(variant, config, device=device, spec=spec,
                                        precision="fp32" if sharded_world_size else plan["decision"]["precision"])
    components.plan = plan
    if online:
        components.vae, components.latent_shift_scale = build_vae(vae_config, device)
    batch = fake_batch(spec, micro_batch, device, online)
    losses = []

    def micro_step():
        losses.append(train.train_micro_step(components, batch))

    def optimizer_step():
        loss_sum = torch.stack(losses).sum()
        check = train.check_step(components, loss_sum)
        train.apply_step(components)  # with `check` and `loss_sum` alive, as in the trainer's optimizer_step
        del check, loss_sum
        losses.clear()

    model = components.raw_model
    parts = StepParts(model=model, blocks=list(model.transformer_blocks),
                      checkpointed=["forward" in block.__dict__ for block in model.transformer_blocks],
                      micro_step=micro_step, optimizer_step=optimizer_step, grad_accum=components.grad_accum,
                      ema_tensors=list(components.ema.shadow.values()) if components.ema is not None else [],
                      vae=components.vae, batch_tensors=list(batch.values()))
    if sharded_world_size:
        make_sharded(parts, plan["decision"]["precision"], sharded_world_size, losses)
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
    AdamW state and EMA are not traced (`sharded_accounting` adds them from the traced sizes), nor is the
    optimizer step, which only drops the gradient shards here.
    """
    from dit_accel.train import AUTOCAST_DTYPES

    compute_dtype = AUTOCAST_DTYPES[precision] or torch.float32
    for param in parts.model.parameters():
        param.data = param.data.to(compute_dtype)

    def cast_inputs(module, args, kwargs):
        def cast(value):
            return value.to(compute_dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        return tuple(map(cast, args)), {key: cast(value) for key, value in kwargs.items()}

    parts.model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    grad_shards: dict[int, torch.Tensor] = {}

    def on_grad(param, tracker):
        if id(param) not in grad_shards:
            shard = torch.zeros(math.ceil(param.numel() / world_size), dtype=torch.float32, device=param.device)
            tracker.tag(shard, "grads")
            grad_shards[id(param)] = shard
        param.grad = None  # the unsharded gradient is gone after its reduce-scatter

    def optimizer_step():
        grad_shards.clear()
        losses.clear()

    parts.on_grad, parts.optimizer_step, parts.ema_tensors = on_grad, optimizer_step, []


def _trace_once(plan: dict, spec, checkpointed_blocks: int, micro_batch: int, autocast_device: str,
                vae_config: dict | None = None, sharded_world_size: int = 0) -> tuple[StorageTracker, list]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):  # a value read in the step would raise here
        parts = build_step_parts(plan, spec, checkpointed_blocks, micro_batch, autocast_device, vae_config,
                                 sharded_world_size)
        tracker = StorageTracker()
        run_traced(parts, tracker)
    return tracker, parts.checkpointed


def _runs_kinds(checkpointed: list) -> list[bool]:
    return [kind for _, _, kind in _segments(checkpointed)]


def trace_training_step(plan: dict, *, depth_extrapolate: str = "auto", autocast_device: str | None = None,
                        micro_batch: int | None = None, vae_config: dict | None = None) -> TraceResult:
    """Trace the plan's training step on fake tensors and return its peak and the components live then.

    `depth_extrapolate="auto"` traces at most 5 blocks (up to three shallow traces) and extrapolates per
    block, unless the full network is as cheap to trace; `"on"` always extrapolates (tests); `"off"`
    traces the full depth. `autocast_device` is "cpu" (default without CUDA) or "cuda"
    (needs a CUDA build of torch; fake CUDA tensors allocate nothing on the GPU either). `vae_config`
    (online latents): the AutoencoderKL's config; default the SD VAE's (`SD_VAE_CONFIG`).

    A sharded plan (zero2/zero3) is traced as one rank's compute under FSDP2 (`make_sharded`: parameters in the
    compute dtype, no autocast, 1/world_size fp32 gradient shards); `sharded_accounting` completes it.
    """
    from dit_accel.train import spec_from_plan

    if depth_extrapolate not in ("auto", "on", "off"):
        raise UserError(f"--depth-extrapolate must be auto or off, got {depth_extrapolate!r}")
    autocast_device = autocast_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if autocast_device not in ("cpu", "cuda"):
        raise UserError(f"--device-autocast must be cpu or cuda, got {autocast_device!r}")
    if autocast_device == "cuda" and not torch.backends.cuda.is_built():
        raise UserError("--device-autocast cuda needs a CUDA build of torch (fake CUDA tensors): use --device-autocast cpu here")
    decision = plan["decision"]
    spec = spec_from_plan(plan)
    micro_batch = int(micro_batch or decision["micro_batch"])
    checkpointed = int(decision["checkpointed_blocks"])
    if not 0 <= checkpointed <= spec.depth:
        raise UserError(f"plan decision.checkpointed_blocks {checkpointed} is outside 0..{spec.depth}: re-create the plan")
    sharding = decision.get("sharding", "ddp")
    world_size = max(1, int(plan.get("cluster", {}).get("world_size") or 1)) if sharding != "ddp" else 1
    if sharding not in ("ddp", "zero2", "zero3"):
        raise UserError(f"plan decision.sharding {sharding!r} is not ddp, zero2 or zero3: re-create the plan")
    target = (spec.depth - checkpointed, checkpointed)
    base, all_counts = trace_plan_counts(target)
    started = time.perf_counter()

    def trace(counts: Counts) -> tuple[StorageTracker, list]:
        shallow = dataclasses.replace(spec, depth=sum(counts))
        return _trace_once(plan, shallow, counts[1], micro_batch, autocast_device, vae_config,
                           world_size if sharding != "ddp" else 0)

    # Each trace also runs the embedding, final layer and loss (about two blocks' worth of ops): when the
    # shallow traces together would run as many ops as the full network, trace the full network.
    shallow_cost = sum(sum(counts) + 2 for counts in all_counts)
    if depth_extrapolate == "off" or sum(base) == spec.depth or (depth_extrapolate == "auto" and shallow_cost >= spec.depth + 2):
        tracker, _ = trace(target)
        peak_bytes, components, window = tracker.peak_bytes, tracker.peak_components, tracker.peak_window
        traced_depths = [spec.depth]
    else:
        samples, patterns = {}, set()
        for counts in all_counts:
            tracker, kinds = trace(counts)
            samples[counts] = role_peaks(tracker, kinds)
            patterns.add(tuple(_runs_kinds(kinds)))
        if len(patterns) != 1:
            raise AssertionError(f"the checkpointed blocks change order with depth ({patterns}): cannot extrapolate")
        roles = extrapolate(samples, target, base)
        # the latest of equal peaks: the second optimizer step, whose state is already tagged as such
        role = max(reversed(list(roles)), key=lambda role: roles[role][0])
        peak_bytes, components = roles[role]
        pattern = patterns.pop()  # the kinds of the runs in forward order, e.g. (True, False)
        target_checkpointed = [kind for kind in pattern for _ in range(target[1] if kind else target[0])]
        window = _block_of_role(role, target_checkpointed)
        traced_depths = [sum(counts) for counts in all_counts]
    return TraceResult(peak_bytes=peak_bytes, components=dict(components), peak_at=_describe(window),
                       depth=spec.depth, checkpointed_blocks=checkpointed, micro_batch=micro_batch,
                       precision=decision["precision"], autocast_device=autocast_device,
                       traced_depths=traced_depths, seconds=round(time.perf_counter() - started, 2),
                       sharding=sharding, world_size=world_size,
                       peak_moment=planner_moment(window, components, spec.depth) if sharding != "ddp" else "")


# ---------------------------------------------------------------------------------------------------
# The planner's estimate of the same step, and the comparison
# ---------------------------------------------------------------------------------------------------

# Planner components a tensor trace can check; "overhead" (CUDA context, NCCL, fragmentation) it cannot.
COMPARED = ("weights", "grads", "optimizer", "ema", "activations", "autocast_cache", "vae", "temporaries")


def traced_optimizer_kind(plan: dict, device: str) -> str:
    """The AdamW implementation the trainer gets on `device` (dit_accel.optim.build_optimizer): the plan's
    (default fused) on CUDA; on a CPU always PyTorch's default there, the per-tensor loop ("single": its
    temporaries are a few copies of one parameter, which the planner does not model)."""
    return plan["decision"].get("adamw") or "fused" if device == "cuda" else "single"


def planner_phases(plan: dict, autocast_device: str, sharding: str = "ddp", world_size: int = 1) -> dict:
    """The planner's components at each moment of this plan's step, for `world_size` processes of `sharding`
    on one node, with the AdamW a trace on `autocast_device` runs."""
    from dataclasses import fields

    from dit_accel.train import spec_from_plan
    from planner.hardware import Assumptions
    from planner.memory import Cluster, Decision, step_memory

    spec = spec_from_plan(plan)
    decision = plan["decision"]
    known = {f.name for f in fields(Decision)}
    values = {key: value for key, value in decision.items() if key in known}
    values.update(sharding=sharding, adamw=traced_optimizer_kind(plan, autocast_device))
    assumptions = Assumptions()
    recorded = {key: value for key, value in plan.get("assumptions", {}).items() if hasattr(assumptions, key)}
    assumptions = assumptions.replace(**recorded).replace(autocast_device=autocast_device)
    cluster = Cluster(nodes=1, gpus_per_node=world_size,
                      vram_bytes=int(plan.get("cluster", {}).get("vram_bytes") or 2**50))
    return step_memory(spec, Decision(**values), cluster, assumptions).phases


def planner_estimate(plan: dict, autocast_device: str) -> tuple[int, dict[str, int], str]:
    """The planner's traceable peak for this plan as a single process would trace it: (bytes, components
    at the planner's peak moment without overhead, that moment). World size 1: no DDP buckets."""
    phases = planner_phases(plan, autocast_device)
    best_phase, best = None, -1
    for phase, components in phases.items():
        traceable = sum(components[name] for name in COMPARED)
        if traceable > best:
            best_phase, best = phase, traceable
    return best, {name: phases[best_phase][name] for name in COMPARED}, best_phase


@dataclass
class Comparison:
    """Traced vs planned bytes, component by component, and the peak."""

    rows: list  # (name, traced_bytes, planned_bytes or None, relative error or None)
    traced_peak_bytes: int
    planned_peak_bytes: int
    planned_phase: str

    @property
    def peak_error(self) -> float:
        return relative_error(self.planned_peak_bytes, self.traced_peak_bytes)

    def component_error(self, name: str) -> float | None:
        return next(row[3] for row in self.rows if row[0] == name)


def relative_error(planned: int, traced: int) -> float:
    """(planned - traced) / traced; 0 when both are 0, infinite when only the trace is 0."""
    if traced == 0:
        return 0.0 if planned == 0 else math.inf
    return (planned - traced) / traced


def traced_as_planner_components(result: TraceResult) -> dict[str, int]:
    """The trace's components under the planner's names: the positional buffer is in the planner's weights;
    the micro-batch itself (inputs, noise, labels) the planner does not count separately."""
    traced = {name: result.components.get(name, 0) for name in COMPARED}
    traced["weights"] += result.components.get("buffers", 0)
    return traced


def compare(result: TraceResult, plan: dict) -> Comparison:
    planned_peak, planned, phase = planner_estimate(plan, result.autocast_device)
    traced = traced_as_planner_components(result)
    rows = [(name, traced[name], planned[name], relative_error(planned[name], traced[name])) for name in COMPARED]
    rows.append(("batch (inputs, noise, labels)", result.components.get("batch", 0), None, None))
    return Comparison(rows=rows, traced_peak_bytes=result.peak_bytes, planned_peak_bytes=planned_peak,
                      planned_phase=phase)


# ---------------------------------------------------------------------------------------------------
# Sharded plans: one rank, part traced, part derived
# ---------------------------------------------------------------------------------------------------


@dataclass
class ShardedComparison:
    """One rank of a sharded plan beside the planner's estimate for that rank.

    At the traced compute peak (forward/backward), every component is either traced (activations, autocast
    cache, VAE, temporaries, the emulated gradient shards), derived from the traced sizes (the fp32 master
    shard, AdamW state and EMA: 1/world_size of the traced parameters), or, for zero3's gathered parameters,
    modelled as the planner models them (one process cannot reshard). `rows` say which, in their last field.
    The optimizer step is not traced: its states are derived the same way (no temporaries).
    """

    rows: list  # (name, rank bytes, planned bytes or None, relative error or None, how it is known)
    compute_peak_bytes: int  # the rank at the traced compute peak, derived as the rows say (with the batch)
    planned_compute_bytes: int  # the planner at the traced peak's moment (traceable components)
    planned_compute_phase: str
    optimizer_step_bytes: int  # derived: master shard + buffer + grad, AdamW and EMA shards
    planned_optimizer_step_bytes: int  # the planner's, with its AdamW temporaries

    @property
    def peak_bytes(self) -> int:
        return max(self.compute_peak_bytes, self.optimizer_step_bytes)

    @property
    def planned_peak_bytes(self) -> int:
        return max(self.planned_compute_bytes, self.planned_optimizer_step_bytes)

    component_error = Comparison.component_error  # rows share Comparison's first four fields


def compare_sharded(result: TraceResult, plan: dict) -> ShardedComparison:
    """Complete the traced compute of one rank (`make_sharded`) with what one process cannot trace, and put it
    beside the planner's sharded estimate for the same moment, component by component."""
    from dit_accel.train import spec_from_plan

    spec = spec_from_plan(plan)
    world_size, traced = result.world_size, result.components
    compute_bytes = 4 if result.precision == "fp32" else 2
    dtype = {2: result.precision, 4: "fp32"}[compute_bytes]
    gathered = traced["weights"]  # every parameter, converted to the compute dtype: all units gathered at once
    params = gathered // compute_bytes
    master = 4 * params // world_size
    if result.sharding == "zero3":
        held_blocks = min(2, spec.depth)  # the unit in use and the prefetched next, plus the root (planner's rule)
        gathered = compute_bytes * (params - (spec.depth - held_blocks) * spec.block_params)
        gathered_how = f"modelled {dtype} gathered parameters: root unit + {held_blocks} block units (planner's rule)"
    else:
        gathered_how = f"traced {dtype} gathered parameters: every unit, forward to end of backward"
    ema = 4 * params // world_size if plan["decision"].get("ema", True) else 0
    derived = f"derived: 1/{world_size} of the traced {params:,} parameters"
    rank = {
        "weights": (master + traced["buffers"] + gathered,
                    f"{derived} x 4 B (fp32 master shard) + traced fp32 buffer + {gathered_how}"),
        "grads": (traced["grads"], f"traced: fp32 1/{world_size} shards as each reduce-scatter leaves them (emulated)"),
        "optimizer": (2 * 4 * params // world_size, f"{derived} x 8 B (AdamW exp_avg, exp_avg_sq)"),
        "ema": (ema, f"{derived} x 4 B (fp32 EMA)" if ema else "no EMA"),
        "activations": (traced["activations"], f"traced: pure {dtype}, no autocast"),
        "autocast_cache": (traced["autocast_cache"], "traced: no autocast, so no cache"),
        "vae": (traced["vae"], "traced"),
        "temporaries": (traced["temporaries"], "traced: unsharded grads freed per parameter, not per unit"),
    }
    phases = planner_phases(plan, result.autocast_device, result.sharding, world_size)
    compute_phases = {phase: parts for phase, parts in phases.items() if phase != "optimizer_step"}
    # the planner at the moment the trace peaked, else at its own largest forward/backward moment
    planned_phase = result.peak_moment if result.peak_moment in compute_phases else \
        max(compute_phases, key=lambda phase: sum(compute_phases[phase][name] for name in COMPARED))
    planned = compute_phases[planned_phase]
    rows = [(name, rank[name][0], planned[name], relative_error(planned[name], rank[name][0]), rank[name][1])
            for name in COMPARED]
    rows.append(("batch (inputs, noise, labels)", traced.get("batch", 0), None, None, "traced"))
    optimizer_step = master + traced["buffers"] + 4 * params // world_size + 2 * 4 * params // world_size + ema
    return ShardedComparison(
        rows=rows, compute_peak_bytes=sum(row[1] for row in rows),
        planned_compute_bytes=sum(planned[name] for name in COMPARED), planned_compute_phase=planned_phase,
        optimizer_step_bytes=optimizer_step,
        planned_optimizer_step_bytes=sum(phases["optimizer_step"][name] for name in COMPARED))


def format_sharded_report(result: TraceResult, comparison: ShardedComparison, plan_path: str = "plan.json",
                          plan_notes: dict | None = None) -> str:
    """One rank of a sharded plan beside the planner, each figure labelled traced, derived or modelled."""
    from tabulate import tabulate

    rows = [(name, _gib(rank), _gib(planned), _percent(error), how) for name, rank, planned, error, how in comparison.rows]
    rows.append(("rank at the compute peak", _gib(comparison.compute_peak_bytes), _gib(comparison.planned_compute_bytes),
                 _percent(relative_error(comparison.planned_compute_bytes, comparison.compute_peak_bytes)), ""))
    rows.append(("optimizer step", _gib(comparison.optimizer_step_bytes), _gib(comparison.planned_optimizer_step_bytes),
                 _percent(relative_error(comparison.planned_optimizer_step_bytes, comparison.optimizer_step_bytes)),
                 "derived states, not traced (the planner adds AdamW's temporaries)"))
    rows.append(("peak of the rank", _gib(comparison.peak_bytes), _gib(comparison.planned_peak_bytes),
                 _percent(relative_error(comparison.planned_peak_bytes, comparison.peak_bytes)), ""))
    depths = _depths_text(result)
    lines = [
        f"traced compute of one rank of {plan_path} ({result.sharding}, FSDP2, world size {result.world_size}): "
        f"micro-batch {result.micro_batch}, pure {result.precision} (parameters in the compute dtype, no autocast), "
        f"{result.checkpointed_blocks}/{result.depth} blocks checkpointed ({depths}; {result.seconds:.1f} s, "
        f"nothing allocated)",
        f"traced compute peak during {result.peak_at}; planner's moment compared: "
        f"{comparison.planned_compute_phase.replace('_', ' ')}",
        "traced: what the step's tensors hold; derived: 1/world_size of the traced sizes; modelled: the planner's "
        "rule, which one process cannot run",
    ]
    if plan_notes and plan_notes.get("memory", {}).get("peak_bytes"):
        memory = plan_notes["memory"]
        lines.append(f"the plan's own peak (its GPU, overhead, NCCL, fragmentation): {_gib(memory['peak_bytes'])} "
                     f"of a {_gib(memory.get('budget_bytes'))} budget")
    lines += [
        "",
        tabulate(rows, headers=["component (one rank)", "rank", "planner", "planner error", "how it is known"],
                 tablefmt="simple", disable_numparse=True),
        "",
        "not seen by a tensor trace (the planner adds these as overhead, not checked here):",
    ]
    unseen = [item for item in result.unseen if not item.startswith("CPU-vs-CUDA")]  # no autocast to differ
    unseen.append("FSDP2's all-gather and reduce-scatter buffers, and the unsharded gradients of a whole unit "
                  "before its reduce-scatter")
    lines += [f"  - {item}" for item in unseen]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# dit-accel verify
# ---------------------------------------------------------------------------------------------------


def _gib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**30:.3f} GiB"


def _percent(error: float | None) -> str:
    if error is None:
        return "-"
    return "n/a (trace 0)" if math.isinf(error) else f"{error:+.1%}"


def _depths_text(result: TraceResult) -> str:
    return ("full depth" if result.traced_depths == [result.depth]
            else f"traced at depths {', '.join(map(str, result.traced_depths))}, extrapolated per block")


def comparison_plan_notes(plan: dict | None) -> list[str]:
    """What the plan says beyond what one traced process can show."""
    if not plan:
        return []
    notes = []
    memory = plan.get("memory", {})
    if memory.get("peak_bytes"):
        notes.append(f"the plan's own peak (its GPU's autocast, overhead, DDP buckets, fragmentation): "
                     f"{_gib(memory['peak_bytes'])} of a {_gib(memory.get('budget_bytes'))} budget")
    return notes  # (a sharded plan has its own report: format_sharded_report)


def format_report(result: TraceResult, comparison: Comparison, plan_path: str = "plan.json",
                  plan_notes: dict | None = None) -> str:
    """The traced step beside the planner's estimate, and what the trace cannot see."""
    from tabulate import tabulate

    rows = [(name, _gib(traced), _gib(planned), _percent(error)) for name, traced, planned, error in comparison.rows]
    rows.append(("traceable peak", _gib(result.peak_bytes), _gib(comparison.planned_peak_bytes),
                 _percent(comparison.peak_error)))
    depths = _depths_text(result)
    lines = [
        f"traced training step of {plan_path}: micro-batch {result.micro_batch}, {result.precision} "
        f"({result.autocast_device} autocast), {result.checkpointed_blocks}/{result.depth} blocks checkpointed "
        f"({depths}; {result.seconds:.1f} s, nothing allocated)",
        f"traced peak: {_gib(result.peak_bytes)} during {result.peak_at}; "
        f"planner's peak moment: {comparison.planned_phase.replace('_', ' ')}; planner figures are for one process "
        f"as traced (the plan's own adds DDP buckets when world_size > 1)",
    ]
    lines += comparison_plan_notes(plan_notes) + [
        "",
        tabulate(rows, headers=["component (live at the peak)", "traced", "planner", "planner error"],
                 tablefmt="simple", disable_numparse=True),
        "",
        "not seen by a tensor trace (the planner adds these as overhead, not checked here):",
    ]
    lines += [f"  - {item}" for item in result.unseen]
    return "\n".join(lines)


def _vae_config(folder: str) -> dict:
    """The config.json of an AutoencoderKL folder (or of a pipeline folder's vae/)."""
    import json

    for candidate in (Path(folder) / "config.json", Path(folder) / "vae" / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise UserError(f"--vae {folder} has no config.json (nor vae/config.json): pass a folder written by "
                    f"AutoencoderKL.save_pretrained, or leave --vae out to trace the SD VAE")


@exits_cleanly("dit-accel verify")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dit-accel verify",
        description="Trace one real training step of the plan on fake tensors (nothing is allocated) and compare "
                    "its peak memory, component by component, with the planner's estimate.")
    parser.add_argument("plan", help="plan.json written by dit-plan")
    parser.add_argument("--depth-extrapolate", choices=("auto", "off"), default="auto",
                        help="auto: trace at most 5 blocks and extrapolate per block (exact); off: trace every block")
    parser.add_argument("--device-autocast", choices=("cpu", "cuda"), default=None,
                        help="whose autocast casts the ops: cuda needs a CUDA build of torch (default: cuda if "
                             "available, else cpu)")
    parser.add_argument("--micro-batch", type=int, default=None, help="trace this micro-batch instead of the plan's")
    parser.add_argument("--vae", default=None, help="online latents: a diffusers AutoencoderKL folder whose "
                        "config.json to trace (weights are not read); default: the SD VAE's architecture")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the trace and comparison here")
    args = parser.parse_args(argv)
    from dit_accel.train import read_plan

    plan = read_plan(args.plan)
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise UserError(f"--micro-batch must be positive, got {args.micro_batch}")
        plan["decision"]["micro_batch"] = args.micro_batch
    result = trace_training_step(plan, depth_extrapolate=args.depth_extrapolate, autocast_device=args.device_autocast,
                                 vae_config=_vae_config(args.vae) if args.vae else None)
    if result.sharding != "ddp":
        sharded = compare_sharded(result, plan)
        print(format_sharded_report(result, sharded, args.plan, plan))
        if args.json_out:
            from dit_accel.atomic import write_json_atomically

            write_json_atomically(Path(args.json_out), {
                "trace": result.to_json(),
                "rank": {row[0]: {"bytes": row[1], "how": row[4]} for row in sharded.rows},
                "planner": {"phase": sharded.planned_compute_phase,
                            "components": {row[0]: row[2] for row in sharded.rows if row[2] is not None},
                            "optimizer_step_bytes": sharded.planned_optimizer_step_bytes,
                            "peak_bytes": sharded.planned_peak_bytes},
                "peak_bytes": sharded.peak_bytes,
                "peak_error": relative_error(sharded.planned_peak_bytes, sharded.peak_bytes),
            })
        return 0
    comparison = compare(result, plan)
    print(format_report(result, comparison, args.plan, plan))
    if args.json_out:
        from dit_accel.atomic import write_json_atomically

        write_json_atomically(Path(args.json_out), {
            "trace": result.to_json(),
            "planner": {"peak_bytes": comparison.planned_peak_bytes, "phase": comparison.planned_phase,
                        "components": {row[0]: row[2] for row in comparison.rows if row[2] is not None}},
            "peak_error": comparison.peak_error,
        })
    return 0
