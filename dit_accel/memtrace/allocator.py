"""A model of PyTorch's CUDA caching allocator: a traced step's allocations and frees replayed to its peak
*reserved* bytes (what the allocator holds from the driver, what nvidia-smi shows and an OOM is decided on).

The rules are those of c10/cuda/CUDACachingAllocator.cpp with the default settings (no max_split_size, no
roundup_power2_divisions, no garbage collection threshold), one stream, and memory that never runs out:

- every request is rounded up to a multiple of 512 B (`round_request`);
- requests up to 1 MiB come from the small pool, larger ones from the large pool; each pool caches free
  blocks and serves a request from the smallest free block that fits (best fit, ties to the lower address);
- a block larger than the request is split, the rest staying free, when the rest is at least 512 B (small
  pool, and every pool with expandable segments) or more than 1 MiB (large pool); otherwise the whole block
  is handed out (torch's "allocated" counts it whole);
- a freed block merges with its free neighbours in the same segment;
- fixed segments (the default allocator): when no free block fits, a new segment is cudaMalloc'ed: 2 MiB
  for a small request, 20 MiB for a request under 10 MiB, otherwise the request rounded up to 2 MiB.
  Segments are never released: empty_cache is not called during training, and with unbounded memory the
  allocator never needs to free cached segments to retry (on a full GPU it would, so a replay's reserved
  peak is what the step asks for, an upper bound on what a nearly full GPU ends up holding);
- expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, the trainer's default on CUDA):
  one growing virtual segment per pool, backed by physical pages mapped on demand, 2 MiB pages for the
  small pool and 20 MiB for the large one. When no free block fits, pages are mapped at the segment's end
  (merging with a free block there), so reserved is the peak of the mapped pages: the highest address the
  step ever needed, rounded to a page. Holes in the middle still fragment, but far less.

Not modelled: several streams (NCCL's, record_stream), CUDA graphs' private pools, the expandable search's
preference for a block that can grow, allocations outside PyTorch (CUDA context, cuBLAS, NCCL).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20  # the largest small-pool request: 1 MiB
SMALL_SEGMENT_BYTES = 2 << 20  # small requests are packed into 2 MiB segments
LARGE_SEGMENT_BYTES = 20 << 20  # requests of 1-10 MiB share 20 MiB segments
MIN_OWN_SEGMENT_BYTES = 10 << 20  # requests from 10 MiB get a segment of their own
SEGMENT_ROUNDING_BYTES = 2 << 20  # ... rounded up to 2 MiB
PAGE_BYTES = {True: SMALL_SEGMENT_BYTES, False: LARGE_SEGMENT_BYTES}  # expandable pages: small, large pool
MODES = ("fixed", "expandable")


def round_request(nbytes: int) -> int:
    """A request as the allocator sizes it: at least 512 B, rounded up to a multiple of 512 B."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def is_small(size: int) -> bool:
    return size <= SMALL_REQUEST_BYTES


def segment_bytes(size: int) -> int:
    """The cudaMalloc a fixed-segment allocator makes for a (rounded) request no free block can serve."""
    if is_small(size):
        return SMALL_SEGMENT_BYTES
    if size < MIN_OWN_SEGMENT_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // SEGMENT_ROUNDING_BYTES) * SEGMENT_ROUNDING_BYTES


def round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


class _Block:
    __slots__ = ("address", "size", "free", "prev", "next", "small")

    def __init__(self, address: int, size: int, small: bool):
        self.address, self.size, self.free, self.small = address, size, True, small
        self.prev: _Block | None = None
        self.next: _Block | None = None


@dataclass(frozen=True)
class AllocatorPeaks:
    """The replayed step: peaks of what the program asked for, of what the allocator handed out (torch's
    max_memory_allocated: whole blocks) and of what it held (max_memory_reserved)."""

    requested_peak_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    segments: int  # cudaMallocs (fixed) or page mappings (expandable) made

    @property
    def fragmentation(self) -> float:
        """Reserved beyond the requested peak, as a fraction of it."""
        return self.reserved_peak_bytes / self.requested_peak_bytes - 1 if self.requested_peak_bytes else 0.0


