"""A model of PyTorch's CUDA caching allocator: a traced step's allocations and frees replayed to its peak
*reserved* bytes (what the allocator holds from the driver, what nvidia-smi shows and an OOM is decided on).

The rules are those of c10/cuda/CUDACachingAllocator.cpp with the default settings (no max_split_size, no
roundup_power2_divisions, no garbage collection threshold):

- every request is rounded up to a multiple of 512 B (`round_request`);
- requests up to 1 MiB come from the small pool, larger ones from the large pool; each pool caches free
  blocks and serves a request from the smallest free block that fits (best fit, ties to the lower address);
- every block and segment belongs to the stream it was allocated on (`malloc(nbytes, stream)`, stream 0 the
  default): a request is served only from free blocks of its own stream (the source orders a pool's free
  blocks by (stream, size, address) and its search stops where the stream differs), and new memory is
  made for that stream, so what one stream caches another cannot reuse (FSDP's all-gather and
  reduce-scatter streams hold their buffers apart from the default stream's);
- a block larger than the request is split, the rest staying free, when the rest is at least 512 B (small
  pool, and every pool with expandable segments) or more than 1 MiB (large pool); otherwise the whole block
  is handed out (torch's "allocated" counts it whole);
- a freed block merges with its free neighbours in the same segment (hence of the same stream);
- fixed segments (the default allocator): when no free block fits, a new segment is cudaMalloc'ed for the
  requesting stream: 2 MiB for a small request, 20 MiB for a request under 10 MiB, otherwise the request
  rounded up to 2 MiB;
- expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, the trainer's default on CUDA):
  one growing virtual segment per stream and pool (the source keys them by stream), backed by physical
  pages mapped on demand, 2 MiB pages for the small pool and 20 MiB for the large one. When no free block
  fits, pages are mapped at the segment's end (merging with a free block there), so reserved is the mapped
  pages. Best fit skips the free block at the segment's end (it can grow) for the next larger free block
  that fits, as the source does: it keeps the growable tail for requests nothing else takes. Holes in the
  middle still fragment, but far less;
- memory pressure (`limit_bytes`, the GPU's memory for the allocator): when new memory would pass the
  limit, the allocator first releases what it caches unused on every stream (fixed: every free block that
  is a whole segment; expandable: every page wholly inside a free block), then retries once; past the limit
  still, the request is out of memory (`OutOfMemory`). Without a limit memory never runs out and nothing is
  released, so `reserved_peak_bytes` is what a GPU with room to spare shows; `least_reserved` finds the
  smallest limit the step runs under (what a nearly full GPU needs), and `reclaimable_at_peak_bytes` says
  what a release could have returned at the unbounded peak.

Not modelled: record_stream and frees from another stream (a block used on a second stream goes back to
the pool only once that stream's events complete: here a free returns it at once), CUDA graphs' private
pools, cuBLAS's workspaces (allocated through the allocator, but by no traced tensor) and allocations
outside PyTorch (CUDA context, NCCL), a release's order of segments (all are
released at once). The tracker records one stream, so a traced step replays on the default stream alone.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
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


class OutOfMemory(RuntimeError):
    """A request that does not fit under the limit even after the allocator released its cache."""


class _NeedsMemory(Exception):
    """Internal: new memory would pass the limit (nothing was changed)."""


class _Block:
    __slots__ = ("address", "size", "free", "prev", "next", "small", "stream", "reclaim")

    def __init__(self, address: int, size: int, small: bool, stream: int):
        self.address, self.size, self.free, self.small, self.stream = address, size, True, small, stream
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.reclaim = 0  # while free: the bytes a release would return from it

    @property
    def pool(self) -> tuple[int, bool]:
        return self.stream, self.small


@dataclass(frozen=True)
class AllocatorPeaks:
    """The replayed step: peaks of what the program asked for, of what the allocator handed out (torch's
    max_memory_allocated: whole blocks) and of what it held (max_memory_reserved); what a release could
    have returned at that reserved peak; the releases a limit forced (each a device synchronisation)."""

    requested_peak_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    segments: int  # cudaMallocs (fixed) or page mappings (expandable) made
    reclaimable_at_peak_bytes: int = 0
    releases: int = 0

    @property
    def fragmentation(self) -> float:
        """Reserved beyond the requested peak, as a fraction of it."""
        return self.reserved_peak_bytes / self.requested_peak_bytes - 1 if self.requested_peak_bytes else 0.0


Pool = tuple[int, bool]  # (stream, small): a stream's small or large pool


class CachingAllocator:
    """The allocator's state: `malloc(nbytes, stream)` returns a handle, `free(handle)` returns its block to
    its stream's pool. With `limit_bytes`, reserved never passes it: the cache is released and the request
    retried, else `OutOfMemory`."""

    def __init__(self, expandable_segments: bool = False, limit_bytes: int | None = None):
        self.expandable = expandable_segments
        self.limit_bytes = limit_bytes
        self._free: dict[Pool, list[tuple[int, int, _Block]]] = defaultdict(list)  # sorted (size, addr)
        self._live: dict[int, tuple[_Block, int]] = {}  # handle -> (block, requested bytes)
        self._next_handle = 0
        self._next_address = 0
        self._tail: dict[Pool, int] = defaultdict(int)  # expandable: virtual bytes of each pool's segment
        self._base: dict[Pool, int] = {}  # expandable: each pool's segment start address
        self._last: dict[Pool, _Block | None] = defaultdict(lambda: None)  # expandable: the block at the end
        self._mapped: dict[Pool, set[int]] = defaultdict(set)  # expandable: mapped page indices
        self.requested = self.allocated = self.reserved = 0
        self.reserved_by_stream: dict[int, int] = defaultdict(int)  # what each stream's segments hold
        self.requested_peak = self.allocated_peak = self.reserved_peak = 0
        self.reclaimable = 0  # what `release_cached` would return now
        self.reclaimable_at_peak = 0
        self.segments = self.releases = 0

    # --- free-block index ------------------------------------------------------------------------------
    def _insert_free(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self._free[block.pool], (block.size, block.address, block))
        block.reclaim = self._reclaim_of(block)
        self.reclaimable += block.reclaim

    def _remove_free(self, block: _Block) -> None:
        entries = self._free[block.pool]
        index = bisect.bisect_left(entries, (block.size, block.address))
        assert entries[index][2] is block
        del entries[index]
        block.free = False
        self.reclaimable -= block.reclaim
        block.reclaim = 0

    def _best_fit(self, pool: Pool, size: int) -> _Block | None:
        entries = self._free[pool]
        index = bisect.bisect_left(entries, (size, -1))
        if index >= len(entries):
            return None
        block = entries[index][2]
        if self.expandable and block is self._last[pool] and index + 1 < len(entries):
            return entries[index + 1][2]  # the growable tail is kept for what nothing else fits
        return block

    # --- pages (expandable segments) -------------------------------------------------------------------------
    def _page_range(self, pool: Pool, start: int, end: int, inside: bool) -> range:
        """Page indices covering [start, end) (inside=False) or lying wholly inside it (inside=True)."""
        page, base = PAGE_BYTES[pool[1]], self._base[pool]
        if inside:
            return range(-(-(start - base) // page), (end - base) // page)
        return range((start - base) // page, -(-(end - base) // page))

    def _reclaim_of(self, block: _Block) -> int:
        if not self.expandable:
            return block.size if block.prev is None and block.next is None else 0  # a whole segment
        mapped = self._mapped[block.pool]
        pages = self._page_range(block.pool, block.address, block.address + block.size, inside=True)
        return PAGE_BYTES[block.small] * sum(1 for page in pages if page in mapped)

    def _missing_pages(self, pool: Pool, start: int, size: int) -> list[int]:
        mapped = self._mapped[pool]
        return [
            page for page in self._page_range(pool, start, start + size, inside=False) if page not in mapped
        ]

    def _check_limit(self, new_bytes: int) -> None:
        if self.limit_bytes is not None and self.reserved + new_bytes > self.limit_bytes:
            raise _NeedsMemory

    def _reserve(self, stream: int, nbytes: int) -> None:
        self.reserved += nbytes
        self.reserved_by_stream[stream] += nbytes

    # --- new memory --------------------------------------------------------------------------------------
    def _new_segment(self, pool: Pool, size: int) -> _Block:
        """A cudaMalloc for the requesting stream: the segment and every block split from it are that
        stream's."""
        nbytes = segment_bytes(size)
        self._check_limit(nbytes)
        block = _Block(self._next_address, nbytes, pool[1], pool[0])
        self._next_address += nbytes
        self._reserve(pool[0], nbytes)
        self.segments += 1
        return block

    def _expandable_block(self, pool: Pool, size: int) -> _Block:
        """Expandable segments: the best-fit free block, else the stream's segment grown at its end (merged
        with a free block there); the pages under the request are mapped, within the limit."""
        stream, small = pool
        if pool not in self._base:
            self._base[pool] = self._next_address
            self._next_address += 1 << 50  # each segment's virtual range is far from the others'
        block = self._best_fit(pool, size)
        last = self._last[pool]
        reuse = last if block is None and last is not None and last.free else None
        if block is not None:
            start = block.address
        else:
            start = reuse.address if reuse is not None else self._base[pool] + self._tail[pool]
        missing = self._missing_pages(pool, start, size)
        self._check_limit(len(missing) * PAGE_BYTES[small])
        if block is not None:
            self._remove_free(block)
        else:
            have = reuse.size if reuse is not None else 0
            grown = round_up(size - have, PAGE_BYTES[small])
            self._tail[pool] += grown
            if reuse is not None:
                self._remove_free(reuse)
                reuse.size += grown
                block = reuse
            else:
                block = _Block(start, grown, small, stream)
                block.prev = last
                if last is not None:
                    last.next = block
                self._last[pool] = block
        self._mapped[pool].update(missing)
        self._reserve(stream, len(missing) * PAGE_BYTES[small])
        self.segments += len(missing) > 0
        return block

    def release_cached(self) -> int:
        """Return what the cache holds unused to the driver, every stream's (fixed: free whole segments;
        expandable: the pages wholly inside free blocks); the bytes released."""
        released = 0
        for pool, entries in self._free.items():
            for _, _, block in [entry for entry in entries if entry[2].reclaim]:
                released += block.reclaim
                self._reserve(block.stream, -block.reclaim)
                if self.expandable:
                    pages = self._page_range(pool, block.address, block.address + block.size, inside=True)
                    self._mapped[pool].difference_update(pages)
                    self.reclaimable -= block.reclaim
                    block.reclaim = 0
                else:
                    self._remove_free(block)  # the segment goes back to the driver
        return released

    # --- the two calls -------------------------------------------------------------------------------------
    def _take(self, pool: Pool, size: int) -> _Block:
        if self.expandable:
            return self._expandable_block(pool, size)
        block = self._best_fit(pool, size)
        if block is None:
            return self._new_segment(pool, size)
        self._remove_free(block)
        return block

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """A request on `stream` (0: the default stream), served from that stream's pools only."""
        size = round_request(nbytes)
        small = is_small(size)
        pool = (stream, small)
        try:
            block = self._take(pool, size)
        except _NeedsMemory:
            self.release_cached()
            self.releases += 1
            try:
                block = self._take(pool, size)
            except _NeedsMemory:
                raise OutOfMemory(
                    f"{size} B past the limit of {self.limit_bytes} B ({self.reserved} B reserved)"
                ) from None
        rest = block.size - size
        if small or self.expandable:
            split = rest >= MIN_BLOCK_BYTES
        else:
            split = rest > SMALL_REQUEST_BYTES  # a large block keeps a remainder of up to 1 MiB attached
        if split:
            remainder = _Block(block.address + size, rest, small, stream)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            if self._last[pool] is block:
                self._last[pool] = remainder
            self._insert_free(remainder)
        block.free = False
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = (block, nbytes)
        self.requested += nbytes
        self.allocated += block.size
        self.requested_peak = max(self.requested_peak, self.requested)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        if self.reserved > self.reserved_peak:
            self.reserved_peak, self.reclaimable_at_peak = self.reserved, self.reclaimable
        return handle

    def free(self, handle: int) -> None:
        """The block goes back to its own stream's pool, merged with free neighbours of its segment."""
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
                    if self._last[block.pool] is neighbour:
                        self._last[block.pool] = block
                block.size += neighbour.size
        self._insert_free(block)

    def peaks(self) -> AllocatorPeaks:
        return AllocatorPeaks(
            self.requested_peak,
            self.allocated_peak,
            self.reserved_peak,
            self.segments,
            self.reclaimable_at_peak,
            self.releases,
        )


