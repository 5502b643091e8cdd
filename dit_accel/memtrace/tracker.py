"""The tracker: every live tensor storage of a traced step, counted once, by component, and its peaks.

A dispatch-level mode (no allocation happens under FakeTensorMode) that sees each op's outputs as they are
created and each storage's release through a weakref, so it knows what is alive at every moment.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.components import ALLOCATED

# Components in the order they are printed: the planner's (plan.json's memory keys) that a trace sees,
# then the trace's own two (the batch; buffers, which the planner counts in its weights).
COMPONENTS = (
    *ALLOCATED,
    "batch",
    "buffers",
)

UNSEEN = (
    "CUDA context and kernels (~0.3-1 GB per process)",
    "cuBLAS/cuDNN workspaces and memory inside kernels",
    "NCCL buffers (hundreds of MB per communicator) and DDP gradient buckets (4 bytes/param unless "
    "gradient_as_bucket_view=True): no process group is traced",
    "the caching allocator's rounding and fragmentation: not seen by the trace, but replayed from its "
    "allocations and frees through a model of the allocator (the reserved rows)",
    "CPU-vs-CUDA autocast: the two cast different ops (CUDA keeps layer_norm in fp32); a CPU trace "
    "of bf16/fp16 is a proxy for the GPU",
)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


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
        self.in_repa = 0  # inside REPA's frozen encoder (set by the driver's hooks)
        self._info: dict[int, list] = {}  # id(storage) -> [nbytes, component, weakref, event key]
        # every storage's allocation (key, nbytes) and free (key, None), in order: the allocator replays them
        self.events: list[tuple[int, int | None]] = []
        self.event_windows: list[Hashable] = []  # the window each event happened in (benchmarks read it)

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
            event_key = len(self.events)  # unique, where id() is reused once a storage is gone
            self._info[key] = [nbytes, component, ref, event_key]
            self.events.append((event_key, nbytes))
            self.event_windows.append(self.window)
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
            self.events.append((info[3], None))
            self.event_windows.append(self.window)
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

    def allocator_peaks(self) -> dict[str, dict[str, int]]:
        """The recorded allocations and frees replayed through the caching-allocator model, in both modes:
        {"fixed" | "expandable": {requested_peak_bytes, allocated_peak_bytes, reserved_peak_bytes (memory to
        spare), reclaimable_at_peak_bytes (what a release returns there), least_reserved_bytes (the least
        the step runs in, releasing its cache under pressure)}}."""
        from dit_accel.memtrace.allocator import least_reserved, replay_both

        return {
            mode: {
                "requested_peak_bytes": peaks.requested_peak_bytes,
                "allocated_peak_bytes": peaks.allocated_peak_bytes,
                "reserved_peak_bytes": peaks.reserved_peak_bytes,
                "reclaimable_at_peak_bytes": peaks.reclaimable_at_peak_bytes,
                "least_reserved_bytes": least_reserved(self.events, mode == "expandable"),
            }
            for mode, peaks in replay_both(self.events).items()
        }

    def set_window(self, window: Hashable) -> None:
        self.window = window
        self._note_peak()  # a window starts with what is live when it opens

    # --- dispatch ----------------------------------------------------------------------------------
    def _component_for_new(self, func, args) -> str:
        if self.in_vae:
            return "vae"
        if self.in_repa:
            return "repa"
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
    traced_depths: list[int] = field(
        default_factory=list
    )  # the depths really traced (extrapolated if shallower)
    seconds: float = 0.0
    unseen: tuple[str, ...] = UNSEEN
    # a sharded plan is traced as ONE rank's compute (`driver.make_sharded`); "ddp": the whole unsharded step
    sharding: str = "ddp"
    world_size: int = 1
    peak_moment: str = ""  # sharded: the planner's moment (planner.components.PHASES) that the traced peak is
    # the step's allocations and frees replayed through the caching-allocator model (`allocator_peaks`),
    # by mode; `allocator_depths`: "traced" (replayed at the plan's depth) or "not replayed" (an extrapolated
    # trace without `replay_at_depth`: reserved bytes do not extrapolate per block)
    allocator: dict = field(default_factory=dict)
    allocator_depths: str = "traced"

    def to_json(self) -> dict:
        values = {
            key: (list(value) if isinstance(value, tuple) else value) for key, value in self.__dict__.items()
        }
        if self.sharding == "ddp":  # a DDP trace's JSON as it always was
            del values["sharding"], values["world_size"], values["peak_moment"]
        return values
