"""Reserved bytes: what PyTorch's CUDA caching allocator holds for the step's tensors, from their allocated
bytes. A GPU runs out of reserved memory (nvidia-smi shows it, an OOM is decided on it), not allocated.

    reserved = allocated + rounding + fragmentation x transient + page rounding

rounding       the persistent tensors, one per parameter (fp32 master weights, AdamW's two states, the
               EMA, the VAE's weights), each held in whole allocator blocks: with fixed segments a tensor of
               10 MiB or more gets its own segment, rounded up to 2 MiB, and the 1-10 MiB ones pack into
               shared 20 MiB segments (`packed_rounding_bytes`); with expandable segments only the 512 B
               rounding of every request remains. DDP's gradient buckets (25 MiB each) round the same.
transient      what the step allocates and frees again (activations, autocast's weight copies, gradients,
               temporaries, the VAE encoder's working set): the cached blocks they leave behind do not always
               fit the next requests, so the allocator holds more than they need at once. The fraction is
               calibrated against the verify grid's traced steps replayed through a model of the allocator
               (dit_accel/memtrace/allocator.py; benchmarks/reserved_replay.py; docs/planner-accuracy.md).
page rounding  expandable segments map 20 MiB pages (large pool) and 2 MiB pages (small pool).

Online latents follow the allocator's order of events instead (`online_reserved_bytes`): the first VAE
encode maps the encoder's footprint on top of the persistent tensors (AdamW's states already among them: the
trainer makes them before the first step), and everything after it reuses that cache. Reserved memory never
falls unless the allocator releases its cache, so every later moment holds at least that
(`reserved_floor_bytes`). A codebase whose AdamW makes its states in the first optimizer step
(`Assumptions.adamw_state="lazy"`) makes them out of the encoder's cache, and its second encode maps anew.
Under gradient accumulation the first micro-step's backward makes the gradients out of that cache, and
every later micro-step's encode maps the room they spoiled anew (`accumulating_encode_bytes`).

Fixed segments never merge, and in the first backward every gradient is new memory: a gradient whose block
is larger than a 20 MiB segment and than every transient tensor's (the freed blocks it could split) finds
nothing cached to take, and maps a segment of its own on top of what the forward mapped
(`new_gradient_segment_bytes`). DiT-L's 24 MiB adaLN gradients beside 16 MiB MLP activations, DiT-XL's 30
and 20 MiB ones beside 18 MiB activations (DiT-XL/8 at micro-batch 128): every step after the first
reuses those segments, so the reserved peak holds the forward's reserve plus them.

Under memory pressure the allocator, before it reports out of memory, releases what it caches unused (free
whole segments; with expandable segments, free pages) and retries. `reserved_bytes(..., pressure=True)` is
the least reserved memory the step runs in that way, the figure a GPU's budget is held to: what a release
returns (the encoder's cached working set, most of the transient fragmentation) is left out of it. Both are
calibrated on the same replays (`least_reserved` in dit_accel/memtrace/allocator.py).

`Assumptions.allocator_segments` says which allocator the run uses ("expandable": the trainer sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on CUDA unless the user set that variable; "fixed": the
PyTorch default), and `Assumptions.fragmentation`, when above 0 (a calibration measured it), replaces this
model by the measured reserved/allocated ratio.
"""

from __future__ import annotations

import functools

from planner.spec import TIMESTEP_FREQ_DIM, DiTSpec