def replay(events, expandable_segments: bool = False, limit_bytes: int | None = None) -> AllocatorPeaks:
    """Replay `events`, each (key, nbytes) for an allocation (nbytes >= 0) on the default stream, (key,
    nbytes, stream) for one on `stream`, or (key, None) for the free of the allocation made under `key`
    (a block goes back to the stream it came from, so a free needs no stream; one given is ignored), and
    return the peaks. A zero-byte request allocates nothing (as on CUDA); a free of an unknown key (a
    storage that existed before the trace) is ignored. Under `limit_bytes` a request that cannot fit after
    a release raises `OutOfMemory`."""
    allocator = CachingAllocator(expandable_segments, limit_bytes)
    for _ in replay_steps(allocator, events):
        pass
    return allocator.peaks()


def replay_steps(allocator: CachingAllocator, events):
    """Apply `events` (as `replay` takes them) to `allocator` one by one, yielding it after each: what reads
    the allocator's state along the step (benchmarks/online_reserved_timeline.py) and `replay` share it."""
    handles: dict = {}
    for key, nbytes, *stream in events:
        if nbytes is None:
            handle = handles.pop(key, None)
            if handle is not None:
                allocator.free(handle)
        elif nbytes > 0:
            handles[key] = allocator.malloc(nbytes, *stream)
        yield allocator


def least_reserved(events, expandable_segments: bool = False, resolution_bytes: int = 2 << 20) -> int:
    """The smallest limit (to `resolution_bytes`) the step runs under with release-and-retry: the reserved
    memory a nearly full GPU needs for it. Between the allocated peak (nothing less can work) and the
    unbounded reserved peak (always works), by bisection."""
    events = list(events)
    unbounded = replay(events, expandable_segments)
    low, high = unbounded.allocated_peak_bytes - 1, unbounded.reserved_peak_bytes  # low fails, high runs
    while high - low > resolution_bytes:
        middle = (low + high) // 2
        try:
            replay(events, expandable_segments, limit_bytes=middle)
            high = middle
        except OutOfMemory:
            low = middle
    return high


def replay_both(events) -> dict[str, AllocatorPeaks]:
    """The same events through both allocator modes: {"fixed": ..., "expandable": ...}."""
    events = list(events)
    return {mode: replay(events, expandable_segments=mode == "expandable") for mode in MODES}
