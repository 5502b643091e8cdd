"""Reserved bytes: what PyTorch's CUDA caching allocator holds for the step's tensors, from their allocated
bytes. A GPU runs out of reserved memory (nvidia-smi shows it, an OOM is decided on it), not allocated.

    reserved = allocated + rounding + fragmentation x transient + page rounding

rounding       the persistent tensors, one per parameter (fp32 master weights, AdamW's two states, the
               EMA, the VAE's weights), each held in whole allocator blocks: with fixed segments a tensor of
               10 MiB or more gets its own segment, rounded up to 2 MiB; with expandable segments only the
               512 B rounding of every request remains. DDP's gradient buckets (25 MiB each) round the same.
transient      what the step allocates and frees again (activations, autocast's weight copies, gradients,
               temporaries, the VAE encoder's working set): the cached blocks they leave behind do not always
               fit the next requests, so the allocator holds more than they need at once. The fraction is
               calibrated against the verify grid's traced steps replayed through a model of the allocator
               (dit_accel/memtrace/allocator.py; benchmarks/reserved_replay.py; docs/planner-accuracy.md).
page rounding  expandable segments map 20 MiB pages (large pool) and 2 MiB pages (small pool).
earlier working set  online latents: the VAE encoder's maps are freed before the DiT forward, and the
               DiT's tensors fit the blocks they leave only in part: a share of the smaller of the two stays
               reserved beside the DiT's own peak.

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
OWN_SEGMENT_BYTES = 10 * MiB  # fixed segments: requests from 10 MiB get a segment of their own ...
SEGMENT_ROUNDING_BYTES = 2 * MiB  # ... rounded up to 2 MiB
LARGE_PAGE_BYTES = 20 * MiB  # expandable segments: the large pool's page
SMALL_PAGE_BYTES = 2 * MiB  # and the small pool's
DDP_BUCKET_BYTES = 25 * MiB  # torch DDP's bucket_cap_mb default
SEGMENT_MODES = ("expandable", "fixed")
# reserved beyond allocated per transient byte, calibrated on the replayed verify grid (the largest seen there,
# rounded up; docs/planner-accuracy.md, "The reserved model")
TRANSIENT_FRAGMENTATION = {"fixed": 0.20, "expandable": 0.03}
# online latents: of the VAE encoder's working set (freed before the DiT forward), the share the DiT's own
# transient tensors cannot reuse (they fit its cached blocks badly), calibrated the same way
VAE_REUSE_MISS = {"fixed": 1.5, "expandable": 0.7}


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def block_bytes(nbytes: int, segments: str) -> int:
    """The bytes one tensor of `nbytes`, allocated once and kept, holds in the allocator."""
    size = _round_up(max(nbytes, 1), MIN_BLOCK_BYTES)
    if segments == "fixed" and size >= OWN_SEGMENT_BYTES:
        return _round_up(size, SEGMENT_ROUNDING_BYTES)
    return size


def parameter_elements(spec: DiTSpec) -> list[int]:
    """The element count of every trainable parameter tensor of the tied-embedder DiT (they sum to
    `spec.params_trainable`)."""
    d, p, h = spec.hidden, spec.patch, spec.mlp_hidden
    outer = [
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
    block = [6 * d * d, 6 * d] + [d * d, d] * 4 + [h * d, h, d * h, d]
    return outer + spec.depth * block


@functools.lru_cache(maxsize=256)  # the search asks it for every candidate and phase of one model
def parameter_rounding_bytes(spec: DiTSpec, element_bytes: int, shards: int, segments: str) -> int:
    """What one copy of the parameters (fp32 weights, a state, the EMA), sharded `shards` ways, holds beyond
    its bytes."""
    sizes = [-(-n // shards) * element_bytes for n in parameter_elements(spec)]
    return sum(block_bytes(size, segments) - size for size in sizes)


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
    measured_fragmentation: float = 0.0,
) -> int:
    """Reserved bytes of the caching allocator when the step's tensors hold `allocated_bytes`, of which
    `persistent_bytes` live for the whole run (weights, AdamW states, EMA, VAE weights, DDP buckets).
    `persistent_copies`: parameter-shaped fp32 tensors among them (weights, two AdamW states, the EMA: 4; 3
    without EMA), sharded `shards` ways; `bucket_bytes`: DDP's gradient buckets among them;
    `earlier_working_bytes`: a working set freed earlier in the step (the VAE encoder's). A
    `measured_fragmentation` above 0 (reserved / allocated - 1, from a calibration) replaces the model."""
    if measured_fragmentation > 0:
        return int(allocated_bytes * (1 + measured_fragmentation))
    transient = max(0, allocated_bytes - persistent_bytes)
    rounding = persistent_copies * parameter_rounding_bytes(spec, 4, shards, segments)
    rounding += bucket_rounding_bytes(bucket_bytes, segments)
    pages = LARGE_PAGE_BYTES + SMALL_PAGE_BYTES if segments == "expandable" else 0
    fragmentation = TRANSIENT_FRAGMENTATION[segments] * transient
    fragmentation += VAE_REUSE_MISS[segments] * min(earlier_working_bytes, transient)
    return int(allocated_bytes + rounding + fragmentation + pages)