MiB = 1 << 20
MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = MiB  # up to 1 MiB: the small pool (2 MiB segments)
OWN_SEGMENT_BYTES = 10 * MiB  # fixed segments: requests from 10 MiB get a segment of their own ...
SEGMENT_ROUNDING_BYTES = 2 * MiB  # ... rounded up to 2 MiB
LARGE_PAGE_BYTES = 20 * MiB  # expandable segments: the large pool's page
SMALL_PAGE_BYTES = 2 * MiB  # and the small pool's
DDP_BUCKET_BYTES = 25 * MiB  # torch DDP's bucket_cap_mb default
SEGMENT_MODES = ("expandable", "fixed")
# reserved beyond allocated per transient byte, calibrated on the replayed verify grid (expandable: the largest
# the precomputed points need, rounded up; fixed: beside the gradients' own segments, which
# `new_gradient_segment_bytes` counts, the value that holds every point within 3%; docs/planner-accuracy.md)
TRANSIENT_FRAGMENTATION = {"fixed": 0.02, "expandable": 0.03}
# online latents: the new reserved memory the VAE encoder's maps take on a cache with nothing to reuse, per
# byte of its working set; measured alike at DiT-S/2, XL/2 and L/2 (docs/planner-accuracy.md, "Online
# latents: where the reserved peak forms"): fixed segments round its multi-GiB maps into their own segments
ENCODER_FOOTPRINT = {"fixed": 1.2, "expandable": 1.0}
# under pressure (the cache released and the request retried): what stays reserved beyond allocated per
# transient byte, and of the encoder's working set: expandable, the largest the replayed points need, rounded
# up; fixed, no more than with memory to spare (a release returns few whole segments of the transient
# tensors; the points need -0.12..+0.07; docs/planner-accuracy.md, "Memory pressure"). Expandable segments
# unmap nearly all of the encoder's pages; fixed ones cannot release its segments, which the DiT's tensors
# have split (partly live)
PRESSURE_FRAGMENTATION = {"fixed": 0.02, "expandable": 0.01}
PRESSURE_VAE_MISS = {"fixed": 0.9, "expandable": 0.10}
# fixed segments: the largest transient tensors each block's backward frees (the MLP's hidden activation, GELU's
# output), blocks its gradients can split (`new_gradient_segment_bytes`)
FREED_LARGEST_PER_BLOCK = 2


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def packed_rounding_bytes(sizes: list[int]) -> int:
    """Fixed segments: what requests of 1-10 MiB (`sizes`, rounded, in allocation order) hold beyond their
    bytes. They share 20 MiB segments: each takes the free rest that fits it best, else a new segment; a
    rest of 1 MiB or less stays with its block, a larger one waits for a later request. DiT-XL/2's 1152 x
    1152 fp32 matrices (5.06 MiB) go three to a segment, 4.81 MiB left each time."""
    rests: list[int] = []
    segments = 0
    for size in sizes:
        fitting = [rest for rest in rests if rest >= size]
        if fitting:
            rests.remove(min(fitting))
            rest = min(fitting) - size
        else:
            segments += 1
            rest = LARGE_PAGE_BYTES - size
        if rest > SMALL_REQUEST_BYTES:
            rests.append(rest)
    return segments * LARGE_PAGE_BYTES - sum(sizes)


def block_bytes(nbytes: int, segments: str) -> int:
    """The bytes one tensor of `nbytes`, allocated once and kept, holds in the allocator."""
    size = _round_up(max(nbytes, 1), MIN_BLOCK_BYTES)
    if segments == "fixed" and size >= OWN_SEGMENT_BYTES:
        return _round_up(size, SEGMENT_ROUNDING_BYTES)
    return size


def new_gradient_segment_bytes(
    block_gradients: list[int], blocks: int, other_gradients: list[int], largest_transient_bytes: int
) -> int:
    """Fixed segments: the segments the first backward maps for gradients no freed block holds. Every
    gradient is new memory then (bytes: `block_gradients` of each of `blocks` blocks, in the order backward
    makes them, and `other_gradients`), and a freed block is never merged with another segment. One that fits
    a 20 MiB segment takes a shared one; a larger one that exceeds the largest tensor the step allocates and
    frees (`largest_transient_bytes`, the MLP's hidden activation) maps its own, rounded to 2 MiB. The others
    split the freed blocks of that size: a block's backward frees FREED_LARGEST_PER_BLOCK of them (its MLP's
    input to GELU and GELU's output) and its gradients share them best-fit; one that finds no rest to take
    maps its own segment. DiT-XL's fc2, fc1 and adaLN gradients (20.25, 20.25, 30.4 MiB) share one 72 MiB
    block but need three of 36 MiB, one more than the block frees."""
    fits = _round_up(largest_transient_bytes, MIN_BLOCK_BYTES)
    requests = [_round_up(size, MIN_BLOCK_BYTES) for size in other_gradients]
    new = sum(block_bytes(size, "fixed") for size in requests if size > max(fits, LARGE_PAGE_BYTES))
    per_block, rests, hosts = 0, [], 0
    for size in (_round_up(size, MIN_BLOCK_BYTES) for size in block_gradients):
        if size <= LARGE_PAGE_BYTES:
            continue
        fitting = [rest for rest in rests if rest >= size]
        if fitting:
            rests.remove(min(fitting))
            rest = min(fitting) - size
        elif size <= fits and hosts < FREED_LARGEST_PER_BLOCK:
            hosts += 1
            rest = fits - size
        else:
            per_block += block_bytes(size, "fixed")
            continue
        if rest > SMALL_REQUEST_BYTES:
            rests.append(rest)
    return new + blocks * per_block


def block_parameter_elements(spec: DiTSpec) -> list[int]:
    """The element count of one transformer block's parameter tensors, in the order the block uses them
    (adaLN, q, k, v, out, fc1, fc2 with their biases): backward makes their gradients in reverse."""
    d, h = spec.hidden, spec.mlp_hidden
    return [6 * d * d, 6 * d] + [d * d, d] * 4 + [h * d, h, d * h, d]