class CachingAllocator:
    """The allocator's state: `malloc(nbytes)` returns a handle, `free(handle)` returns its block."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}  # sorted (size, addr)
        self._live: dict[int, tuple[_Block, int]] = {}  # handle -> (block, requested bytes)
        self._next_handle = 0
        self._next_address = 0
        self._tail: dict[bool, int] = {True: 0, False: 0}  # expandable: mapped bytes of each pool's segment
        self._base: dict[bool, int] = {}  # expandable: each pool's segment start address
        self._last: dict[bool, _Block | None] = {True: None, False: None}  # expandable: the block at the end
        self.requested = self.allocated = self.reserved = 0
        self.requested_peak = self.allocated_peak = self.reserved_peak = 0
        self.segments = 0

    # --- free-block index ------------------------------------------------------------------------------
    def _insert_free(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self._free[block.small], (block.size, block.address, block))

    def _remove_free(self, block: _Block) -> None:
        entries = self._free[block.small]
        index = bisect.bisect_left(entries, (block.size, block.address))
        assert entries[index][2] is block
        del entries[index]
        block.free = False

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        entries = self._free[small]
        index = bisect.bisect_left(entries, (size, -1))
        return entries[index][2] if index < len(entries) else None

    # --- new memory --------------------------------------------------------------------------------------
    def _new_segment(self, small: bool, size: int) -> _Block:
        nbytes = segment_bytes(size)
        block = _Block(self._next_address, nbytes, small)
        self._next_address += nbytes
        self.reserved += nbytes
        self.segments += 1
        return block

    def _grow(self, small: bool, size: int) -> _Block:
        """Expandable segments: map pages at the pool's segment end, merged with a free block there."""
        if small not in self._base:
            self._base[small] = self._next_address
            self._next_address += 1 << 50  # each pool's virtual range is far from the other's
        last = self._last[small]
        reuse = last if last is not None and last.free else None
        have = reuse.size if reuse is not None else 0
        mapped = round_up(size - have, PAGE_BYTES[small])
        self._tail[small] += mapped
        self.reserved += mapped
        self.segments += 1
        if reuse is not None:
            self._remove_free(reuse)
            reuse.size += mapped
            return reuse
        block = _Block(self._base[small] + self._tail[small] - mapped, mapped, small)
        block.prev = last
        if last is not None:
            last.next = block
        self._last[small] = block
        return block

    # --- the two calls -------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        size = round_request(nbytes)
        small = is_small(size)
        block = self._best_fit(small, size)
        if block is not None:
            self._remove_free(block)
        elif self.expandable:
            block = self._grow(small, size)
        else:
            block = self._new_segment(small, size)
        rest = block.size - size
        if small or self.expandable:
            split = rest >= MIN_BLOCK_BYTES
        else:
            split = rest > SMALL_REQUEST_BYTES  # a large block keeps a remainder of up to 1 MiB attached
        if split:
            remainder = _Block(block.address + size, rest, small)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            if self._last[small] is block:
                self._last[small] = remainder
            self._insert_free(remainder)
        block.free = False
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = (block, nbytes)
        self.requested += nbytes
        self.allocated += block.size
        self.requested_peak = max(self.requested_peak, self.requested)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        return handle

    def free(self, handle: int) -> None:
        block, nbytes = self._live.pop(handle)
        self.requested -= nbytes
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                    if self._last[block.small] is neighbour:
                        self._last[block.small] = block
                block.size += neighbour.size
        self._insert_free(block)

    def peaks(self) -> AllocatorPeaks:
        return AllocatorPeaks(self.requested_peak, self.allocated_peak, self.reserved_peak, self.segments)


def replay(events, expandable_segments: bool = False) -> AllocatorPeaks:
    """Replay `events`, each (key, nbytes) for an allocation (nbytes >= 0) or (key, None) for the free of
    the allocation made under `key`, and return the peaks. A zero-byte request allocates nothing (as on
    CUDA); a free of an unknown key (a storage that existed before the trace) is ignored."""
    allocator = CachingAllocator(expandable_segments)
    handles: dict = {}
    for key, nbytes in events:
        if nbytes is None:
            handle = handles.pop(key, None)
            if handle is not None:
                allocator.free(handle)
        elif nbytes > 0:
            handles[key] = allocator.malloc(nbytes)
    return allocator.peaks()


def replay_both(events) -> dict[str, AllocatorPeaks]:
    """The same events through both allocator modes: {"fixed": ..., "expandable": ...}."""
    events = list(events)
    return {mode: replay(events, expandable_segments=mode == "expandable") for mode in MODES}
