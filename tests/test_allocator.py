"""The caching-allocator model (dit_accel/memtrace/allocator.py) against cases worked by hand from the rules
of c10/cuda/CUDACachingAllocator.cpp, and the planner's analytic reserved model against it."""

from __future__ import annotations

import pytest

from dit_accel.memtrace.allocator import (
    CachingAllocator,
    OutOfMemory,
    least_reserved,
    replay,
    replay_both,
    round_request,
    segment_bytes,
)

MiB = 1 << 20


def test_requests_round_up_to_512_bytes():
    assert [round_request(n) for n in (1, 511, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]
    allocator = CachingAllocator()
    allocator.malloc(1000)
    peaks = allocator.peaks()
    assert (peaks.requested_peak_bytes, peaks.allocated_peak_bytes) == (1000, 1024)


def test_segment_sizes_of_the_two_pools():
    assert segment_bytes(512) == segment_bytes(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_bytes(MiB + 512) == segment_bytes(10 * MiB - 512) == 20 * MiB  # 1-10 MiB: 20 MiB
    assert segment_bytes(10 * MiB) == 10 * MiB and segment_bytes(11 * MiB + 1) == 12 * MiB  # own, 2 MiB


def test_small_and_large_pools_do_not_share_segments():
    allocator = CachingAllocator()
    allocator.malloc(1000)  # small pool: a 2 MiB segment, the rest split off and cached
    allocator.malloc(MiB)  # still small: fits the 2 MiB segment's free rest
    assert allocator.reserved == 2 * MiB
    allocator.malloc(MiB + 1)  # large pool: never from the small segment, a new 20 MiB one
    assert allocator.reserved == 22 * MiB and allocator.segments == 2


def test_a_large_block_is_split_only_for_a_remainder_over_1_mib():
    allocator = CachingAllocator()
    allocator.malloc(5 * MiB)  # a 20 MiB segment: 15 MiB split off
    allocator.malloc(15 * MiB)  # exactly the cached rest: no new segment
    assert (allocator.reserved, allocator.segments) == (20 * MiB, 1)
    allocator.malloc(int(11.5 * MiB))  # own segment of 12 MiB; the 0.5 MiB rest stays with the block
    assert allocator.reserved == 32 * MiB
    assert allocator.allocated == 5 * MiB + 15 * MiB + 12 * MiB  # torch counts the whole block


def test_freed_neighbours_coalesce():
    allocator = CachingAllocator()
    a, b = allocator.malloc(5 * MiB), allocator.malloc(5 * MiB)  # [a 5][b 5][free 10] in one segment
    allocator.free(a)
    allocator.free(b)  # one free 20 MiB block again
    allocator.malloc(18 * MiB)  # fits it (a new segment would be 18 MiB)
    assert (allocator.reserved, allocator.segments) == (20 * MiB, 1)


def test_best_fit_takes_the_smallest_block_that_fits():
    allocator = CachingAllocator()
    big, small = allocator.malloc(40 * MiB), allocator.malloc(12 * MiB)
    allocator.free(big)
    allocator.free(small)
    allocator.malloc(12 * MiB)  # the 12 MiB block, not a split of the 40 MiB one
    allocator.malloc(40 * MiB)
    assert allocator.reserved == 52 * MiB and allocator.segments == 2


def test_fragmentation_reserved_exceeds_allocated():
    # two 100 MiB tensors freed, then a 210 MiB one: neither cached segment fits it
    events = [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("b", None), ("c", 210 * MiB)]
    fixed = replay(events)
    assert fixed.requested_peak_bytes == 210 * MiB
    assert fixed.reserved_peak_bytes == 410 * MiB  # 100 + 100 cached + 210 new
    assert fixed.fragmentation == pytest.approx(200 / 210)


def test_expandable_segments_grow_in_place():
    events = [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("b", None), ("c", 210 * MiB)]
    peaks = replay_both(events)
    # one virtual segment: the freed 200 MiB merge at its end, 20 MiB more pages are mapped for c
    assert peaks["expandable"].reserved_peak_bytes == 220 * MiB
    assert peaks["fixed"].reserved_peak_bytes == 410 * MiB


def test_expandable_segments_map_20_mib_pages_for_the_large_pool_and_2_mib_for_the_small():
    peaks = replay([("x", 3 * MiB), ("y", 1000)], expandable_segments=True)
    assert peaks.reserved_peak_bytes == 20 * MiB + 2 * MiB


def test_expandable_segments_still_fragment_around_a_live_block():
    # a hole below a live block cannot take a larger request: it is mapped past the live block
    events = [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("c", 110 * MiB)]
    assert replay(events, expandable_segments=True).reserved_peak_bytes == 320 * MiB
    assert replay(events).reserved_peak_bytes == 310 * MiB


def test_zero_byte_requests_and_unknown_frees_allocate_nothing():
    peaks = replay([("empty", 0), ("empty", None), ("before the trace", None)])
    assert (peaks.requested_peak_bytes, peaks.reserved_peak_bytes) == (0, 0)


def test_expandable_best_fit_keeps_the_growable_tail():
    """x 30 MiB maps 2 pages (40 MiB); y 12 MiB grows the tail block [30, 40) by a page: y at [30, 42), the
    tail [42, 60) free. Freeing x leaves a 30 MiB hole. z 15 MiB fits the tail (18) best, but the source skips
    the growable tail for the next block that fits: z goes to the hole [0, 15). w 25 MiB then fits neither the
    hole's rest (15) nor the tail (18): the tail grows by 20 MiB, reserved 80 MiB (60 if z had taken the tail)."""
    allocator = CachingAllocator(expandable_segments=True)
    x = allocator.malloc(30 * MiB)
    allocator.malloc(12 * MiB)
    assert allocator.reserved == 60 * MiB
    allocator.free(x)
    allocator.malloc(15 * MiB)
    assert allocator.reserved == 60 * MiB
    allocator.malloc(25 * MiB)
    assert allocator.reserved == 80 * MiB


# --- memory pressure: release the cache and retry -----------------------------------------------------------

PRESSURE = [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("b", None), ("c", 210 * MiB)]


def test_fixed_segments_release_whole_free_segments_and_retry():
    """a and b are segments of their own (100 MiB each), both free when c (210 MiB) comes: unbounded, c is a
    new segment beside them (410 MiB, 200 of it reclaimable at that peak). Under a 300 MiB limit the new
    segment would pass it, so both free segments go back to the driver and c is cudaMalloc'ed: reserved 210."""
    unbounded = replay(PRESSURE)
    assert (unbounded.reserved_peak_bytes, unbounded.reclaimable_at_peak_bytes) == (410 * MiB, 200 * MiB)
    assert unbounded.releases == 0
    tight = replay(PRESSURE, limit_bytes=300 * MiB)
    assert (tight.reserved_peak_bytes, tight.releases) == (210 * MiB, 1)
    with pytest.raises(OutOfMemory):
        replay(PRESSURE, limit_bytes=209 * MiB)  # 210 MiB cannot fit even with nothing cached


def test_a_split_segment_is_not_released():
    """x and y (5 MiB each) share a 20 MiB segment; with x freed the segment still holds y, so a release
    returns nothing: a 30 MiB request needs 20 + 30 = 50 MiB, out of memory under 40, fine under 50."""
    events = [("x", 5 * MiB), ("y", 5 * MiB), ("x", None), ("z", 30 * MiB)]
    with pytest.raises(OutOfMemory):
        replay(events, limit_bytes=40 * MiB)
    assert replay(events, limit_bytes=50 * MiB).reserved_peak_bytes == 50 * MiB
    assert replay(events).reclaimable_at_peak_bytes == 0


def test_expandable_segments_unmap_the_pages_inside_free_blocks():
    """a, b 100 MiB each map 10 pages; a freed leaves a 100 MiB hole (5 pages wholly inside it); c 110 MiB
    does not fit the hole and grows the segment by 6 pages: 320 MiB unbounded, 100 reclaimable. Under 240 MiB
    the hole's 5 pages are unmapped first (reserved 100), then c maps its 6: 220 MiB."""
    events = [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("c", 110 * MiB)]
    unbounded = replay(events, expandable_segments=True)
    assert (unbounded.reserved_peak_bytes, unbounded.reclaimable_at_peak_bytes) == (320 * MiB, 100 * MiB)
    tight = replay(events, expandable_segments=True, limit_bytes=240 * MiB)
    assert (tight.reserved_peak_bytes, tight.releases) == (220 * MiB, 1)


def test_expandable_pages_unmapped_by_a_release_are_mapped_again_on_use():
    """After the release above the hole [0, 100) is unmapped; d 60 MiB fits it and maps its 3 pages again:
    220 + 60 = 280 MiB, under a 300 MiB limit (a release then finds nothing more to unmap)."""
    events = [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("c", 110 * MiB), ("d", 60 * MiB)]
    peaks = replay(events, expandable_segments=True, limit_bytes=300 * MiB)
    assert (peaks.reserved_peak_bytes, peaks.releases) == (280 * MiB, 1)


def test_least_reserved_is_the_smallest_limit_the_step_runs_under():
    """The pressure case runs under any limit from 210 MiB (its allocated peak) and not below: the
    bisection finds 210 MiB to its 2 MiB resolution, far under the unbounded 410."""
    assert 210 * MiB <= least_reserved(PRESSURE) < 212 * MiB
    assert (
        220 * MiB
        <= least_reserved(
            [("a", 100 * MiB), ("b", 100 * MiB), ("a", None), ("c", 110 * MiB)], expandable_segments=True
        )
        < 222 * MiB
    )  # b's 100 MiB and c's 6 pages: the hole is unmapped


# --- per-stream pools ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("expandable, segment", [(False, 30 * MiB), (True, 40 * MiB)])
def test_a_block_freed_on_a_side_stream_is_reused_only_by_that_stream(expandable, segment):
    """30 MiB on stream 1 is its own 30 MiB segment (expandable: two 20 MiB pages of stream 1's segment);
    freed, it stays in stream 1's pool, so the same 30 MiB on stream 0 makes new memory for stream 0 (one
    stream: it would reuse it, reserved staying at one segment). A second request on stream 1 reuses it."""
    allocator = CachingAllocator(expandable_segments=expandable)
    allocator.free(allocator.malloc(30 * MiB, stream=1))
    assert allocator.reserved == segment
    allocator.malloc(30 * MiB)
    assert allocator.reserved == 2 * segment and allocator.segments == 2
    allocator.malloc(30 * MiB, stream=1)
    assert allocator.reserved == 2 * segment and allocator.segments == 2
    assert dict(allocator.reserved_by_stream) == {0: segment, 1: segment}


@pytest.mark.parametrize("expandable, after, one_stream", [(False, 70, 50), (True, 60, 40)])
def test_two_streams_free_neighbours_never_merge(expandable, after, one_stream):
    """x (stream 0) and y (stream 1), 5 MiB each, never share a segment: two 20 MiB segments (expandable:
    one page in each stream's own segment), 40 MiB where one stream packs both into one 20 MiB segment. Both
    freed, each is a free 20 MiB block of its own, a release would return both. A 30 MiB request on stream 0
    fits neither: fixed, a new 30 MiB segment (70); expandable, stream 0's segment grows its free 20 MiB by
    a page (60). One stream merges x and y into one free 20 MiB block: 20 + 30 = 50 fixed, 40 expandable."""
    allocator = CachingAllocator(expandable_segments=expandable)
    x, y = allocator.malloc(5 * MiB), allocator.malloc(5 * MiB, stream=1)
    assert allocator.reserved == 40 * MiB
    allocator.free(x)
    allocator.free(y)
    assert allocator.reclaimable == 40 * MiB  # two free blocks of 20 MiB, one per stream
    allocator.malloc(30 * MiB)
    assert allocator.reserved == after * MiB
    assert allocator.reserved_by_stream[1] == 20 * MiB
    events = [("x", 5 * MiB), ("y", 5 * MiB), ("x", None), ("y", None), ("z", 30 * MiB)]
    assert replay(events, expandable).reserved_peak_bytes == one_stream * MiB


SIDE_STREAM_PRESSURE = [("a", 60 * MiB), ("g", 100 * MiB, 1), ("g", None), ("x", 120 * MiB)]


@pytest.mark.parametrize("expandable", [False, True])
def test_a_release_returns_a_side_streams_free_segment_to_the_default_stream(expandable):
    """a 60 MiB lives on stream 0; g 100 MiB on stream 1 is freed, its segment (expandable: 5 pages) cached
    there; x 120 MiB on stream 0 cannot use it: 280 MiB unbounded, 100 of it reclaimable. Under 200 MiB x's
    new memory would pass the limit, so the release returns stream 1's free segment (every stream's cache
    is released) and x fits: 60 + 120 = 180 MiB, the step's least (its allocated peak; 280 if a release
    kept the other streams' cache)."""
    unbounded = replay(SIDE_STREAM_PRESSURE, expandable_segments=expandable)
    assert (unbounded.reserved_peak_bytes, unbounded.reclaimable_at_peak_bytes) == (280 * MiB, 100 * MiB)
    tight = replay(SIDE_STREAM_PRESSURE, expandable_segments=expandable, limit_bytes=200 * MiB)
    assert (tight.reserved_peak_bytes, tight.releases) == (180 * MiB, 1)
    assert least_reserved(SIDE_STREAM_PRESSURE, expandable, resolution_bytes=1) == 180 * MiB


def fsdp_like_events(blocks: int, gather_bytes: int, scatter_bytes: int, activation_bytes: int, root_bytes=0):
    """FSDP2's pattern: each block's parameters all-gathered on stream 1 (the next block's prefetched before
    this one's are freed, so two at once) around its forward, which leaves activations on stream 0; in
    backward (reversed) gathered again, the activations freed, the gradient reduce-scattered through a
    buffer on stream 2. The root's gathered parameters (stream 1) live through the whole step."""
    events = [("root", root_bytes, 1), (("gather", 0), gather_bytes, 1)]
    for i in range(blocks):
        if i + 1 < blocks:
            events.append((("gather", i + 1), gather_bytes, 1))
        events += [(("activation", i), activation_bytes), (("gather", i), None)]
    events.append((("gather", blocks - 1), gather_bytes, 1))
    for i in reversed(range(blocks)):
        if i > 0:
            events.append((("gather", i - 1), gather_bytes, 1))
        events += [(("activation", i), None), (("scatter", i), scatter_bytes, 2), (("scatter", i), None)]
        events.append((("gather", i), None))
    return events + [("root", None)]


def side_stream_bytes(events, expandable: bool) -> int:
    """The reserved peak beyond the default stream's own (its events replayed alone)."""
    default = [event for event in events if len(event) < 3 or event[2] == 0]
    return replay(events, expandable).reserved_peak_bytes - replay(default, expandable).reserved_peak_bytes


def test_fsdp_side_streams_cache_their_buffers_beside_the_default_streams_peak():
    """4 blocks, G = 30 MiB gathered, R = 16 MiB reduce-scattered, A = 24 MiB activations, all own
    segments of exact size. Fixed: stream 0 peaks at 4 A = 96 MiB; stream 1 holds two G segments (the
    prefetch), reused block after block; stream 2 one R: 96 + 60 + 16 = 172 MiB, and nothing a side stream
    caches serves stream 0. One stream: 3 A + 3 G = 162 MiB (the fourth activation takes a freed gather
    segment, so backward's prefetch opens a third; the scatter buffers take freed ones). Expandable: stream
    0 maps 4 A = 96 MiB in 20 MiB pages (100), stream 1 2 G = 60 (3 pages), stream 2 R one page (20): 180."""
    events = fsdp_like_events(4, 30 * MiB, 16 * MiB, 24 * MiB)
    fixed = replay(events)
    assert fixed.reserved_peak_bytes == 172 * MiB
    assert side_stream_bytes(events, False) == 2 * 30 * MiB + 16 * MiB
    assert replay([event[:2] for event in events]).reserved_peak_bytes == 162 * MiB
    expandable = replay(events, expandable_segments=True)
    assert expandable.reserved_peak_bytes == 180 * MiB
    assert side_stream_bytes(events, True) == 60 * MiB + 20 * MiB


# --- the planner's analytic reserved model (planner/allocator.py) ----------------------------------------


def test_the_planners_parameter_tensors_are_the_models():
    from planner import allocator
    from planner.spec import model_spec

    for name in ("DiT-S/2", "DiT-XL/2"):
        spec = model_spec(name, 256)
        assert sum(allocator.parameter_elements(spec)) == spec.params_trainable


def test_the_planners_block_rounding_follows_the_segments():
    from planner import allocator

    # fixed segments: a tensor of 10 MiB or more is a segment of its own, rounded up to 2 MiB
    assert allocator.block_bytes(int(30.375 * MiB), "fixed") == 32 * MiB
    assert allocator.block_bytes(int(30.375 * MiB), "expandable") == int(30.375 * MiB)
    assert allocator.block_bytes(5 * MiB + 1, "fixed") == 5 * MiB + 512  # shares a 20 MiB segment


def test_the_planners_rounding_matches_a_replay_of_the_parameters():
    """The fixed-segment rounding of one copy of the parameters equals the allocator model's replay of
    allocating its large-pool tensors one by one (every tensor from 10 MiB is its own rounded segment; the
    1-10 MiB ones pack into shared 20 MiB segments), plus the small tensors' 512 B rounding."""
    from planner import allocator
    from planner.spec import model_spec

    for name in ("DiT-XL/2", "DiT-S/2", "DiT-B/8"):
        spec = model_spec(name, 256)
        sizes = [4 * n for n in allocator.parameter_elements(spec)]
        large = [size for size in sizes if size > MiB]
        replayed = replay([(index, size) for index, size in enumerate(large)])
        small_rounding = sum(round_request(size) - size for size in sizes if size <= MiB)
        assert replayed.reserved_peak_bytes - sum(
            large
        ) + small_rounding == allocator.parameter_rounding_bytes(spec, 4, 1, "fixed"), name
    spec = model_spec("DiT-XL/2", 256)
    # 2 MiB-rounded own segments and 28 x 4 matrices of 5.06 MiB three to a 20 MiB segment: ~328 MiB a copy
    assert 320 * MiB < allocator.parameter_rounding_bytes(spec, 4, 1, "fixed") < 335 * MiB


def test_segment_packing_of_1_to_10_mib_tensors_worked_by_hand():
    """Four 5 MiB + 512 B tensors: three share the first 20 MiB segment (rest 20 - 15.0015 = 4.9985 MiB, too
    small for the fourth), the fourth opens a second: 40 MiB for 20 MiB + 2 KiB of tensors. A 4 MiB tensor
    then fits the first segment's rest (best fit: 4.9985 < the second's 14.9995) and costs nothing more."""
    from planner.allocator import packed_rounding_bytes

    sizes = [5 * MiB + 512] * 4
    assert packed_rounding_bytes(sizes) == 40 * MiB - sum(sizes)
    assert packed_rounding_bytes(sizes + [4 * MiB]) == 40 * MiB - sum(sizes) - 4 * MiB
    # a rest of 1 MiB or less stays with its block: two 9.5 MiB tensors leave 1 MiB, which stays with the
    # second, so a 1.5 MiB tensor opens a second segment (40 MiB for 20.5 MiB)
    assert packed_rounding_bytes([int(9.5 * MiB)] * 2 + [int(1.5 * MiB)]) == 40 * MiB - int(20.5 * MiB)
    replayed = replay([(index, size) for index, size in enumerate(sizes + [4 * MiB])])
    assert replayed.reserved_peak_bytes == 40 * MiB  # the allocator model agrees


def test_an_online_step_holds_what_its_first_encode_reserved_at_every_later_moment():
    """planner.memory.step_memory with online latents: the first encode's reserved bytes (the floor: its
    maps on the persistent tensors) are the encode moment's reserved figure, and no moment reserves less
    (reserved does not fall without a release); under pressure each moment may need less. A measured
    fragmentation (a calibration) replaces the allocator model, floor included: its share is the measured
    ratio plus cuBLAS's workspaces."""
    from planner.components import ALLOCATED
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.memory import online_floor_bytes, phase_components, step_memory
    from planner.spec import model_spec

    spec, cluster = model_spec("DiT-XL/2", 256), Cluster(1, 1, 80 * 10**9)
    online = Decision(16, 1, 28, "bf16", "ddp", "online")
    for segments in ("expandable", "fixed"):
        a = Assumptions(allocator_segments=segments)
        estimate = step_memory(spec, online, cluster, a)
        own = {m: phase_components(spec, online, cluster, a, m) for m in estimate.phases}
        floor = online_floor_bytes(spec, online, cluster, a, own)

        def reserved(parts):
            return sum(parts[name] for name in ALLOCATED) + parts["allocator"]

        # the footprint (1.2 W fixed, 1.0 W expandable) in place of the encode's 1.02 / 1.03 W
        assert (reserved(own["vae_encode"]) < floor) == (segments == "fixed")
        assert all(reserved(parts) == max(floor, reserved(own[m])) for m, parts in estimate.phases.items())
        assert estimate.reserved_peak_bytes == max(reserved(parts) for parts in estimate.phases.values())
        assert all(0 <= released for released in estimate.reclaimable.values())
    measured = Assumptions(fragmentation=0.1)
    estimate = step_memory(spec, online, cluster, measured)
    for parts in estimate.phases.values():
        allocated = sum(parts[name] for name in ALLOCATED)
        assert parts["allocator"] == int(allocated * 1.1) - allocated + measured.cublas_workspace_bytes


def test_the_search_fits_the_reserved_peak_and_the_overhead():
    from planner.components import ALLOCATED
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.memory import step_memory
    from planner.spec import model_spec

    spec = model_spec("DiT-XL/2", 256)
    decision = Decision(32, 1, 0, "bf16", "ddp", "precomputed")
    cluster = Cluster(1, 8, 80 * 10**9)
    estimate = step_memory(spec, decision, cluster, Assumptions())
    parts = estimate.components
    allocated = sum(parts[name] for name in ALLOCATED)
    assert estimate.reserved_peak_bytes == allocated + parts["allocator"]
    assert estimate.peak_bytes == estimate.reserved_peak_bytes + parts["overhead"]
    # a budget that holds the allocated bytes and the overhead, but not the reserve, does not fit
    tight = step_memory(spec, decision, cluster, Assumptions(), budget_bytes=allocated + parts["overhead"])
    assert not tight.fits
    # fixed segments reserve more than expandable ones for the same tensors
    fixed = step_memory(spec, decision, cluster, Assumptions(allocator_segments="fixed"))
    assert fixed.reserved_peak_bytes > estimate.reserved_peak_bytes
    assert fixed.allocated_peak_bytes == estimate.allocated_peak_bytes
    # online latents: a budget of the step's least fits (the encoder's cached pages released), one byte less not
    online = Decision(16, 1, 28, "bf16", "ddp", "online")
    relaxed = step_memory(spec, online, cluster, Assumptions())
    assert relaxed.needed_bytes < relaxed.peak_bytes
    assert step_memory(spec, online, cluster, Assumptions(), budget_bytes=relaxed.needed_bytes).fits
    assert not step_memory(spec, online, cluster, Assumptions(), budget_bytes=relaxed.needed_bytes - 1).fits


def test_the_planners_pressure_figure_leaves_out_what_a_release_returns():
    """Expandable segments, online latents: T = 10 GiB transient, E = 4 GiB encoder working set freed before
    the DiT, whose pages (1.0 E) the step reserved earlier: with memory to spare that stays reserved (the
    floor, held + 0.03 T + E); under pressure 0.01 T + 0.10 E stays (the encoder's pages are unmapped):
    0.02 x 10 + 0.9 x 4 = 3.8 GiB less."""
    from planner import allocator
    from planner.spec import model_spec

    GiB = 1 << 30
    spec = model_spec("DiT-XL/2", 256)
    persistent = 11 * GiB
    held = allocator.reserved_bytes(spec, persistent + 10 * GiB, persistent, segments="expandable")
    held -= 0.03 * 10 * GiB  # tensors, rounding and pages: no fragmentation
    kwargs = dict(segments="expandable", earlier_working_bytes=4 * GiB, reserved_floor_bytes=held + 4.3 * GiB)
    spare = allocator.reserved_bytes(spec, persistent + 10 * GiB, persistent, **kwargs)
    tight = allocator.reserved_bytes(spec, persistent + 10 * GiB, persistent, pressure=True, **kwargs)
    assert spare == pytest.approx(held + 4.3 * GiB, abs=2)
    assert spare - tight == pytest.approx(3.8 * GiB, abs=2)
    # precomputed latents, fixed segments: 0.02 T spare and under pressure (a release returns whole free
    # segments, which the transient tensors' packing leaves few of): nothing less
    fixed = dict(segments="fixed")
    spare = allocator.reserved_bytes(spec, persistent + 10 * GiB, persistent, **fixed)
    tight = allocator.reserved_bytes(spec, persistent + 10 * GiB, persistent, pressure=True, **fixed)
    assert spare == tight
    # ... but the segments the first backward mapped for gradients are whole free ones once the step is over
    kwargs = dict(segments="fixed", reserved_floor_bytes=spare + GiB)
    assert allocator.reserved_bytes(spec, persistent + 10 * GiB, persistent, **kwargs) == spare + GiB


def test_online_latents_reserve_the_first_encodes_footprint_and_reuse_it():
    """Fixed segments, W = 4 GiB encoder working set, the encode moment 30 GiB reserved as the steady-state
    model gives it (held tensors + 1.02 x its transient bytes, W among them). AdamW's states exist before the
    first step, so the encode maps its footprint, 1.2 W = 4.8 GiB on an empty cache, on the persistent
    tensors: 30 - 1.02 x 4 + 4.8 = 30.72 GiB; with expandable segments the footprint is W itself: 30 - 1.03 x
    4 + 4 = 29.88 GiB. Every later encode and the DiT's moments reuse it (the replayed grid's second encodes
    map nothing new: benchmarks/online_reserved_timeline.py)."""
    from planner.allocator import online_reserved_bytes

    GiB = 1 << 30
    fixed = online_reserved_bytes(encode_reserved=30 * GiB, working_bytes=4 * GiB, segments="fixed")
    assert fixed == pytest.approx(30.72 * GiB, abs=2)
    expandable = online_reserved_bytes(encode_reserved=30 * GiB, working_bytes=4 * GiB, segments="expandable")
    assert expandable == pytest.approx(29.88 * GiB, abs=2)
    # no encoder, no change
    assert online_reserved_bytes(encode_reserved=30 * GiB, working_bytes=0, segments="fixed") == 30 * GiB


def test_online_latents_with_a_lazy_adamw_state_map_the_second_encode_anew():
    """Another codebase's AdamW makes its state in the first optimizer step (--assume adamw_state=lazy). Fixed
    segments, W = 4 GiB, the encoder's largest maps 2 GiB, the state 8 GiB (its rounding left out, for round
    figures). Steady-state moments: encode 30 GiB reserved, the DiT's largest 28, the optimizer step 27
    reserved over 24 allocated. Before the first encode: 30 - 8 - 1.02 x 4 = 17.92; the first encode takes
    it to 22.72, the first DiT (20 without the state) stays inside; the optimizer step needs 24 allocated,
    more than that cache: it grows to 27 and leaves nothing, so the second encode maps all of its 4.8 anew:
    31.8 GiB. With the optimizer step at 20 allocated, 2.72 is left over, but a state of 8 GiB made out of
    that cache spoils four maps' room, more than the footprint: 31.8 again. Had the state been 1 GiB (the
    same figures otherwise), it would spoil one map's room (2 of 4.8) and leave the 2.72: 29.08 GiB.
    Expandable: footprint W, 17.8 + 4 = 21.8 cached, nothing left at 24: 27 + 4 GiB."""
    from planner.allocator import online_reserved_bytes

    GiB = 1 << 30

    def lazy(optimizer_allocated, segments="fixed", states_bytes=8 * GiB):
        states = dict(dit_reserved=28 * GiB, optimizer_reserved=27 * GiB, states_held_bytes=8 * GiB)
        return online_reserved_bytes(
            encode_reserved=30 * GiB,
            working_bytes=4 * GiB,
            segments=segments,
            lazy_states={
                **states,
                "optimizer_allocated": optimizer_allocated,
                "states_bytes": states_bytes,
                "map_bytes": 2 * GiB,
            },
        )

    assert lazy(24 * GiB) == pytest.approx(31.8 * GiB, abs=2)
    assert lazy(20 * GiB) == pytest.approx(31.8 * GiB, abs=2)  # the state spoiled the whole footprint
    assert lazy(20 * GiB, states_bytes=GiB) == pytest.approx(29.08 * GiB, abs=2)
    assert lazy(24 * GiB, "expandable") == pytest.approx(31 * GiB, abs=2)


def test_the_plan_of_a_lazy_adamw_state_reserves_more_with_online_latents_only():
    from planner.decision import Cluster, Decision
    from planner.errors import PlanError
    from planner.hardware import Assumptions
    from planner.memory import step_memory
    from planner.spec import model_spec

    spec, cluster = model_spec("DiT-XL/2", 256), Cluster(1, 1, 80 * 10**9)
    for latents, grows in (("online", True), ("precomputed", False)):
        decision = Decision(16, 1, 28, "bf16", "ddp", latents)
        for segments in ("expandable", "fixed"):
            eager, lazy = (
                step_memory(
                    spec, decision, cluster, Assumptions(allocator_segments=segments, adamw_state=state)
                )
                for state in ("eager", "lazy")
            )
            assert (lazy.reserved_peak_bytes > eager.reserved_peak_bytes) == grows
            assert lazy.allocated_peak_bytes == eager.allocated_peak_bytes
    with pytest.raises(PlanError, match="adamw_state must be eager or lazy"):
        Assumptions(adamw_state="never").validate()


def test_the_memory_table_says_when_a_plan_fits_only_after_a_release():
    from planner.plan import make_plan
    from planner.report.tables import memory_rows

    # fixed segments, DiT-L/2 without checkpointing: a release returns the segments the first backward
    # mapped for the 24 MiB adaLN gradients
    fixed = {"allocator_segments": "fixed"}
    plan = make_plan(gpus=1, vram="80G", global_batch=8, model="DiT-L/2", checkpointing=0, assumptions=fixed)
    m = plan["memory"]
    assert m["needed_bytes"] < m["peak_bytes"]
    assert "after release" not in [row[0] for row in memory_rows(plan)[1]]  # the peak fits: no row
    m["budget_bytes"] = (m["needed_bytes"] + m["peak_bytes"]) // 2
    labels = [row[0] for row in memory_rows(plan)[1]]
    assert labels[labels.index("after release") + 1] == "budget"


def test_fsdp_stream_pools_hold_what_the_default_stream_cannot_reuse():
    """zero3 and zero2 bf16, DiT-XL/2, 8 GPUs: units of B = block_params parameters, the root R = params -
    28 B. The copy-in stream caches the flat all-gather outputs in flight (two units and the root: 2 x 2 B
    and 2 R bytes, 45.6 and 10.5 MiB), the reduce-scatter stream one unit's output shard (2 B / 8 = 5.7 MiB).
    Fixed segments: 2 x 46 + 12 MiB (each >= 10 MiB rounded to 2 MiB) + one 20 MiB segment for the shard =
    124 MiB; expandable: 101.7 -> 120 MiB of pages + 20 = 140 MiB; the same at every moment (cached once the
    first step ran) and for zero2 (which gathers every unit once, two in flight too). DDP: none."""
    from planner.components import stream_pool_bytes
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.spec import model_spec

    spec = model_spec("DiT-XL/2", 256)
    cluster = Cluster(1, 8, 80 * 10**9)
    fixed, expandable = Assumptions(allocator_segments="fixed"), Assumptions(allocator_segments="expandable")
    for sharding in ("zero3", "zero2"):
        plan = Decision(32, 1, 0, "bf16", sharding, "precomputed")
        assert stream_pool_bytes(spec, plan, cluster, fixed) == 124 * MiB
        assert stream_pool_bytes(spec, plan, cluster, expandable) == 140 * MiB
    ddp = Decision(32, 1, 0, "bf16", "ddp", "precomputed")
    assert stream_pool_bytes(spec, ddp, cluster, expandable) == 0


def test_the_replayed_fsdp_side_streams_equal_the_planners_stream_pools():
    """DiT-XL/2 zero3 bf16 on 8 GPUs through `fsdp_like_events`: gathers G = 2 B (one unit in bf16) and the
    root 2 R on stream 1, the reduce-scatter output shard 2 B / 8 on stream 2. What the replay's side streams
    hold beyond the default stream's own peak is the planner's `stream_pool_bytes`, in both modes."""
    from planner.components import stream_pool_bytes
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.spec import model_spec

    spec = model_spec("DiT-XL/2", 256)
    b, r = spec.block_params, spec.params_trainable - spec.depth * spec.block_params
    events = fsdp_like_events(spec.depth, 2 * b, 2 * b // 8, 200 * MiB, root_bytes=2 * r)
    zero3, cluster = Decision(32, 1, 0, "bf16", "zero3", "precomputed"), Cluster(1, 8, 80 * 10**9)
    for expandable, segments in ((False, "fixed"), (True, "expandable")):
        planned = stream_pool_bytes(spec, zero3, cluster, Assumptions(allocator_segments=segments))
        assert side_stream_bytes(events, expandable) == planned


def test_gradients_no_freed_block_holds_map_segments_of_their_own():
    """Fixed segments, one block's backward making gradients of 20.25, 20.25 and 30.4 MiB (DiT-XL's fc2,
    fc1, adaLN; blocks of 22, 22 and 32 MiB), worked by the allocator's rules. Beside 18 MiB activations
    (DiT-XL/8 at micro-batch 128) no freed block of the step is large enough, and a 20 MiB segment is not
    either: each maps its own, 76 MiB a block. Beside 36 MiB ones (the block frees two): fc2 splits one
    (15.75 MiB left), fc1 cannot take that rest and splits the other, the adaLN gradient finds neither: 32
    MiB a block. Beside 72 MiB ones all three share one: none. Gradients of 20 MiB or less take 20 MiB
    segments (DiT-B's 9 and 13.5 MiB): none. The outer gradients follow the first rule alone."""
    from planner.allocator import new_gradient_segment_bytes

    xl = [int(20.25 * MiB), int(20.25 * MiB), int(30.375 * MiB)]
    assert new_gradient_segment_bytes(xl, 28, [], 18 * MiB) == 28 * 76 * MiB
    assert new_gradient_segment_bytes(xl, 28, [], 36 * MiB) == 28 * 32 * MiB
    assert new_gradient_segment_bytes(xl, 28, [], 72 * MiB) == 0
    assert new_gradient_segment_bytes([9 * MiB, int(13.5 * MiB)], 12, [], 6 * MiB) == 0
    outer = [int(10.125 * MiB), int(30.375 * MiB)]  # the final layer's adaLN, a 30 MiB embedder matrix
    assert new_gradient_segment_bytes([], 28, outer, 18 * MiB) == 32 * MiB


def test_the_gradient_rule_is_what_the_allocator_model_replays():
    """The rule against the replay (dit_accel.memtrace.allocator, fixed segments) of a step it describes: each
    of 4 blocks saves two largest transient tensors in the forward; its backward frees them, then makes its
    three gradients, which live to the step's end. What the backward maps on top of the forward is the rule's
    figure, beside 18, 36 and 72 MiB tensors."""
    from dit_accel.memtrace.allocator import replay
    from planner.allocator import new_gradient_segment_bytes

    gradients = [int(20.25 * MiB), int(20.25 * MiB), int(30.375 * MiB)]
    for largest in (18 * MiB, 36 * MiB, 72 * MiB):
        blocks, forward = 4, []
        for block in range(blocks):
            forward += [(("act", block, 0), largest), (("act", block, 1), largest)]
        events = list(forward)
        for block in reversed(range(blocks)):
            events += [(("act", block, 0), None), (("act", block, 1), None)]
            events += [(("grad", block, i), size) for i, size in enumerate(gradients)]
        mapped = replay(events).reserved_peak_bytes - replay(forward).reserved_peak_bytes
        assert mapped == new_gradient_segment_bytes(gradients, blocks, [], largest), largest


def test_fixed_segments_hold_the_forward_and_the_gradients_own_segments():
    """DiT-L/2 bf16 at micro-batch 8, 256 px, nothing checkpointed: its 16 MiB MLP activations cannot hold the
    24 MiB adaLN gradients, so with fixed segments the reserved peak is the forward's reserve plus 24 blocks
    of 24 MiB (the replay of this grid point maps 608 MiB in its first backward); a release returns them, and
    expandable segments (which map pages where they are needed) have no such term."""
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.memory import gradient_segment_floor_bytes, phase_components, step_memory
    from planner.spec import model_spec

    spec, cluster = model_spec("DiT-L/2", 256), Cluster(1, 1, 80 * 10**9)
    decision = Decision(8, 1, 0, "bf16", "ddp", "precomputed")
    fixed = Assumptions(allocator_segments="fixed")
    forward = phase_components(spec, decision, cluster, fixed, "end_of_forward")
    forward_reserved = sum(forward.values()) - forward["overhead"]
    floor = gradient_segment_floor_bytes(spec, decision, cluster, fixed)
    assert floor == forward_reserved + 24 * 24 * MiB
    estimate = step_memory(spec, decision, cluster, fixed)
    assert estimate.reserved_peak_bytes == floor
    assert estimate.needed_bytes < estimate.peak_bytes  # a release returns them
    expandable = Assumptions(allocator_segments="expandable")
    assert gradient_segment_floor_bytes(spec, decision, cluster, expandable) == 0
    # none where the gradients are copied into DDP's buckets at once (gradient_as_bucket_view, several GPUs);
    # without the view they are kept
    eight = Cluster(1, 8, 80 * 10**9)
    assert gradient_segment_floor_bytes(spec, decision, eight, fixed) == 0
    kept = Decision(8, 1, 0, "bf16", "ddp", "precomputed", gradient_as_bucket_view=False)
    assert gradient_segment_floor_bytes(spec, kept, eight, fixed) > 24 * 24 * MiB
    # checkpointing every block: the gradients' segments are among the backward's own figures, no floor binds
    checkpointed = Decision(8, 1, 24, "bf16", "ddp", "precomputed")
    every = step_memory(spec, checkpointed, cluster, fixed)
    assert every.reserved_peak_bytes > gradient_segment_floor_bytes(spec, checkpointed, cluster, fixed)


def test_a_later_micro_steps_encode_maps_the_room_the_gradients_spoiled_worked_by_hand():
    """Online latents, gradient accumulation: the encoder's largest maps of 256 MiB (DiT at 256 px, micro-batch
    8, fp32 VAE), a working set of five. DiT-S/2's 125 MiB of gradients spoil one map's room: 256 MiB mapped
    anew; DiT-B/4's 497 MiB two: 512. DiT-XL/2's 2,575 MiB at micro-batch 16 (512 MiB maps, 2,560 MiB working
    set) would spoil six, more than fixed segments' footprint of 1.2 W (3,072 MiB: all of it) and more than
    expandable segments' W, which the gradients themselves pass. No gradients, nothing."""
    from planner.allocator import accumulating_encode_bytes

    for segments in ("fixed", "expandable"):
        assert accumulating_encode_bytes(125 * MiB, 256 * MiB, 1280 * MiB, segments) == 256 * MiB
        assert accumulating_encode_bytes(497 * MiB, 256 * MiB, 1280 * MiB, segments) == 512 * MiB
        assert accumulating_encode_bytes(0, 256 * MiB, 1280 * MiB, segments) == 0
    assert accumulating_encode_bytes(2575 * MiB, 512 * MiB, 2560 * MiB, "fixed") == 3072 * MiB
    assert accumulating_encode_bytes(2575 * MiB, 512 * MiB, 2560 * MiB, "expandable") == 2575 * MiB


def test_the_later_encode_rule_is_what_the_allocator_model_replays():
    """Fixed segments: an encode of five 256 MiB maps (each its own segment), freed; the first micro-step's
    backward makes gradients of 62 MiB (4 to a map's segment, packed tightly by best fit); the next encode
    finds a map's room in every segment no gradient entered and maps the rest: the rule's ceil(G / 256 MiB)
    segments, for one, two and three segments' worth of gradients."""
    from planner.allocator import accumulating_encode_bytes

    maps = [(("map", i), 256 * MiB) for i in range(5)]
    freed = [(("map", i), None) for i in range(5)]
    for count in (2, 8, 10):
        gradients = [(("grad", i), 62 * MiB) for i in range(count)]
        first = maps + freed + gradients
        second = first + [(("again", i), 256 * MiB) for i in range(5)]
        mapped = replay(second).reserved_peak_bytes - replay(first).reserved_peak_bytes
        rule = accumulating_encode_bytes(count * 62 * MiB, 256 * MiB, 5 * 256 * MiB, "fixed")
        assert mapped == rule == -(-count // 4) * 256 * MiB, count


def test_an_accumulating_online_plan_reserves_the_later_encodes_maps_and_keeps_them_under_pressure():
    """DiT-B/4 fp32 online at micro-batch 8, two micro-steps: the second encode runs beside the first one's
    497 MiB of gradients, which spoil two of its 256 MiB maps' room: the floor is the first encode's
    footprint plus 512 MiB, where the encode moment had counted the gradients (1.02 G fixed, 1.03 G
    expandable: the larger of the two figures is kept). With fixed
    segments a release cannot return that (the gradients live in the spoiled segments, the encode fills the
    rest): the least the step runs in is the floor; expandable segments release as before. One micro-step:
    no term."""
    from planner.allocator import ENCODER_FOOTPRINT, TRANSIENT_FRAGMENTATION
    from planner.components import ALLOCATED
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.memory import online_floor_bytes, phase_components, step_memory
    from planner.spec import model_spec

    spec, cluster = model_spec("DiT-B/4", 256), Cluster(1, 1, 80 * 10**9)
    accumulating = Decision(8, 2, 6, "fp32", "ddp", "online")
    gradients = 4 * spec.params_trainable
    for segments in ("fixed", "expandable"):
        a = Assumptions(allocator_segments=segments)
        own = {
            m: phase_components(spec, accumulating, cluster, a, m) for m in ("vae_encode", "end_of_forward")
        }
        encode = own["vae_encode"]
        encode_reserved = sum(encode[name] for name in ALLOCATED) + encode["allocator"]
        working = encode["vae"] - phase_components(spec, accumulating, cluster, a, "optimizer_step")["vae"]
        f = TRANSIENT_FRAGMENTATION[segments]
        first = encode_reserved - (1 + f) * working + ENCODER_FOOTPRINT[segments] * working
        floor = online_floor_bytes(spec, accumulating, cluster, a, own)
        assert floor == int(first + max(0, 512 * MiB - (1 + f) * gradients))
        estimate = step_memory(spec, accumulating, cluster, a)
        assert estimate.reserved_peak_bytes >= floor
        assert (estimate.needed_bytes == estimate.peak_bytes) == (segments == "fixed")
        single = Decision(8, 1, 6, "fp32", "ddp", "online")
        own_single = {
            m: phase_components(spec, single, cluster, a, m) for m in ("vae_encode", "end_of_forward")
        }
        encode = own_single["vae_encode"]
        plain = sum(encode[name] for name in ALLOCATED) + encode["allocator"]
        assert online_floor_bytes(spec, single, cluster, a, own_single) == int(
            plain - (1 + f) * working + ENCODER_FOOTPRINT[segments] * working
        )


def test_the_gradients_a_later_encode_runs_beside_follow_where_they_live():
    """`accumulated_gradient_bytes`: 4 B per parameter with DDP on one GPU or without the bucket view, none in
    DDP's buckets (gradient_as_bucket_view on several GPUs), a shard under FSDP whatever that DDP flag says
    (the reduce-scatter output each micro-step accumulates into), none without accumulation; REPA's
    projector's among them. Under zero3 on 8
    GPUs the plan's floor then holds the later encodes' term, and with fixed segments its least holds the
    floor at the encode (the flag changes neither)."""
    from planner.components import moments, repa_projector_params
    from planner.decision import Cluster, Decision
    from planner.hardware import Assumptions
    from planner.memory import accumulated_gradient_bytes, online_floor_bytes, phase_components, step_memory
    from planner.spec import model_spec

    spec = model_spec("DiT-XL/2", 256)
    one, eight = Cluster(1, 1, 80 * 10**9), Cluster(1, 8, 80 * 10**9)
    params = spec.params_trainable

    def step(sharding="ddp", accumulation=2, view=True):
        return Decision(16, accumulation, 28, "bf16", sharding, "online", gradient_as_bucket_view=view)

    assert accumulated_gradient_bytes(spec, step(), one) == 4 * params
    assert accumulated_gradient_bytes(spec, step(), eight) == 0
    assert accumulated_gradient_bytes(spec, step(view=False), eight) == 4 * params
    assert accumulated_gradient_bytes(spec, step(accumulation=1), one) == 0
    for view in (True, False):
        assert accumulated_gradient_bytes(spec, step("zero3", view=view), eight) == 4 * params // 8
    repa = Decision(16, 2, 28, "bf16", "ddp", "online", repa="dinov2-b")
    projector = repa_projector_params(spec, repa)
    assert projector > 0 and accumulated_gradient_bytes(spec, repa, one) == 4 * (params + projector)
    fixed = Assumptions(allocator_segments="fixed")
    with_view, without = (step_memory(spec, step("zero3", view=v), eight, fixed) for v in (True, False))
    assert with_view.reserved_peak_bytes == without.reserved_peak_bytes
    assert with_view.needed_bytes == without.needed_bytes

    def floor(decision):
        own = {m: phase_components(spec, decision, eight, fixed, m) for m in moments(spec, decision)}
        return online_floor_bytes(spec, decision, eight, fixed, own)

    assert floor(step("zero3")) > floor(step("zero3", accumulation=1))
    assert with_view.needed_bytes == floor(step("zero3")) + with_view.phases["vae_encode"]["overhead"]


def test_a_lazy_state_and_accumulation_both_count():
    """The lazy case above (31.8 GiB: the optimizer step's 27 GiB reserve decides it) under gradient
    accumulation: 2 GiB of gradients, whose later encodes need 3 GiB, 3 - 1.02 x 2 = 0.96 GiB more than the
    encode moment counted. That adds to the lazy figure: 32.76 GiB (folded into the first encode's figure,
    it was lost under the optimizer step's reserve: 31.8)."""
    from planner.allocator import online_reserved_bytes

    GiB = 1 << 30
    states = dict(
        dit_reserved=28 * GiB,
        optimizer_reserved=27 * GiB,
        states_held_bytes=8 * GiB,
        optimizer_allocated=24 * GiB,
        states_bytes=8 * GiB,
        map_bytes=2 * GiB,
    )
    kwargs = dict(encode_reserved=30 * GiB, working_bytes=4 * GiB, segments="fixed", lazy_states=states)
    assert online_reserved_bytes(**kwargs) == pytest.approx(31.8 * GiB, abs=2)
    accumulating = online_reserved_bytes(**kwargs, accumulated_bytes=2 * GiB, later_encode_bytes=3 * GiB)
    assert accumulating == pytest.approx(32.76 * GiB, abs=2)