def outer_parameter_elements(spec: DiTSpec) -> list[int]:
    """The element count of the parameter tensors outside the blocks: the patch conv, the shared timestep and
    class embedder, the final layer."""
    d, p = spec.hidden, spec.patch
    return [
        spec.in_channels * p * p * d,
        d,  # patch conv
        TIMESTEP_FREQ_DIM * d,
        d,
        d * d,
        d,  # timestep MLP
        (spec.num_classes + 1) * d,  # class table
        2 * d * d,
        2 * d,
        d * p * p * spec.out_channels,
        p * p * spec.out_channels,  # final layer
    ]


def parameter_elements(spec: DiTSpec) -> list[int]:
    """The element count of every trainable parameter tensor of the tied-embedder DiT (they sum to
    `spec.params_trainable`)."""
    return outer_parameter_elements(spec) + spec.depth * block_parameter_elements(spec)


@functools.lru_cache(maxsize=256)  # the search asks it for every candidate and phase of one model
def parameter_rounding_bytes(spec: DiTSpec, element_bytes: int, shards: int, segments: str) -> int:
    """What one copy of the parameters (fp32 weights, a state, the EMA), sharded `shards` ways, holds beyond
    its bytes."""
    sizes = [-(-n // shards) * element_bytes for n in parameter_elements(spec)]
    if segments != "fixed":
        return sum(block_bytes(size, segments) - size for size in sizes)
    shared = [size for size in sizes if SMALL_REQUEST_BYTES < size < OWN_SEGMENT_BYTES]  # 20 MiB segments
    rounding = sum(block_bytes(size, segments) - size for size in sizes if size not in shared)
    rounded = [_round_up(size, MIN_BLOCK_BYTES) for size in shared]
    return rounding + packed_rounding_bytes(rounded) + sum(rounded) - sum(shared)


def stream_pool_reserved(buffers: list[int], segments: str) -> int:
    """What a side stream's pool reserves for the buffers it caches (their sizes in bytes): with expandable
    segments one segment of its own, mapped in whole 20 MiB pages; with fixed segments each buffer of 10 MiB
    or more a segment rounded to 2 MiB, and the smaller ones packed into 20 MiB segments."""
    if segments == "expandable":
        return _round_up(sum(buffers), LARGE_PAGE_BYTES) if sum(buffers) > 0 else 0
    own = sum(block_bytes(b, segments) for b in buffers if b >= OWN_SEGMENT_BYTES)
    shared = sum(_round_up(b, MIN_BLOCK_BYTES) for b in buffers if 0 < b < OWN_SEGMENT_BYTES)
    return own + _round_up(shared, LARGE_PAGE_BYTES)


def bucket_rounding_bytes(gradient_bytes: int, segments: str) -> int:
    """DDP's flat gradient buckets: about one bucket per 25 MiB of gradients, each rounded like a tensor."""
    if gradient_bytes <= 0:
        return 0
    buckets = -(-gradient_bytes // DDP_BUCKET_BYTES)
    per_bucket = gradient_bytes // buckets
    return buckets * (block_bytes(per_bucket, segments) - per_bucket)


def reserved_bytes(
    spec: DiTSpec,
    allocated_bytes: int,
    persistent_bytes: int,
    *,
    segments: str,
    shards: int = 1,
    persistent_copies: int = 4,
    bucket_bytes: int = 0,
    earlier_working_bytes: int = 0,
    reserved_floor_bytes: int = 0,
    measured_fragmentation: float = 0.0,
    pressure: bool = False,
    pinned: bool = False,
) -> int:
    """Reserved bytes of the caching allocator when the step's tensors hold `allocated_bytes`, of which
    `persistent_bytes` live for the whole run (weights, AdamW states, EMA, VAE weights, DDP buckets).
    `persistent_copies`: parameter-shaped fp32 tensors among them (weights, two AdamW states, the EMA: 4; 3
    without EMA), sharded `shards` ways; `bucket_bytes`: DDP's gradient buckets among them;
    `earlier_working_bytes`: a working set freed earlier in the step (the VAE encoder's), part of which a
    release cannot return; `reserved_floor_bytes`: what the step reserved before this moment, which stays
    reserved unless the cache is released. A `measured_fragmentation` above 0 (reserved / allocated - 1, from
    a calibration) replaces the model. `pressure`: the least the step runs in when the allocator releases its
    cache to fit (never more than the reserved figure with memory to spare). `pinned`: a release cannot bring
    this moment below `reserved_floor_bytes` (a later micro-step's encode under fixed segments: the
    accumulated gradients hold the segments it spoiled, its own maps the rest)."""
    if measured_fragmentation > 0:
        return int(allocated_bytes * (1 + measured_fragmentation))
    transient = max(0, allocated_bytes - persistent_bytes)
    rounding = persistent_copies * parameter_rounding_bytes(spec, 4, shards, segments)
    rounding += bucket_rounding_bytes(bucket_bytes, segments)
    pages = LARGE_PAGE_BYTES + SMALL_PAGE_BYTES if segments == "expandable" else 0
    held = allocated_bytes + rounding + pages
    spare = max(held + TRANSIENT_FRAGMENTATION[segments] * transient, reserved_floor_bytes)
    if not pressure:
        return int(spare)
    encoder_kept = PRESSURE_VAE_MISS[segments] * min(earlier_working_bytes, transient)
    tight = held + PRESSURE_FRAGMENTATION[segments] * transient + encoder_kept
    return int(max(min(spare, tight), reserved_floor_bytes if pinned else 0))


def spoiled_map_bytes(live_bytes: int, map_bytes: int, footprint_bytes: int) -> int:
    """Online latents: the room for the next encode's largest maps (full-resolution 128-channel ones,
    `map_bytes`) that `live_bytes` of tensors made out of the encoder's freed cache take from it. With fixed
    segments each such map has a segment of its own, and one a tensor entered no longer holds a map; in an
    expandable segment the tensors leave holes among the encoder's pages smaller than a map. Packed tightly
    they spoil ceil(live / map) maps' room, and the whole footprint (`footprint_bytes`) at most: a floor of what
    the replays show, whose tensors spread wider (docs/planner-accuracy.md, "Online latents: where the reserved
    peak forms")."""
    if live_bytes <= 0 or map_bytes <= 0:
        return 0
    return int(min(-(-live_bytes // map_bytes) * map_bytes, footprint_bytes))


def accumulating_encode_bytes(gradient_bytes: int, map_bytes: int, working_bytes: int, segments: str) -> int:
    """Online latents under gradient accumulation: the memory beyond the first encode's footprint that the
    gradients (`gradient_bytes`) and the encode of every micro-step after the first need. The first
    micro-step's backward makes the gradients out of the cache the first encode left (it is all the cache
    there is), and they live on through the next encode, which maps the room they spoiled anew
    (`spoiled_map_bytes`; the encoder's working set `working_bytes`); gradients larger than that cache mapped
    their own rest, so never less than their bytes."""
    if gradient_bytes <= 0 or working_bytes <= 0:
        return 0
    footprint = int(ENCODER_FOOTPRINT[segments] * working_bytes)
    return max(gradient_bytes, spoiled_map_bytes(gradient_bytes, map_bytes, footprint))


def online_reserved_bytes(
    *,
    encode_reserved: int,
    working_bytes: int,
    segments: str,
    lazy_states: dict | None = None,
    accumulated_bytes: int = 0,
    later_encode_bytes: int = 0,
) -> int:
    """Online latents: the reserved bytes once the VAE encoder has run, and so at least those of every moment
    after it. `encode_reserved`: the encode moment reserved as `reserved_bytes` gives it, with the encoder's
    working set `working_bytes` among its transient bytes.

    The first encode maps its footprint (ENCODER_FOOTPRINT x its working set, measured on empty caches) on top
    of the persistent tensors. With AdamW's state among them (the trainer makes it before the first step:
    dit_accel.train.optim.create_states; a resumed run loads it there) everything after reuses that cache, growing
    it only where its own figure is larger.

    `lazy_states` (another codebase: the state made inside the first optimizer step) holds that step's
    figures: `dit_reserved` (the DiT's largest moment), `optimizer_allocated`, `optimizer_reserved`, and
    `states_held_bytes` (the state with its block rounding, which the steady-state figures count),
    `states_bytes` (without it) and `map_bytes` (the encoder's largest map). The first step's optimizer then
    makes the states out of the encoder's cache, and the second encode reuses only what that step left over,
    less the room the states spoiled (`spoiled_map_bytes`), and maps the rest of its footprint anew.

    Under gradient accumulation `encode_reserved` counts the accumulated gradients (`accumulated_bytes`), which
    the first micro-step's encode did not have; every later one maps `later_encode_bytes`
    (`accumulating_encode_bytes`) on top of what the first one left."""
    footprint = ENCODER_FOOTPRINT[segments] * working_bytes
    first_encode = encode_reserved - (1 + TRANSIENT_FRAGMENTATION[segments]) * working_bytes + footprint
    # the encode moment counted the gradients as tensors of its own; the later encodes need more
    later_encodes = max(0, later_encode_bytes - (1 + TRANSIENT_FRAGMENTATION[segments]) * accumulated_bytes)
    if lazy_states is None:
        return int(first_encode + later_encodes)
    states = lazy_states["states_held_bytes"]
    first_step = max(first_encode - states, lazy_states["dit_reserved"] - states)
    spoiled = spoiled_map_bytes(lazy_states["states_bytes"], lazy_states["map_bytes"], footprint)
    left_over = min(max(first_step - lazy_states["optimizer_allocated"], 0), footprint - spoiled)
    return int(max(first_step, lazy_states["optimizer_reserved"]) + footprint - left_over + later_encodes)
